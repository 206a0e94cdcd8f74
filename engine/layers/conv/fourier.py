"""Convolution in the frequency domain, with the discrete Fourier transforms done as small GEMMs.

Why. A stride-1 convolution spends C*kh*kw multiply-adds per output cell and channel; after a 2-D
DFT of size Ph x Pw the same product is, per frequency, one complex (samples x C) x (C x O) matrix
product, and a real signal needs only Ph * (Pw//2 + 1) frequencies. For cifar10_quick's conv2
(32 -> 32 channels, 5x5, 16x16) the forward pass drops from 1.31 GFLOP (batch 100) to 0.36 GFLOP,
the transforms included. The transforms are written as matrix products rather than FFT calls:
planes this small (10-34 points a side) are too short for an FFT to beat one large GEMM, the
padding and cropping cost nothing (the DFT matrices only have rows and columns for the cells
that exist), and everything, numpy or CuPy, stays in `xp.matmul`. On a CPU large planes with 3x3
kernels (VGG) lose by this route; on a GPU the same layers win (im2col's columns, not the FLOPs,
set the time there). Which layers take it is decided in routes.py, by timing it against the
others on the machine that runs.

The arithmetic (one spatial axis shown; the 2-D case applies it per axis). Caffe's convolution
is a cross-correlation, y[j] = sum_k w[k] x[j + k - p]. With transform size P >= H + p, x placed at
0..H-1 and zero to P, and w placed at (k - p) mod P, the circular cross-correlation equals the
zero-padded one on every output cell, because every index that falls outside the image lands in
the zero tail [H, P) whichever way it wraps (this needs p <= k - 1, so that Ho <= P). Hence, with
^ the DFT and * the complex conjugate:
    forward         Y^ = X^ . conj(W^)        y = inverse(Y^) at j in [0, Ho)
    input gradient  dX^ = dY^ . W^            dx = inverse(dX^) at i in [0, H)
    weight gradient dW^ = conj(dY^) . X^      dw[k] = inverse(dW^) at (k - p) mod P
where "." is, per frequency, the matrix product over channels (or over samples, for dW); with
groups, one such product per group on its slice of the channels. The weight gradient reuses X^
kept from forward; dY^ serves both gradients.

Layout. A transform takes real (B, C, H, W) to complex (F, B, C), F = Ph * Fw, in two products:
the last axis against a real (W, 2Fw) [cos | -sin] matrix, whose (re, im) pairs are read back as
complex numbers, then one transposing copy to (H, Fw, B, C) and a complex (Ph, H) matrix on the
left. (F, B, C) is what the per-frequency channel products want, batched over F. The inverse runs
the same steps backwards and writes NCHW straight into the output. The batch is cut into one
range of samples per core, as for im2col; each range keeps its own X^ and partial dW^ (added in
thread order, so results do not depend on timing).
"""
import numpy

from ...backend import get_array_module as _xp
from ...gemm import matmul
from ...parallel import WorkerBuffers, parallel, scratch
from .bias import bias_gradient_of, bias_gradient_part

def fourier_applies(geom, group, h, w):
    """Whether the frequency route computes this convolution exactly (see the module's
    derivation): stride 1, no dilation, 0 <= pad <= kernel - 1 per axis, and the kernel no larger
    than the transform (any group count: each group is its own channel product)."""
    g = geom
    return (group >= 1 and g.sh == 1 and g.sw == 1 and g.dh == 1 and g.dw == 1
            and 0 <= g.ph <= g.kh - 1 and 0 <= g.pw <= g.kw - 1
            and g.kh <= h + g.ph and g.kw <= w + g.pw)


def _transform_flops(count, ph, pw, h, w):
    """FLOPs of one forward transform of (count, h, w) real planes (both products)."""
    fw = pw // 2 + 1
    return 2.0 * count * h * w * 2 * fw + 8.0 * ph * h * fw * count


def _inverse_flops(count, ph, pw, h, w):
    fw = pw // 2 + 1
    return 8.0 * h * ph * fw * count + 2.0 * count * h * 2 * fw * w


