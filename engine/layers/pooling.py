"""Pooling (Caffe's pooling_layer.cpp): MAX and AVE, global pooling, pad, CEIL/FLOOR rounding.

Caffe's rules kept here:
- output size ceil((in + 2p - k) / s) + 1 (FLOOR mode: floor), and with padding the last window
  must start inside image + leading pad: if (out - 1)*s >= in + p then out -= 1;
- MAX: windows are clipped to the real image, so padding never wins (it holds -FLT_MAX, Caffe's
  initial maximum, and a strictly greater value is needed to win); ties go to the first maximum in
  row-major window order, which alone receives the gradient; an optional second top gives that
  argmax as the flat index h*W + w in the input plane (as a float), -1 for a window without pixels;
- AVE: the sum covers real pixels only, the divisor counts the window clipped to [start, in + p),
  i.e. padding cells count but the ceil overshoot past the padding does not.

Implementation (no loop over samples or pixels; kh*kw passes, each one long contiguous array op):
the padded input is split once into its stride phases (sh*sw arrays holding the cells at row
a + sh*q, column b + sw*q; padding cells hold the neutral value, -FLT_MAX for MAX, 0 for AVE), each
flattened over (N, C, Qh, Qw) with Qh = out_h + (kh-1)//sh, Qw = out_w + (kw-1)//sw. Kernel offset
(i, j) is then the flat slice of phase (i%sh, j%sw) starting at (i//sh)*Qw + j//sw: the output is
computed on an out_h+... x Qw grid (the cells past out_h x out_w are discarded), and every pass over
an offset is a contiguous slice, which numpy runs as one long SIMD loop instead of thousands of
short strided rows, each paying a loop's start-up. The passes take a run of samples at a time, all
offsets over one run while it is in cache (pooling_plan.CHUNK_BYTES). Forward is a running maximum (or sum) over the offsets;
MAX backward hands the top gradient to the first offset (row-major) that holds the window's maximum
and removes it from what remains, so a later tie receives nothing; the phase gradients are then
written back into the bottom gradient. Global pooling (one window covering the whole plane) is a
plain reduction. The optional argmax top keeps the direct strided form (_forward_max_argmax).
A MAX window with stride 1 (GoogLeNet's 3x3 pools) is separable: a 1 x kw pass along the rows,
then a kh x 1 pass down the columns of its result (_between_passes), each on the same grids,
kh + kw offsets instead of kh * kw.
"""
import numpy

from .. import kernels
from ..backend import get_array_module
from ..layer import Layer
from ..registry import register
from ..parallel import BufferCache, WorkerBuffers, parallel
from .im2col import NEG_FLT_MAX, Geometry
from .pooling_plan import PoolingPlan

MAX, AVE, STOCHASTIC = 0, 1, 2
CEIL, FLOOR = 0, 1


