"""Normalization layers: LRN and BatchNorm, with Caffe's exact formulas.

LRN (lrn_layer.cpp), on 4-axis (N, C, H, W) blobs, n = local_size (odd):
  ACROSS_CHANNELS  s = k + alpha/n * sum of x^2 over channels c-(n-1)/2 .. c+(n-1)/2 (zeros outside)
  WITHIN_CHANNEL   s = 1 + alpha/n^2 * sum of x^2 over the n x n window centred on the pixel (zero
                   padding; Caffe builds it from AVE pooling whose divisor is always n^2); k is ignored
  y = x * s^(-beta)

BatchNorm (batch_norm_layer.cpp): y = (x - mean) / sqrt(var + eps) per channel (axis 1), no affine
part. blobs[0] and blobs[1] are running *sums* of batch means and of (m/(m-1))-corrected batch
variances, blobs[2] (shape (1,)) is the running normalizer: each training forward does
  blobs[2] = maf*blobs[2] + 1, blobs[0] = maf*blobs[0] + mean, blobs[1] = maf*blobs[1] + m/(m-1)*var
with m = N*H*W. With use_global_stats (default: phase == TEST) mean = blobs[0]/blobs[2] and
var = blobs[1]/blobs[2] (0 when blobs[2] == 0). The three blobs are never touched by the solver.

Scale and Bias (a Scale follows each BatchNorm in Caffe's ResNets) are in scale_bias.py.
"""
import numpy

from .. import kernels
from ..layer import Layer
from ..registry import register
from ..parallel import split_range, split_rows


def reuse_buffer(holder, name, shape, dtype, xp, zero=False):
    """A scratch array kept on `holder`, reallocated only when the shape changes."""
    buf = getattr(holder, name, None)
    if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype:
        buf = (xp.zeros if zero else xp.empty)(tuple(shape), dtype)
        setattr(holder, name, buf)
    return buf


# LRN's passes (a dozen over arrays of the bottom's size) take runs of samples of about this many
# bytes a run, so that a run's arrays stay in cache from one pass to the next; BatchNorm's passes
# take runs of channels of the same size (docs/performance.md, "Pooling, LRN, BatchNorm", has the
# timings that chose it).
RUN_BYTES = 1 << 20