def pass_flops(geom, n, c, o, h, w, weight_grad=True, input_grad=True, ranges=1, group=1):
    """(forward, backward) FLOPs of the products FourierConvCore runs for an (n, c, h, w) input
    and o outputs in `group` groups, cut into `ranges` thread ranges: the transforms (the
    weight's included), the per-frequency channel products and the inverses, exactly as the code
    calls them (tests hold the GEMM meter to this)."""
    g = geom
    out_h, out_w = g.conv_out(h, w)
    ph, pw = h + g.ph, w + g.pw
    channel = 8.0 * ph * (pw // 2 + 1) * n * c * o / group
    weight = _transform_flops(c * o // group, ph, pw, g.kh, g.kw)
    forward = (_transform_flops(n * c, ph, pw, h, w) + weight + channel
               + _inverse_flops(n * o, ph, pw, out_h, out_w))
    backward = 0.0
    if weight_grad or input_grad:
        backward += _transform_flops(n * o, ph, pw, out_h, out_w)
    if input_grad:
        backward += weight + channel + _inverse_flops(n * c, ph, pw, h, w)
    if weight_grad:
        backward += channel + ranges * _inverse_flops(o * c // group, ph, pw, g.kh, g.kw)
    return forward, backward


def fourier_flops(geom, n, c, o, h, w, ranges=1, group=1):
    """(im2col FLOPs, Fourier FLOPs, bytes of weight spectrum the channel products read) of
    forward + both gradients for an (n, c, h, w) input in `group` groups, cut into `ranges`
    thread ranges."""
    g = geom
    out_h, out_w = g.conv_out(h, w)
    direct = 3 * 2.0 * n * out_h * out_w * c * o * g.kh * g.kw / group
    freqs = (h + g.ph) * ((w + g.pw) // 2 + 1)
    spectrum = 3.0 * ranges * freqs * c * o / group * 8
    return direct, sum(pass_flops(geom, n, c, o, h, w, ranges=ranges, group=group)), spectrum


def _forward_matrices(size, positions):
    """DFT matrices of length `size` for samples at `positions`: the real (len, 2*(size//2+1))
    [cos | -sin] pairs of the half spectrum (last axis) and the complex (size, len) full one."""
    pos = numpy.asarray(positions, numpy.float64)
    half = numpy.arange(size // 2 + 1)
    angle = 2 * numpy.pi * numpy.outer(pos, half) / size
    real = numpy.stack([numpy.cos(angle), -numpy.sin(angle)], axis=-1).reshape(len(pos), -1)
    full = numpy.exp(-2j * numpy.pi * numpy.outer(numpy.arange(size), pos) / size)
    return real, full


def _inverse_matrices(size_h, size_w, pos_h, pos_w):
    """Inverse DFT at the given output cells: complex (len(pos_h), size_h) for the full axis and
    real (2*(size_w//2+1), len(pos_w)) for the half spectrum, whose missing conjugate half is
    folded in by doubling every frequency but 0 and size_w/2; 1/(size_h*size_w) included."""
    half = size_w // 2 + 1
    weight = numpy.full(half, 2.0)
    weight[0] = 1.0
    if size_w % 2 == 0:
        weight[-1] = 1.0
    angle = 2 * numpy.pi * numpy.outer(numpy.arange(half), numpy.asarray(pos_w, numpy.float64)) \
        / size_w
    real = (numpy.stack([numpy.cos(angle), -numpy.sin(angle)], axis=1)
            * weight[:, None, None] / (size_h * size_w)).reshape(2 * half, len(pos_w))
    full = numpy.exp(2j * numpy.pi * numpy.outer(numpy.asarray(pos_h, numpy.float64),
                                                 numpy.arange(size_h)) / size_h)
    return full, real


class _Plan:
    """The DFT matrices of one input size, geometry and dtype (in the array module's memory)."""

    def __init__(self, geom, h, w, dtype, xp):
        g = geom
        self.h, self.w = h, w
        self.out_h, self.out_w = g.conv_out(h, w)
        self.ph, self.pw = h + g.ph, w + g.pw
        self.fw = self.pw // 2 + 1
        self.freqs = self.ph * self.fw
        self.real = numpy.dtype(dtype)
        self.complex = numpy.result_type(self.real, numpy.complex64)

        def put(real, full):
            return xp.asarray(real.astype(self.real)), xp.asarray(full.astype(self.complex))

        def forward(pos_h, pos_w):
            return put(_forward_matrices(self.pw, pos_w)[0], _forward_matrices(self.ph, pos_h)[1])

        def inverse(pos_h, pos_w):
            full, real = _inverse_matrices(self.ph, self.pw, pos_h, pos_w)
            real_w, full_h = put(real, full)
            return full_h, real_w

        self.of_input = forward(range(h), range(w))
        self.of_output = forward(range(self.out_h), range(self.out_w))
        kernel_h, kernel_w = numpy.arange(g.kh) - g.ph, numpy.arange(g.kw) - g.pw
        self.of_kernel = forward(kernel_h, kernel_w)
        self.to_input = inverse(range(h), range(w))
        self.to_output = inverse(range(self.out_h), range(self.out_w))
        self.to_kernel = inverse(kernel_h % self.ph, kernel_w % self.pw)


class FourierConvCore:
    """The frequency-domain convolution, with `Im2colConvCore`'s interface (forward, backward).

    Memory: a layer keeps X^ of its batch (F x N x C complex, about 1.5-3x the input) from forward
    to backward and, per thread, a weight-sized partial gradient; every other buffer, the weight
    spectra included, is transient scratch shared by all layers (engine.parallel.scratch)."""

    algorithm = "fourier"

    def __init__(self, geom, group=1):
        self.geom = geom
        self.group = group
        self._plans = {}
        self._wbuf = WorkerBuffers()
        self._kept = {}   # key -> (input shape, {worker: (lo, hi)}) of the X^ forward kept

    def _plan(self, h, w, dtype, xp):
        key = (h, w, numpy.dtype(dtype).str, xp.__name__)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(self.geom, h, w, dtype, xp)
        return plan

    # ----- the two transforms ------------------------------------------------------------------------
    @staticmethod
    def _to_freq(a, mats, plan, take, out=None):
        """a (B, C, h, w) real, C-contiguous -> (F, B, C) complex (`out`, or scratch from
        `take`, an arena frame's allocator)."""
        xp = _xp(a)
        real_w, full_h = mats
        b, c, h, w = a.shape
        fw = plan.fw
        half = take((b * c * h, 2 * fw), plan.real)
        matmul(xp, a.reshape(b * c * h, w), real_w, out=half)
        cols = take((h, fw, b, c), plan.complex)
        cols[...] = half.view(plan.complex).reshape(b, c, h, fw).transpose(2, 3, 0, 1)
        if out is None:
            out = take((plan.freqs, b, c), plan.complex)
        matmul(xp, full_h, cols.reshape(h, fw * b * c), out=out.reshape(plan.ph, fw * b * c))
        return out

    @staticmethod
    def _from_freq(spec, mats, plan, take, out):
        """spec (F, B, C) complex -> out (B, C, h, w) real, C-contiguous, overwritten; the cells
        are those `mats` was made for."""
        xp = _xp(spec)
        full_h, real_w = mats
        _, b, c = spec.shape
        h, w = out.shape[2:]
        fw = plan.fw
        rows = take((h, fw, b, c), plan.complex)
        matmul(xp, full_h, spec.reshape(plan.ph, fw * b * c), out=rows.reshape(h, fw * b * c))
        planes = take((b, c, h, fw), plan.complex)
        planes[...] = rows.transpose(2, 3, 0, 1)
        matmul(xp, planes.view(plan.real).reshape(b * c * h, 2 * fw), real_w,
               out=out.reshape(b * c * h, w))
        return out

    def _weight_spectrum(self, weight, plan, take):
        """W^ (F, C/g, O) of weight (O, C/g, kh, kw) placed at (k - pad) mod P."""
        o, c, kh, kw = weight.shape
        wt = take((c, o, kh, kw), weight.dtype)
        wt[...] = weight.transpose(1, 0, 2, 3)
        return self._to_freq(wt, plan.of_kernel, plan, take)

    def _group_slices(self, c, o):
        """(input channel slice, output channel slice) of each group."""
        cg, og = c // self.group, o // self.group
        return [(slice(k * cg, (k + 1) * cg), slice(k * og, (k + 1) * og))
                for k in range(self.group)]

    # ----- forward / backward ----------------------------------------------------------------------
    def forward(self, x, weight, out, bias=None, key=0):
        """out (N, O, Ho, Wo) = convolution of x (N, C, H, W) with weight (+ bias); X^ is kept
        under `key` for the weight gradient."""
        xp = _xp(x)
        x = xp.ascontiguousarray(x)
        n, c, h, w = x.shape
        o = weight.shape[0]
        plan = self._plan(h, w, x.dtype, xp)
        kept = {}
        with scratch(xp).frame() as take:
            wconj = self._weight_spectrum(weight, plan, take)
            xp.conjugate(wconj, out=wconj)
            groups = self._group_slices(c, o)

            def work(worker, lo, hi):
                spec = self._wbuf(worker).get(f"xspec{key}", (plan.freqs, hi - lo, c),
                                              plan.complex, xp)
                with scratch(xp).frame() as mine:
                    self._to_freq(x[lo:hi], plan.of_input, plan, mine, out=spec)
                    kept[worker] = (lo, hi)
                    yspec = mine((plan.freqs, hi - lo, o), plan.complex)
                    for cs, os_ in groups:
                        matmul(xp, spec[:, :, cs], wconj[:, :, os_], out=yspec[:, :, os_])
                    dst = out[lo:hi]
                    self._from_freq(yspec, plan.to_output, plan, mine, dst)
                if bias is not None:
                    dst += bias.reshape(1, o, 1, 1)

            parallel().run(work, n, xp)
        self._kept[key] = (x.shape, kept)
        return out

    def backward(self, dy, weight, weight_diff=None, bias_diff=None, dx=None, key=0):
        """Gradients for top gradient dy (N, O, Ho, Wo): weight_diff and bias_diff (when given)
        accumulate, dx (N, C, H, W, when given) is overwritten."""
        xp = _xp(dy)
        dy = xp.ascontiguousarray(dy)
        n, o = dy.shape[:2]
        shape, kept = self._kept.get(key, (None, None))
        if weight_diff is not None and (shape is None or shape[0] != n):
            raise RuntimeError("Fourier convolution: backward without a forward on this batch "
                               "(the weight gradient needs the input's spectrum)")
        cg = weight.shape[1]
        c = cg * self.group
        groups = self._group_slices(c, o)
        spectral = weight_diff is not None or dx is not None
        plan = None
        if spectral:
            h, w = (dx.shape if dx is not None else shape)[2:]
            plan = self._plan(h, w, dy.dtype, xp)
        with scratch(xp).frame() as take:
            wspec_t = None
            if dx is not None:
                wspec = self._weight_spectrum(weight, plan, take)
                wspec_t = take((plan.freqs, o, cg), plan.complex)
                wspec_t[...] = wspec.transpose(0, 2, 1)

            def work(worker, lo, hi):
                buf = self._wbuf(worker)
                if bias_diff is not None:
                    bias_gradient_part(buf, dy, lo, hi)
                if not spectral:
                    return
                with scratch(xp).frame() as mine:
                    dspec = self._to_freq(dy[lo:hi], plan.of_output, plan, mine)
                    if dx is not None:
                        xgrad = mine((plan.freqs, hi - lo, c), plan.complex)
                        for cs, os_ in groups:
                            matmul(xp, dspec[:, :, os_], wspec_t[:, os_], out=xgrad[:, :, cs])
                        self._from_freq(xgrad, plan.to_input, plan, mine, dx[lo:hi])
                    if weight_diff is not None:
                        if kept.get(worker) != (lo, hi):
                            raise RuntimeError("Fourier convolution: backward cut the batch "
                                               "differently from forward (the thread count "
                                               "changed in between)")
                        self._weight_grad_part(buf, mine, dspec, plan, groups, weight, key)

            parts = parallel().run(work, n, xp)
        for worker in range(parts):   # in thread order: the sum does not depend on timing
            buf = self._wbuf(worker)
            if weight_diff is not None:
                weight_diff += buf.get("dw", weight.shape, dy.dtype, xp)
            if bias_diff is not None:
                bias_diff += bias_gradient_of(buf, dy)
        return dx

    def _weight_grad_part(self, buf, take, dspec, plan, groups, weight, key):
        """One worker's weight gradient, (O, C/g, kh, kw), into its buffer "dw": per frequency,
        the top gradient's spectrum dspec (F, B, O; conjugated here, in place) against the
        input's, which forward kept in the worker's buffer for the same samples."""
        xp = _xp(dspec)
        o, cg = weight.shape[:2]
        b, c = dspec.shape[1], cg * self.group
        xp.conjugate(dspec, out=dspec)
        partial = take((plan.freqs, o, cg), plan.complex)
        xspec = buf.get(f"xspec{key}", (plan.freqs, b, c), plan.complex, xp)
        for cs, os_ in groups:
            matmul(xp, dspec[:, :, os_].transpose(0, 2, 1), xspec[:, :, cs], out=partial[:, os_])
        # back to (O, C, kh, kw) here, so what outlives the pass is weight-sized
        self._from_freq(partial, plan.to_kernel, plan, take,
                        buf.get("dw", weight.shape, plan.real, xp))
