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

Implementation: when the windows reach outside the image (pad, ceil overshoot) the input is copied
once into a cached buffer whose border holds the neutral value (-FLT_MAX for MAX, 0 for AVE); then
for each kernel offset (i, j) (kh*kw iterations) the cells it meets form one strided slice of the
same shape as the output: forward is a running maximum (or sum) over those slices, backward scatters
through the same slices (for MAX, the top gradient is handed to the first offset that holds the
window's maximum and then removed, so ties cannot receive it twice). Global pooling (one window
covering the whole plane) is a plain reduction.
"""
import numpy

from ..backend import get_array_module
from ..layer import Layer, register
from .im2col import NEG_FLT_MAX, BufferCache, Geometry, offset_slices

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


class _Plan:
    """Everything that depends only on the input shape: window slices, padding, AVE divisors."""

    def __init__(self, h, w, out_h, out_w, geom, dtype, xp):
        g = self.geom = geom
        self.h, self.w = h, w
        self.out_h, self.out_w = out_h, out_w
        self.global_reduce = (g.ph == 0 and g.pw == 0 and out_h == 1 and out_w == 1
                              and g.kh >= h and g.kw >= w)
        self.overlap = g.sh < g.kh or g.sw < g.kw
        # rows/columns the windows span, in padded coordinates (row 0 = first padding row)
        self.ext_h = (out_h - 1) * g.sh + g.kh
        self.ext_w = (out_w - 1) * g.sw + g.kw
        self.padded = bool(g.ph or g.pw or self.ext_h > h or self.ext_w > w)
        # the part of the image that the windows reach
        self.used_h = min(h, self.ext_h - g.ph)
        self.used_w = min(w, self.ext_w - g.pw)
        # does every input pixel lie in some window?
        self.covers_all = (g.sh <= g.kh and g.sw <= g.kw and self.used_h == h and self.used_w == w)
        self.separable = g.kh > 1 and g.kw > 1
        self.slices = [offset_slices(i, j, out_h, out_w, g) for i in range(g.kh)
                       for j in range(g.kw)]
        # AVE divisor: window clipped to [start, in + pad) before clipping to the image.
        hs = numpy.arange(out_h) * g.sh - g.ph
        ws = numpy.arange(out_w) * g.sw - g.pw
        pool_h = numpy.minimum(hs + g.kh, h + g.ph) - hs
        pool_w = numpy.minimum(ws + g.kw, w + g.pw) - ws
        real_h = numpy.minimum(hs + g.kh, h) - numpy.maximum(hs, 0)
        real_w = numpy.minimum(ws + g.kw, w) - numpy.maximum(ws, 0)
        divisor = numpy.outer(pool_h, pool_w).astype(numpy.float64)
        has_pixel = numpy.outer(real_h > 0, real_w > 0)
        inv = numpy.where(has_pixel & (divisor > 0), 1.0 / numpy.where(divisor > 0, divisor, 1), 0)
        if numpy.all(inv == inv.flat[0]):
            self.inv_divisor = float(inv.flat[0])          # one scalar: cheaper to apply
        else:
            self.inv_divisor = xp.asarray(inv.astype(dtype))
        self._index_planes = None

    def index_planes(self, dtype, xp):
        """For the argmax top: per offset, the flat input index h*W + w of each output cell."""
        if self._index_planes is None:
            g = self.geom
            planes = []
            for i in range(g.kh):
                for j in range(g.kw):
                    rows = numpy.arange(self.out_h) * g.sh - g.ph + i
                    cols = numpy.arange(self.out_w) * g.sw - g.pw + j
                    plane = rows[:, None] * self.w + cols[None, :]
                    planes.append(xp.asarray(plane.astype(dtype)))
            self._index_planes = planes
        return self._index_planes

    def source(self, x, buffers, fill, xp, copy=True):
        """x as the windows see it: the padded copy (a cached buffer, refreshed unless copy is
        False, as in backward, which reuses forward's copy) or x itself."""
        if not self.padded:
            return x
        g = self.geom
        n, c = x.shape[:2]
        buf = buffers.get("xpad", (n, c, self.ext_h, self.ext_w), x.dtype, xp, fill)
        if copy:
            buf[:, :, g.ph:g.ph + self.used_h, g.pw:g.pw + self.used_w] = \
                x[:, :, :self.used_h, :self.used_w]
        return buf

    def grad_target(self, dx, buffers, xp):
        """Where backward accumulates: a zeroed padded buffer, or dx itself (zeroed if needed)."""
        if self.padded:
            n, c = dx.shape[:2]
            buf = buffers.get("dxpad", (n, c, self.ext_h, self.ext_w), dx.dtype, xp)
            buf.fill(0)
            return buf
        if self.overlap or not self.covers_all:
            dx.fill(0)
        return dx

    def grad_finish(self, target, dx):
        if self.padded:
            g = self.geom
            if self.used_h < self.h or self.used_w < self.w:
                dx.fill(0)
            dx[:, :, :self.used_h, :self.used_w] = \
                target[:, :, g.ph:g.ph + self.used_h, g.pw:g.pw + self.used_w]


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
        self._plan = None
        self._plan_key = None

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
            self._plan = _Plan(h, w, out_h, out_w, g, x.dtype, self.xp)
            self._plan_key = key

    # ----- forward ------------------------------------------------------------------------------
    def forward(self, bottom, top):
        x = bottom[0].data
        xp = get_array_module(x)
        plan = self._plan
        y = top[0].data
        if self.method == AVE:
            self._forward_ave(x, y, plan, xp)
            return
        # MAX: keep our own copy of the maxima for backward (top may be changed in place later).
        ymax = self.buffers.get("max", y.shape, y.dtype, xp)
        if plan.global_reduce:
            n, c = x.shape[:2]
            flat = x.reshape(n, c, -1)
            xp.max(flat, axis=2, out=ymax.reshape(n, c))
            if len(top) > 1:
                top[1].data.reshape(n, c)[...] = xp.argmax(flat, axis=2)
        else:
            src = plan.source(x, self.buffers, NEG_FLT_MAX, xp)
            if len(top) > 1:
                self._forward_max_argmax(src, ymax, top[1].data, plan, xp)
            else:
                self._reduce_windows(src, ymax, plan, xp.maximum)
        y[...] = ymax

    def _reduce_windows(self, src, out, plan, op):
        """out = op-reduction (maximum or add) of src over every window.

        Separable when the kernel is at least 2x2: first over the kernel rows (into a cached
        buffer of full padded-width rows, which keeps the inner loops long and contiguous), then
        over the kernel columns: kh + kw passes instead of kh*kw.
        """
        g = plan.geom
        if plan.separable:
            xp = get_array_module(src)
            rows = self.buffers.get("rows", out.shape[:2] + (plan.out_h, plan.ext_w), out.dtype, xp)
            span_h = (plan.out_h - 1) * g.sh + 1
            rows[...] = src[:, :, 0:span_h:g.sh, :plan.ext_w]
            for i in range(1, g.kh):
                op(rows, src[:, :, i:i + span_h:g.sh, :plan.ext_w], out=rows)
            span_w = (plan.out_w - 1) * g.sw + 1
            out[...] = rows[..., 0:span_w:g.sw]
            for j in range(1, g.kw):
                op(out, rows[..., j:j + span_w:g.sw], out=out)
            return
        out[...] = src[plan.slices[0]]
        for index in plan.slices[1:]:
            op(out, src[index], out=out)

    def _forward_max_argmax(self, src, ymax, mask, plan, xp):
        ymax.fill(NEG_FLT_MAX)
        mask.fill(-1)
        greater = self.buffers.get("greater", ymax.shape, bool, xp)
        for index, plane in zip(plan.slices, plan.index_planes(mask.dtype, xp)):
            xs = src[index]
            xp.greater(xs, ymax, out=greater)          # strictly greater: the first maximum wins
            xp.copyto(ymax, xs, where=greater)
            xp.copyto(mask, plane, where=greater)

    def _forward_ave(self, x, y, plan, xp):
        if plan.global_reduce:
            n, c = x.shape[:2]
            xp.sum(x.reshape(n, c, -1), axis=2, out=y.reshape(n, c))
            y *= plan.inv_divisor
            return
        src = plan.source(x, self.buffers, 0, xp)
        self._reduce_windows(src, y, plan, xp.add)
        y *= plan.inv_divisor

    # ----- backward -----------------------------------------------------------------------------
    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data
        dx = bottom[0].diff
        dy = top[0].diff
        xp = get_array_module(dy)
        plan = self._plan
        if self.method == AVE:
            self._backward_ave(dy, dx, plan, xp)
        else:
            self._backward_max(x, dy, dx, plan, xp)

    def _backward_ave(self, dy, dx, plan, xp):
        if plan.global_reduce:
            n, c = dy.shape[:2]
            xp.multiply(dy.reshape(n, c, 1), plan.inv_divisor, out=dx.reshape(n, c, -1))
            return
        g = self.buffers.get("grad", dy.shape, dy.dtype, xp)
        xp.multiply(dy, plan.inv_divisor, out=g)
        target = plan.grad_target(dx, self.buffers, xp)
        for index in plan.slices:
            if plan.overlap:
                target[index] += g
            else:
                target[index] = g
        plan.grad_finish(target, dx)

    def _backward_max(self, x, dy, dx, plan, xp):
        if plan.global_reduce:
            n, c = x.shape[:2]
            flat = x.reshape(n * c, -1)
            arg = xp.argmax(flat, axis=1)
            dx.fill(0)
            dx.reshape(-1)[xp.arange(n * c) * flat.shape[1] + arg] = dy.reshape(-1)
            return
        # Each window's gradient goes to its first maximum (row-major order, as in Caffe): walk the
        # offsets in that order, hand the remaining gradient to the cells equal to the maximum and
        # remove it from what remains, so a later tie receives nothing.
        ymax = self.buffers.get("max", dy.shape, dy.dtype, xp)
        src = plan.source(x, self.buffers, NEG_FLT_MAX, xp, copy=False)
        left = self.buffers.get("left", dy.shape, dy.dtype, xp)
        part = self.buffers.get("grad", dy.shape, dy.dtype, xp)
        equal = self.buffers.get("equal", dy.shape, bool, xp)
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