def pooled_size(size, kernel, pad, stride, round_mode=CEIL):
    """Caffe's pooled output size for one spatial dimension (can be < 1 for a bad setting)."""
    span = size + 2 * pad - kernel
    if round_mode == FLOOR:
        out = span // stride + 1
    else:
        out = -((-span) // stride) + 1
    if pad > 0 and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@register("Pooling")
class PoolingLayer(Layer):
    """MAX / AVE pooling over the last two axes of a 4-axis bottom (N x C x H x W)."""

    exact_bottoms = 1
    min_tops = 1
    max_tops = 2

    def layer_setup(self, bottom, top):
        pp = self.param.pooling_param
        self.method = int(pp.pool)
        if self.method == STOCHASTIC:
            raise self.error("pool: STOCHASTIC is not supported (Caffe itself has it on GPU only): "
                             "use MAX or AVE")
        if self.method not in (MAX, AVE):
            raise self.error(f"unknown pool method {self.method}: use MAX or AVE")
        if len(top) > 1 and self.method != MAX:
            raise self.error("a second top (the argmax mask) exists only for MAX pooling: give "
                             "one top")
        if bottom[0].ndim != 4:
            raise self.error(f"needs a 4-axis bottom (N x C x H x W), got shape {bottom[0].shape}")
        self.global_pooling = bool(pp.global_pooling)
        has = pp.HasField
        if self.global_pooling:
            if has("kernel_size") or has("kernel_h") or has("kernel_w"):
                raise self.error("global_pooling takes its kernel from the bottom's H x W: do not "
                                 "set kernel_size, kernel_h or kernel_w")
            kh = kw = 0
        else:
            if has("kernel_size") and (has("kernel_h") or has("kernel_w")):
                raise self.error("give kernel_size or kernel_h and kernel_w, not both")
            if has("kernel_size"):
                kh = kw = int(pp.kernel_size)
            elif has("kernel_h") and has("kernel_w"):
                kh, kw = int(pp.kernel_h), int(pp.kernel_w)
            else:
                raise self.error("gives no kernel size: set kernel_size, or both kernel_h and "
                                 "kernel_w (or global_pooling: true)")
            if kh < 1 or kw < 1:
                raise self.error(f"kernel {kh}x{kw}: kernel dimensions must be positive")
        ph, pw = self._pair(pp, "pad", 0)
        sh, sw = self._pair(pp, "stride", 1)
        if sh < 1 or sw < 1:
            raise self.error(f"stride {sh}x{sw}: strides must be positive")
        if self.global_pooling and (ph or pw or sh != 1 or sw != 1):
            raise self.error("global_pooling needs pad 0 and stride 1")
        if (ph or pw) and (ph >= kh or pw >= kw):
            raise self.error(f"pad {ph}x{pw} must be smaller than the kernel {kh}x{kw}")
        self.round_mode = int(pp.round_mode)
        self.geom = Geometry(kh, kw, sh, sw, ph, pw, 1, 1)
        self.buffers = BufferCache()
        self._wbuf = WorkerBuffers()   # scratch of one worker thread (one sample range each)
        self._wbuf_rows = WorkerBuffers()   # the same for the row pass of a separable MAX
        self._plan = None
        self._plan_key = None
        self._rows_plan = self._cols_plan = None

    def _pair(self, pp, name, default):
        has = pp.HasField
        if has(name):
            if has(f"{name}_h") or has(f"{name}_w"):
                raise self.error(f"give {name} or {name}_h and {name}_w, not both")
            v = int(getattr(pp, name))
            return v, v
        if has(f"{name}_h") or has(f"{name}_w"):
            if not (has(f"{name}_h") and has(f"{name}_w")):
                raise self.error(f"give both {name}_h and {name}_w (or {name})")
            return int(getattr(pp, f"{name}_h")), int(getattr(pp, f"{name}_w"))
        return default, default

    def reshape(self, bottom, top):
        x = bottom[0]
        if x.ndim != 4:
            raise self.error(f"needs a 4-axis bottom (N x C x H x W), got shape {x.shape}")
        n, c, h, w = x.shape
        g = self.geom
        if self.global_pooling:
            g = self.geom = g._replace(kh=h, kw=w)
        out_h = pooled_size(h, g.kh, g.ph, g.sh, self.round_mode)
        out_w = pooled_size(w, g.kw, g.pw, g.sw, self.round_mode)
        if out_h < 1 or out_w < 1:
            raise self.error(f"output would be {out_h}x{out_w} for a {h}x{w} input (kernel "
                             f"{g.kh}x{g.kw}, pad {g.ph}x{g.pw}, stride {g.sh}x{g.sw}): use a "
                             f"smaller kernel or a larger input")
        for t in top:
            t.reshape(n, c, out_h, out_w)
        key = (h, w, g, x.dtype)
        if self._plan_key != key:
            self._plan = PoolingPlan(h, w, out_h, out_w, g, x.dtype, self.xp)
            self._plan_key = key
            self.buffers.clear()   # padded buffers keep their border only for one geometry
            self._wbuf.clear()
            self._wbuf_rows.clear()
            self._rows_plan = self._cols_plan = None
            if (self.method == MAX and len(top) == 1 and not self._plan.global_reduce
                    and g.sh == 1 and g.sw == 1 and g.kh > 1 and g.kw > 1):
                # separable (see _between_passes): along each row (1 x kw), then down the columns
                # (kh x 1) of those row maxima
                self._rows_plan = PoolingPlan(h, w, h, out_w,
                                              Geometry(1, g.kw, 1, 1, 0, g.pw, 1, 1),
                                              x.dtype, self.xp)
                self._cols_plan = PoolingPlan(h, out_w, out_h, out_w,
                                              Geometry(g.kh, 1, 1, 1, g.ph, 0, 1, 1),
                                              x.dtype, self.xp)

    # ----- forward ------------------------------------------------------------------------------
    def forward(self, bottom, top):
        x = bottom[0].data
        xp = get_array_module(x)
        plan = self._plan
        y = top[0].data
        n, c = x.shape[:2]
        run = kernels.runner_for(x)
        if run is not None:   # the fused kernels (CuPy): one launch, global pooling included
            if self.method == MAX:
                kernels.calls.max_pool_forward(run, x, y, self._kernel_mask(y, xp),
                                               top[1].data if len(top) > 1 else None, self.geom)
            else:
                kernels.calls.ave_pool_forward(run, x, y, self.geom)
            return
        if plan.global_reduce:
            flat = x.reshape(n, c, -1)
            if self.method == AVE:
                xp.sum(flat, axis=2, out=y.reshape(n, c))
                y *= plan.inv_divisor
            else:
                ymax = self.buffers.get("max", y.shape, y.dtype, xp)
                xp.max(flat, axis=2, out=ymax.reshape(n, c))
                if len(top) > 1:
                    top[1].data.reshape(n, c)[...] = xp.argmax(flat, axis=2)
                y[...] = ymax
            return
        if self.method == MAX and len(top) > 1:
            # the argmax top: the direct strided form, which also gives the flat indices
            ymax = self.buffers.get("max", y.shape, y.dtype, xp)
            src = plan.source(x, self.buffers, NEG_FLT_MAX, xp)
            self._forward_max_argmax(src, ymax, top[1].data, plan, xp)
            y[...] = ymax
            return
        if self._rows_plan is not None:
            rows = self._between_passes(x, xp, "rows")

            def separable(worker, lo, hi):
                self._forward_grid(x[lo:hi], rows[lo:hi], self._rows_plan,
                                   self._wbuf_rows(worker), xp)
                self._forward_grid(rows[lo:hi], y[lo:hi], self._cols_plan, self._wbuf(worker),
                                   xp)

            parallel().run(separable, n, xp, min_per_worker=4)
            return
        parallel().run(lambda worker, lo, hi: self._forward_grid(
            x[lo:hi], y[lo:hi], plan, self._wbuf(worker), xp), n, xp, min_per_worker=4)

    def _kernel_mask(self, y, xp):
        """The fused MAX kernels' argmax per window (int32, the flat index in the input plane),
        written by forward for backward."""
        return self.buffers.get("kernel_mask", y.shape, numpy.int32, xp)

    def _between_passes(self, x, xp, name):
        """The (N, C, H, out_w) array between the two passes of a separable MAX: the row maxima
        ("rows") in forward, their gradient ("drows") in backward.

        Why separable: a window's maximum is the maximum over its rows of each row's maximum,
        and the first maximum in row-major order is, in the first row whose maximum it is, the
        first cell equal to it; so with stride 1 a kh x kw MAX is a 1 x kw pass and a kh x 1 pass
        over an array of about the output's size, kh + kw offsets instead of kh * kw, with
        Caffe's ties and clipping kept (padding cells hold -FLT_MAX in both passes). GoogLeNet's
        3x3 stride-1 pools: docs/performance.md. With a stride the row pass would cover every
        input row, and the 2-D grid does less. AVE is separable too, but its 2-D passes are plain
        additions, as cheap as the copies the second pass would add, so it stays 2-D."""
        n, c, h = x.shape[:3]
        return self.buffers.get(name, (n, c, h, self._plan.out_w), x.dtype, xp)

    def _forward_grid(self, x, y, plan, buffers, xp):
        n, c = x.shape[:2]
        fill = 0 if self.method == AVE else NEG_FLT_MAX
        phases = plan.phases(n, c, buffers, fill, x.dtype, xp)
        # MAX keeps its own grid of maxima for backward (the top may be changed in place later)
        grid = buffers.get("grid", (plan.grid_size(n, c),), x.dtype, xp)
        op = xp.add if self.method == AVE else xp.maximum
        (p0, o0), rest = plan.offsets[0], plan.offsets[1:]
        # run by run of samples, every offset over a run while it is in cache; an offset's slice
        # may reach past its run into the next one's cells (not yet split), but only from cells
        # past out_h x out_w, which are discarded (a valid cell's window stays in its own plane)
        for s0, s1, a, b in plan.chunks(n, c, x.dtype.itemsize, xp):
            plan.split(x[s0:s1], phases, s0)
            cells = grid[a:b]
            cells[...] = phases[p0, o0 + a:o0 + b]
            for p, off in rest:
                op(cells, phases[p, off + a:off + b], out=cells)
            if self.method == AVE:
                xp.multiply(plan.valid(cells, s1 - s0, c), plan.inv_divisor, out=y[s0:s1])
            else:
                y[s0:s1] = plan.valid(cells, s1 - s0, c)

    def _forward_max_argmax(self, src, ymax, mask, plan, xp):
        ymax.fill(NEG_FLT_MAX)
        mask.fill(-1)
        greater = self.buffers.get("greater", ymax.shape, bool, xp)
        for index, plane in zip(plan.slices, plan.index_planes(mask.dtype, xp)):
            xs = src[index]
            xp.greater(xs, ymax, out=greater)          # strictly greater: the first maximum wins
            xp.copyto(ymax, xs, where=greater)
            xp.copyto(mask, plane, where=greater)

    # ----- backward -----------------------------------------------------------------------------
    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data
        dx = bottom[0].diff
        dy = top[0].diff
        xp = get_array_module(dy)
        plan = self._plan
        n, c = dy.shape[:2]
        run = kernels.runner_for(dy)
        if run is not None:   # one launch: a gather per input pixel
            if self.method == MAX:
                kernels.calls.max_pool_backward(run, dy, self._kernel_mask(dy, xp), dx,
                                                self.geom)
            else:
                kernels.calls.ave_pool_backward(run, dy, dx, self.geom)
            return
        if plan.global_reduce:
            if self.method == AVE:
                xp.multiply(dy.reshape(n, c, 1), plan.inv_divisor, out=dx.reshape(n, c, -1))
            else:
                flat = x.reshape(n * c, -1)
                arg = xp.argmax(flat, axis=1)
                dx.fill(0)
                dx.reshape(-1)[xp.arange(n * c) * flat.shape[1] + arg] = dy.reshape(-1)
            return
        if self.method == MAX and len(top) > 1:
            self._backward_max_direct(x, dy, dx, plan, xp)
            return
        if self._rows_plan is not None:
            drows = self._between_passes(x, xp, "drows")

            def separable(worker, lo, hi):
                self._backward_grid(dy[lo:hi], drows[lo:hi], self._cols_plan, self._wbuf(worker),
                                    xp)
                self._backward_grid(drows[lo:hi], dx[lo:hi], self._rows_plan,
                                    self._wbuf_rows(worker), xp)

            parallel().run(separable, n, xp, min_per_worker=4)
            return
        parallel().run(lambda worker, lo, hi: self._backward_grid(
            dy[lo:hi], dx[lo:hi], plan, self._wbuf(worker), xp), n, xp, min_per_worker=4)

    def _backward_grid(self, dy, dx, plan, buffers, xp):
        n, c = dy.shape[:2]
        size = plan.grid_size(n, c)
        # the top gradient on the grid; the cells past out_h x out_w stay 0 (set at allocation)
        left = buffers.get("dgrid", (size,), dy.dtype, xp, 0)
        # (made zero: with a kernel smaller than the stride some phases are never written)
        dphases = buffers.get("dphases", (len(plan.regions), size + plan.margin), dy.dtype,
                              xp, 0)
        if self.method == MAX:
            phases = plan.phases(n, c, buffers, NEG_FLT_MAX, dy.dtype, xp)   # forward's x
            grid = buffers.get("grid", (size,), dy.dtype, xp)                  # forward's maxima
            equal = buffers.get("equal", (size,), bool, xp)
            part = buffers.get("part", (size,), dy.dtype, xp)
        # run by run of samples, as in forward: a run's cells past out_h x out_w carry no
        # gradient (left is 0 there), so what they add past the run's end is zero, and the next
        # run clears its own cells before it adds
        for s0, s1, a, b in plan.chunks(n, c, dy.dtype.itemsize, xp):
            if not plan.disjoint:
                dphases[:, a:b].fill(0)
            cells = left[a:b]
            if self.method == AVE:
                xp.multiply(dy[s0:s1], plan.inv_divisor, out=plan.valid(cells, s1 - s0, c))
                for p, off in plan.offsets:
                    if plan.disjoint:
                        dphases[p, off + a:off + b] = cells
                    else:
                        dphases[p, off + a:off + b] += cells
            else:
                self._max_gradient(dy[s0:s1], cells, dphases, phases, grid[a:b], equal[a:b],
                                   part[a:b], plan, a, b, xp)
            plan.scatter_back(dphases, dx[s0:s1], s0)

    @staticmethod
    def _max_gradient(dy, left, dphases, phases, grid, equal, part, plan, a, b, xp):
        """MAX: walk the offsets in row-major order, hand the remaining gradient to the cells
        equal to the maximum and remove it from what remains, so a later tie receives nothing
        (grid cells a..b, whose views left, grid, equal and part are)."""
        plan.valid(left, dy.shape[0], dy.shape[1])[...] = dy
        last = len(plan.offsets) - 1
        for k, (p, off) in enumerate(plan.offsets):
            xp.equal(phases[p, off + a:off + b], grid, out=equal)
            if plan.disjoint:
                target = dphases[p, off + a:off + b]
                xp.multiply(left, equal, out=target)
            else:
                xp.multiply(left, equal, out=part)
                dphases[p, off + a:off + b] += part
                target = part
            if k < last:
                left -= target

    def _backward_max_direct(self, x, dy, dx, plan, xp):
        """MAX backward on the strided windows of the padded input (with the argmax top)."""
        ymax = self.buffers.get("max", dy.shape, dy.dtype, xp)
        src = plan.source(x, self.buffers, NEG_FLT_MAX, xp, copy=False)
        left = self.buffers.get("left", dy.shape, dy.dtype, xp)
        part = self.buffers.get("dpart", dy.shape, dy.dtype, xp)
        equal = self.buffers.get("dequal", dy.shape, bool, xp)
        left[...] = dy
        target = plan.grad_target(dx, self.buffers, xp)
        last = len(plan.slices) - 1
        for k, index in enumerate(plan.slices):
            xp.equal(src[index], ymax, out=equal)
            if plan.overlap:
                xp.multiply(left, equal, out=part)
                target[index] += part
            else:
                part = target[index]
                xp.multiply(left, equal, out=part)
            if k < last:
                left -= part
        plan.grad_finish(target, dx)