def _run_of(item_bytes):
    """How many items (samples or channels) of item_bytes each make a run of about RUN_BYTES
    (at least one), for split_range's and split_rows' `run`."""
    return max(1, RUN_BYTES // max(int(item_bytes), 1))


def sum_per_dim(a3):
    """Sum of an (outer, dim, inner) array over outer and inner: shape (dim,)."""
    return a3.sum(axis=2).sum(axis=0)


def dot_per_dim(xp, a3, b3):
    """sum_per_dim(a3 * b3); einsum (no temporary) is fastest on numpy, multiply-then-sum on CuPy."""
    if xp is numpy:
        return numpy.einsum("odi,odi->d", a3, b3)
    return (a3 * b3).sum(axis=2).sum(axis=0)


# ------------------------------------------------------------------------------------------------
@register("LRN")
class LRNLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.lrn_param
        self.size = int(p.local_size)
        if self.size % 2 == 0 or self.size < 1:
            raise self.error(f"local_size must be odd (and positive), got {self.size}")
        self.alpha = float(p.alpha)
        self.beta = float(p.beta)
        self.k = float(p.k)
        self.within = p.norm_region == p.WITHIN_CHANNEL
        self.pre_pad = (self.size - 1) // 2

    def reshape(self, bottom, top):
        x = bottom[0]
        if x.ndim != 4:
            raise self.error(f"needs a 4-axis (num, channels, height, width) input, got shape {x.shape}")
        if top[0] is bottom[0]:
            raise self.error("does not work in place: give the top its own name")
        top[0].reshape(x.shape)
        n, c, h, w = x.shape
        pad = self.size - 1
        dt, xp = x.dtype, self.xp
        self._scale = reuse_buffer(self, "_scale_buf", x.shape, dt, xp)
        self._pow = reuse_buffer(self, "_pow_buf", x.shape, dt, xp)
        if self.within:
            # zero borders stay zero: only the interior is ever written
            self._pad = reuse_buffer(self, "_pad_buf", (n, c, h + pad, w + pad), dt, xp, zero=True)
            self._rows = reuse_buffer(self, "_rows_buf", (n, c, h, w + pad), dt, xp)
        else:
            self._pad = reuse_buffer(self, "_pad_buf", (n, c + pad, h, w), dt, xp, zero=True)

    def _window_sum(self, a, out, pad, rows):
        """Sum of `a` over the LRN window (zero outside), written into out; pad and rows are the
        scratch of the same samples."""
        n, p = self.size, self.pre_pad
        if self.within:
            h, w = a.shape[2], a.shape[3]
            pad[:, :, p:p + h, p:p + w] = a
            rows[...] = pad[:, :, 0:h]
            for o in range(1, n):
                rows += pad[:, :, o:o + h]
            out[...] = rows[..., 0:w]
            for o in range(1, n):
                out += rows[..., o:o + w]
        else:
            c = a.shape[1]
            pad[:, p:p + c] = a
            out[...] = pad[:, 0:c]
            for o in range(1, n):
                out += pad[:, o:o + c]
        return out

    def _interior(self, pad, shape):
        """The cells of the window sum's padded scratch that hold the summed array: free scratch
        of the bottom's shape between two sums (its zero border is never written)."""
        n, c, h, w = shape
        p = self.pre_pad
        return pad[:, :, p:p + h, p:p + w] if self.within else pad[:, p:p + c]

    def _norm_factor(self):
        return self.alpha / (self.size * self.size if self.within else self.size)

    def _scratch(self):
        return [self._scale, self._pow, self._pad] + ([self._rows] if self.within else [])

    def forward(self, bottom, top):
        """Samples are independent: one range of them per core (split_rows), taken a run of
        samples at a time (RUN_BYTES)."""
        x = bottom[0].data
        run = None if self.within else kernels.runner_for(x)
        if run is not None:   # across channels on CuPy: one fused launch
            kernels.calls.lrn_forward(run, x, self._scale, top[0].data, self.size, self.alpha,
                                      self.beta, self.k)
            return
        split_rows(self._forward_rows, [x, top[0].data] + self._scratch(), self.xp,
                   _run_of(x[:1].nbytes))

    def _forward_rows(self, x, y, scale, power, pad, rows=None):
        xp = self.xp
        xp.multiply(x, x, out=power)                    # x², where s^-beta is made below
        self._window_sum(power, scale, pad, rows)
        scale *= self._norm_factor()
        scale += 1.0 if self.within else self.k
        self._negative_power(scale, power, self._interior(pad, x.shape))
        xp.multiply(x, power, out=y)

    def _negative_power(self, scale, out, scratch):
        """out = scale ** -beta. Caffe's models all use beta 0.75, made here as 1 / (√s · √√s):
        square roots run as SIMD loops where numpy's power calls the C library element by
        element, at a small cost in accuracy (docs/performance.md, "Pooling, LRN, BatchNorm")."""
        xp = self.xp
        if self.beta != 0.75:
            xp.power(scale, -self.beta, out=out)
            return
        xp.sqrt(scale, out=out)
        out *= xp.sqrt(out, out=scratch)
        xp.reciprocal(out, out=out)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data
        run = None if self.within else kernels.runner_for(x)
        if run is not None:
            kernels.calls.lrn_backward(run, x, top[0].data, self._scale, top[0].diff,
                                       bottom[0].diff, self.size, self.alpha, self.beta)
            return
        split_rows(self._backward_rows, [x, top[0].diff, bottom[0].diff] + self._scratch(),
                   self.xp, _run_of(x[:1].nbytes))

    def _backward_rows(self, x, dy, out, scale, power, pad, rows=None):
        # dx_j = dy_j s_j^-beta - 2 alpha' beta x_j sum_{c: j in W(c)} dy_c y_c / s_c (W symmetric);
        # the sum is made in the bottom gradient's own memory, the scratch taking the first term
        xp = self.xp
        ratio = xp.multiply(dy, x, out=out)
        ratio *= power
        ratio /= scale
        acc = self._window_sum(ratio, ratio, pad, rows)
        acc *= x
        acc *= -2.0 * self._norm_factor() * self.beta
        out += xp.multiply(dy, power, out=self._interior(pad, x.shape))


# ------------------------------------------------------------------------------------------------
@register("BatchNorm")
class BatchNormLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1
    stores_statistics = True   # its blobs are running statistics, not learnable parameters
    # x-hat of the last forward, (N, C, spatial), for backward; made by the first forward at a
    # shape, so that a caller that runs normalize() into its own buffer never allocates it
    _x_norm = None

    def layer_setup(self, bottom, top):
        p = self.param.batch_norm_param
        self.maf = float(p.moving_average_fraction)
        self.eps = float(p.eps)
        self.use_global_stats = self.phase == 1  # TEST
        if p.HasField("use_global_stats"):
            self.use_global_stats = bool(p.use_global_stats)
        x = bottom[0]
        self.channels = 1 if x.ndim == 1 else x.shape[1]
        c = self.channels
        if len(self.blobs) == 3 and self.blobs[0].shape == (c,) and self.blobs[1].shape == (c,) \
                and self.blobs[2].count == 1:
            pass  # statistics already present (loaded or set up before): keep them
        else:
            self.blobs = []
            for shape in ((c,), (c,), (1,)):
                self.add_param(shape, fill_value=0)
        # The statistics are not learnable: the solver must never update them (Caffe forces lr_mult 0
        # and refuses a non-zero one, except for 3 ParamSpecs, which its upgrade step clears).
        specs = self.param.param
        given = len(specs)
        for i in range(3):
            if i >= len(specs):
                specs.add().lr_mult = 0.0
            elif given == 3:
                specs[i].lr_mult = 0.0
                specs[i].decay_mult = 0.0
            elif specs[i].lr_mult != 0:
                raise self.error("its mean/variance/normalizer blobs are statistics, not learnable "
                                 f"parameters: param {{ lr_mult }} #{i} must be 0 (or drop the "
                                 f"param specs), got {specs[i].lr_mult}")
        self.param_propagate_down = [False] * 3

    def reshape(self, bottom, top):
        x = bottom[0]
        c = 1 if x.ndim == 1 else x.shape[1]
        if c != self.channels:
            raise self.error(f"was set up for {self.channels} channels, input now has shape {x.shape}")
        self.in_place = top[0] is bottom[0]
        if not self.in_place:
            top[0].reshape(x.shape)
        n = x.shape[0]
        s = x.count // (n * c) if n * c else 0
        self.shape3 = (n, c, s)     # (N, C, spatial): the view every pass works on
        self._itemsize = numpy.dtype(x.dtype).itemsize

    def forward(self, bottom, top):
        x_norm = reuse_buffer(self, "_x_norm", self.shape3, bottom[0].dtype, self.xp)
        self.normalize(bottom, top, x_norm, _write_x_hat)

    def normalize(self, bottom, top, centred, write_top):
        """The forward's work, per channel range on the cores (split_range): each channel's
        statistics and normalisation are computed as in one call, so the numbers do not depend
        on the split. For the channels lo:hi, centred (N, C, spatial) gets x - mean, then
        write_top(lo, hi, centred, inv_std, top) writes the top from it (slices of the three,
        inv_std = 1 / sqrt(var + eps)) while they are still in cache: forward's writes x-hat
        (in centred too); a caller wanting another per-channel function of x - mean gives its
        own, and pays no pass over the activations for it. Keeps inv_std for backward and, with
        batch statistics, updates the running sums."""
        xp = self.xp
        x3 = bottom[0].data.reshape(self.shape3)
        y3 = top[0].data.reshape(self.shape3)       # may be x3 itself (in place)
        n, c, s = self.shape3
        m = n * s
        batch_stats = not self.use_global_stats
        if batch_stats:
            mean = xp.empty(c, x3.dtype)
            var = xp.empty(c, x3.dtype)
            inv_std = xp.empty(c, x3.dtype)
        else:
            norm = float(self.blobs[2].data.reshape(-1)[0])
            factor = 0.0 if norm == 0 else 1.0 / norm
            mean = self.blobs[0].data * factor
            var = self.blobs[1].data * factor
            inv_std = 1.0 / xp.sqrt(var + self.eps)

        def part(lo, hi):
            xs, ns = x3[:, lo:hi], centred[:, lo:hi]
            if batch_stats:
                mean[lo:hi] = sum_per_dim(xs) / m
            xp.subtract(xs, mean[lo:hi, None], out=ns)
            if batch_stats:
                var[lo:hi] = dot_per_dim(xp, ns, ns) / m
                inv_std[lo:hi] = 1.0 / xp.sqrt(var[lo:hi] + self.eps)
            write_top(lo, hi, ns, inv_std[lo:hi], y3[:, lo:hi])

        split_range(part, c, x3.size, xp, run=self.channel_run())
        self.inv_std = inv_std
        if batch_stats:
            b0, b1, b2 = (b.data for b in self.blobs)
            b2 *= self.maf
            b2 += 1
            b0 *= self.maf
            b0 += mean
            b1 *= self.maf
            b1 += var * (m / (m - 1.0) if m > 1 else 1.0)

    def channel_run(self):
        """Channels a call of the multi-pass work takes: about RUN_BYTES of activations."""
        n, c, s = self.shape3
        return _run_of(n * s * self._itemsize)

    def normalized(self):
        """(x - mean) / sqrt(var + eps) of the last forward, as (N, C, spatial): what the top
        held after it (a Scale run in place next reads it instead of copying its input)."""
        return self._x_norm

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            self.input_gradient(top[0].diff, bottom[0].diff, self._x_norm)

    def input_gradient(self, dy, out, x_hat, factor=None):
        """out = the input gradient for the top gradient dy (both of the bottom's shape; out
        may be dy itself, in place), the last forward's x-hat being x_hat (N, C, spatial) times
        factor per channel, or x_hat itself when factor is None: a caller that kept x - mean
        instead (normalize) gives it with factor inv_std, and no x-hat is made."""
        xp = self.xp
        dy = dy.reshape(self.shape3)
        out = out.reshape(self.shape3)
        inv, f = self.inv_std, factor
        n, c, s = self.shape3
        m = n * s

        def part(lo, hi):
            d, o = dy[:, lo:hi], out[:, lo:hi]
            if self.use_global_stats:
                xp.multiply(d, inv[lo:hi, None], out=o)
                return
            # dx = (dy - mean(dy) - mean(dy * y) * y) / sqrt(var + eps), means over (N, spatial);
            # with y = a * f: mean(dy * y) * y = f^2 * mean(dy * a) * a
            a = x_hat[:, lo:hi]
            mean_dy = sum_per_dim(d) / m
            mean_dyy = dot_per_dim(xp, d, a) / m
            if f is not None:
                mean_dyy *= f[lo:hi] * f[lo:hi]
            xp.subtract(d, mean_dy[:, None], out=o)
            o -= a * mean_dyy[:, None]
            o *= inv[lo:hi, None]

        split_range(part, c, dy.size, xp, run=self.channel_run())


def _write_x_hat(lo, hi, centred, inv_std, top):
    """BatchNorm's own top, for normalize: x-hat, made in centred and copied to the top (the
    same memory when in place)."""
    centred *= inv_std[:, None]
    top[...] = centred
