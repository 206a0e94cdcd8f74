"""Normalization layers: LRN, BatchNorm, Scale and Bias, with Caffe's exact formulas.

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

Scale / Bias (scale_layer.cpp, bias_layer.cpp): y = x * scale (+ bias), the second operand spanning
bottom[0]'s axes axis .. axis+num_axes-1 (num_axes -1: to the end, 0: a scalar) and broadcast over the
others; it is a learned blob (one bottom) or bottom[1] (two bottoms, whose shape defines the axes).
"""
import numpy

from ..layer import Layer, register
from ..parallel import split_range, split_rows


def _buffer(holder, name, shape, dtype, xp, zero=False):
    """A scratch array kept on `holder`, reallocated only when the shape changes."""
    buf = getattr(holder, name, None)
    if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype:
        buf = (xp.zeros if zero else xp.empty)(tuple(shape), dtype)
        setattr(holder, name, buf)
    return buf


# LRN's passes (a dozen over arrays of the bottom's size) take runs of samples of about this many
# bytes a run, so that a run's arrays stay in cache from one pass to the next. 2 threads, Zen 3
# EPYC, forward / backward ms: AlexNet's norm1 (96 channels at 55x55, batch 32) 94.6 / 64.9 with
# the whole range at once, 22.1 / 21.5 with runs of 1 MiB (one sample; 256 KiB and 4 MiB within
# 10% of it, 16 MiB 49 / 52); GoogLeNet's 192 channels at 56x56, batch 16, 89.1 / 52.6 -> 23.9 /
# 23.5 (both with the square roots below). BatchNorm's passes take runs of channels of the same
# size: 256 channels at 56x56, batch 8, 12.4 / 18.1 -> 9.9 / 11.9 ms; smaller layers unchanged.
RUN_BYTES = 1 << 20


def _run_of(item_bytes):
    """How many items (samples or channels) of item_bytes each make a run of about RUN_BYTES
    (at least one), for split_range's and split_rows' `run`."""
    return max(1, RUN_BYTES // max(int(item_bytes), 1))


def _reduce(a3):
    """Sum of an (outer, dim, inner) array over outer and inner: shape (dim,)."""
    return a3.sum(axis=2).sum(axis=0)


def _reduce_product(xp, a3, b3):
    """_reduce(a3 * b3); einsum (no temporary) is fastest on numpy, multiply-then-sum on CuPy."""
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
        self._scale = _buffer(self, "_scale_buf", x.shape, dt, xp)
        self._pow = _buffer(self, "_pow_buf", x.shape, dt, xp)
        if self.within:
            # zero borders stay zero: only the interior is ever written
            self._pad = _buffer(self, "_pad_buf", (n, c, h + pad, w + pad), dt, xp, zero=True)
            self._rows = _buffer(self, "_rows_buf", (n, c, h, w + pad), dt, xp)
        else:
            self._pad = _buffer(self, "_pad_buf", (n, c + pad, h, w), dt, xp, zero=True)

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
        element (4.6 M floats on one core: 11 ms against 47; within 3 ulp of the rounded
        power, against pow's 1)."""
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
    # The Scale run in place right after this layer (Net._pair_batchnorm_scale), or None. When
    # that Scale folds into this layer (ScaleLayer._into_norm), forward writes the pair's output
    # scale * (x - mean) / sqrt(var + eps) + bias in one pass and keeps x - mean instead of x-hat:
    # four passes over the activations less than the two layers apart
    scale_after = None

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
        self._from_scale = None        # set by a paired Scale's backward (take_scale)
        self._centered = False         # _x_norm holds x - mean (a folded forward), not x-hat

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
        self._shape3 = (n, c, s)
        self._x_norm = _buffer(self, "_x_norm_buf", self._shape3, x.dtype, self.xp)

    def forward(self, bottom, top):
        """Per channel range on the cores (split_range): each channel's statistics and
        normalisation are computed as in one call, so the numbers do not depend on the split."""
        xp = self.xp
        x3 = bottom[0].data.reshape(self._shape3)
        y3 = top[0].data.reshape(self._shape3)       # may be x3 itself (in place)
        xn = self._x_norm
        n, c, s = self._shape3
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

        scale = self.scale_after
        fold = scale is not None and scale.folds_into(self)
        if fold:
            gamma = scale.blobs[0].data.reshape(-1)
            beta = scale.blobs[-1].data.reshape(-1) if scale.bias_term else None

        def part(lo, hi):
            xs, ns = x3[:, lo:hi], xn[:, lo:hi]
            if batch_stats:
                mean[lo:hi] = _reduce(xs) / m
            xp.subtract(xs, mean[lo:hi, None], out=ns)
            if batch_stats:
                var[lo:hi] = _reduce_product(xp, ns, ns) / m
                inv_std[lo:hi] = 1.0 / xp.sqrt(var[lo:hi] + self.eps)
            if fold:                     # the pair's output; ns stays x - mean
                ys = y3[:, lo:hi]
                xp.multiply(ns, (gamma[lo:hi] * inv_std[lo:hi])[:, None], out=ys)
                if beta is not None:
                    ys += beta[lo:hi, None]
                return
            ns *= inv_std[lo:hi, None]
            y3[:, lo:hi] = ns

        split_range(part, c, x3.size, xp, run=self._channel_run())
        self._inv_std = inv_std
        self._centered = fold
        if fold:
            scale.prescaled = True
        if batch_stats:
            b0, b1, b2 = (b.data for b in self.blobs)
            b2 *= self.maf
            b2 += 1
            b0 *= self.maf
            b0 += mean
            b1 *= self.maf
            b1 += var * (m / (m - 1.0) if m > 1 else 1.0)

    def _channel_run(self):
        """Channels a call of the multi-pass work takes: about RUN_BYTES of activations."""
        n, c, s = self._shape3
        return _run_of(n * s * self._x_norm.itemsize)

    def unfold(self, top):
        """After a folded forward whose Scale has not run yet: the top gets this layer's own
        output, x-hat, and the Scale's next forward computes its part (Net.ForwardLayer, for
        a caller that stops between the two)."""
        scale = self.scale_after
        if not (self._centered and scale is not None and scale.prescaled):
            return
        self._x_hat_into(top[0].data.reshape(self._shape3))
        scale.prescaled = False

    def _x_hat_into(self, out):
        """out (N, C, spatial) = x-hat from a folded forward's x - mean, over the cores."""
        xp, inv = self.xp, self._inv_std
        split_range(lambda lo, hi: xp.multiply(self._x_norm[:, lo:hi], inv[lo:hi, None],
                                               out=out[:, lo:hi]),
                    self._shape3[1], out.size, xp)

    def normalized(self):
        """(x - mean) / sqrt(var + eps) of the last forward, as (N, C, spatial): what the top
        held after it (a Scale run in place next reads it instead of copying its input). After a
        folded forward it is made here from x - mean (normalized_parts avoids that)."""
        if self._centered:
            out = self.xp.empty_like(self._x_norm)
            self._x_hat_into(out)
            return out
        return self._x_norm

    def normalized_parts(self):
        """(a, f): the last forward's x-hat is a * f[channel], f None when a is x-hat itself
        (f = 1 / sqrt(var + eps) after a folded forward, a = x - mean)."""
        return self._x_norm, (self._inv_std if self._centered else None)

    def take_scale(self, scale, sum_dy, sum_dy_xn):
        """From the Scale paired with this layer (Net._pair_batchnorm_scale), in its backward:
        the top gradient was left unscaled, here is the scale and the two per-channel sums it
        made for its own gradients; this layer's next backward folds them in."""
        self._from_scale = (scale, sum_dy, sum_dy_xn)

    def backward(self, top, propagate_down, bottom):
        fused, self._from_scale = self._from_scale, None
        if not propagate_down[0]:
            return
        xp = self.xp
        dy = top[0].diff.reshape(self._shape3)
        out = bottom[0].diff.reshape(self._shape3)  # may be dy itself (in place)
        if fused is not None:
            return self._backward_fused(dy, out, fused)
        inv = self._inv_std
        xn, f = self.normalized_parts()
        n, c, s = self._shape3
        m = n * s

        def part(lo, hi):
            d, o = dy[:, lo:hi], out[:, lo:hi]
            if self.use_global_stats:
                xp.multiply(d, inv[lo:hi, None], out=o)
                return
            # dx = (dy - mean(dy) - mean(dy * y) * y) / sqrt(var + eps), means over (N, spatial);
            # with y = a * f: mean(dy * y) * y = f^2 * mean(dy * a) * a
            a = xn[:, lo:hi]
            mean_dy = _reduce(d) / m
            mean_dyy = _reduce_product(xp, d, a) / m
            if f is not None:
                mean_dyy *= f[lo:hi] * f[lo:hi]
            xp.subtract(d, mean_dy[:, None], out=o)
            o -= a * mean_dyy[:, None]
            o *= inv[lo:hi, None]

        split_range(part, c, dy.size, xp, run=self._channel_run())

    def _backward_fused(self, dy, out, fused):
        """The BatchNorm + Scale pair's input gradient from the Scale's top gradient dy. With
        k = scale / sqrt(var + eps) per channel, the Scale's dx = scale * dy makes Caffe's
        formula dx = k * (dy - mean(dy) - mean(dy * xn) * xn), and both means are the sums the
        Scale already made for its own gradients: two reductions and one pass over the
        activations less than the two layers apart (the same numbers up to float rounding)."""
        xp = self.xp
        scale, sum_dy, sum_dy_xn = fused
        k = scale.reshape(-1) * self._inv_std
        n, c, s = self._shape3
        if self.use_global_stats:        # dx = scale * dy / sqrt(var + eps)
            split_range(lambda lo, hi: xp.multiply(dy[:, lo:hi], k[lo:hi, None],
                                                   out=out[:, lo:hi]), c, dy.size, xp)
            return
        m = n * s
        c1 = k * (sum_dy / m)
        c2 = k * (sum_dy_xn / m)
        xn, f = self.normalized_parts()
        if f is not None:                # x-hat = xn * f
            c2 = c2 * f

        def part(lo, hi):
            o = out[:, lo:hi]
            xp.multiply(dy[:, lo:hi], k[lo:hi, None], out=o)
            o -= c1[lo:hi, None]
            o -= xn[:, lo:hi] * c2[lo:hi, None]

        split_range(part, c, dy.size, xp, run=self._channel_run())


# ------------------------------------------------------------------------------------------------
def _operand_axis(layer, bottom0, operand_ndim, axis_param):
    """Caffe: the operand starts at `axis`, or at 0 when it is a scalar (the axis is then moot)."""
    try:
        axis = 0 if operand_ndim == 0 else bottom0.canonical_axis(axis_param)
    except ValueError as e:
        raise layer.error(str(e)) from None
    return axis


def _check_operand(layer, bottom0, operand_shape, axis, what):
    shape = bottom0.shape
    if axis + len(operand_shape) > len(shape):
        raise layer.error(f"the {what} of shape {tuple(operand_shape)} extends past bottom[0]'s shape "
                          f"{shape} when applied from axis {axis}")
    if tuple(shape[axis:axis + len(operand_shape)]) != tuple(operand_shape):
        raise layer.error(f"the {what} of shape {tuple(operand_shape)} does not match bottom[0]'s "
                          f"axes {axis}..{axis + len(operand_shape) - 1} of shape {shape}")
    outer = int(numpy.prod(shape[:axis])) if axis else 1
    dim = int(numpy.prod(operand_shape)) if len(operand_shape) else 1
    inner = int(numpy.prod(shape[axis + len(operand_shape):]))
    return outer, dim, inner


def _learned_shape(layer, bottom0, axis_param, num_axes):
    try:
        axis = bottom0.canonical_axis(axis_param)
    except ValueError as e:
        raise layer.error(str(e)) from None
    if num_axes < -1:
        raise layer.error(f"num_axes must be >= 0, or -1 to extend to the end of bottom[0]; "
                          f"got {num_axes}")
    if num_axes >= 0 and axis + num_axes > bottom0.ndim:
        raise layer.error(f"axis {axis_param} with num_axes {num_axes} extends past bottom[0]'s "
                          f"shape {bottom0.shape}")
    end = bottom0.ndim if num_axes == -1 else axis + num_axes
    return tuple(bottom0.shape[axis:end])


@register("Bias")
class BiasLayer(Layer):
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.bias_param
        self.axis_param = int(p.axis)
        if len(bottom) == 1 and not self.blobs:
            shape = _learned_shape(self, bottom[0], p.axis, p.num_axes)
            # default filler: constant 0 (an empty FillerParameter is exactly that)
            self.add_param(shape, p.filler)

    def reshape(self, bottom, top):
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        self._axis = _operand_axis(self, bottom[0], bias.ndim, self.axis_param)
        self._layout = _check_operand(self, bottom[0], bias.shape, self._axis, "bias")
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        outer, dim, inner = self._layout
        x3 = bottom[0].data.reshape(outer, dim, inner)
        self.xp.add(x3, bias.data.reshape(1, dim, 1), out=top[0].data.reshape(x3.shape))

    def backward(self, top, propagate_down, bottom):
        outer, dim, inner = self._layout
        dy = top[0].diff
        if len(bottom) == 1:
            if self.param_propagate_down[0]:
                self.blobs[0].diff += _reduce(dy.reshape(outer, dim, inner)).reshape(
                    self.blobs[0].shape)
        elif propagate_down[1]:
            bottom[1].diff[...] = _reduce(dy.reshape(outer, dim, inner)).reshape(bottom[1].shape)
        if propagate_down[0] and top[0] is not bottom[0]:
            bottom[0].diff[...] = dy


@register("Scale")
class ScaleLayer(Layer):
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    # Set by the Net when this layer runs in place right after the BatchNorm whose output it
    # scales: backward then reads its input from that layer's normalized copy (bitwise the same
    # numbers) instead of keeping a copy of its own (Net._pair_batchnorm_scale)
    input_from = None
    # Set by that BatchNorm's forward when it already wrote this layer's output (folds_into):
    # this layer's next forward then has nothing to do
    prescaled = False

    def layer_setup(self, bottom, top):
        p = self.param.scale_param
        self.axis_param = int(p.axis)
        self.bias_term = bool(p.bias_term)
        n_expected = (1 if len(bottom) == 1 else 0) + (1 if self.bias_term else 0)
        if len(self.blobs) == n_expected and n_expected > 0:
            return  # parameters already present (loaded or set up before): keep them
        self.blobs = []
        if len(bottom) == 1:
            shape = _learned_shape(self, bottom[0], p.axis, p.num_axes)
            if p.HasField("filler"):
                self.add_param(shape, p.filler)
            else:
                self.add_param(shape, fill_value=1.0)  # identity by default
        if self.bias_term:
            # Caffe builds an internal Bias layer with axis = scale axis and num_axes = bottom[1]'s
            # axis count (two bottoms) or scale num_axes (one bottom); default filler constant 0.
            num_axes = bottom[1].ndim if len(bottom) > 1 else p.num_axes
            shape = _learned_shape(self, bottom[0], p.axis, num_axes)
            self.add_param(shape, p.bias_filler)

    def reshape(self, bottom, top):
        scale = bottom[1] if len(bottom) > 1 else self.blobs[0]
        self._axis = _operand_axis(self, bottom[0], scale.ndim, self.axis_param)
        self._layout = _check_operand(self, bottom[0], scale.shape, self._axis, "scale")
        if self.bias_term:
            bias = self.blobs[-1]
            baxis = _operand_axis(self, bottom[0], bias.ndim, self.axis_param)
            self._bias_layout = _check_operand(self, bottom[0], bias.shape, baxis, "bias")
        # the bias over the same axes as the scale (always, unless loaded blobs say otherwise):
        # both can be cut into the same ranges
        self._same_axes = not self.bias_term or self._bias_layout == self._layout
        # backward leaves its input gradient to the paired BatchNorm (_backward_into_norm): a
        # learned scale (and bias) per channel, after a BatchNorm run in place too, so the blob
        # whose diff is left unscaled is the BatchNorm's bottom as well, and its backward
        # overwrites it
        norm = self.input_from
        self._into_norm = (norm is not None and len(bottom) == 1 and self._same_axes
                           and self._layout == norm._shape3 and norm.in_place)
        if top[0] is bottom[0] and self.input_from is None:
            self._temp = _buffer(self, "_temp_buf", bottom[0].shape, bottom[0].dtype, self.xp)
        elif top[0] is bottom[0]:
            self._temp = self._temp_buf = None          # the BatchNorm's copy serves
        else:
            top[0].reshape(bottom[0].shape)

    def folds_into(self, norm):
        """Whether this layer's forward and input gradient are made by BatchNorm `norm` (its
        pair, run in place before it, per-channel scale and bias: _into_norm)."""
        return self.input_from is norm and self._into_norm

    def _saved_input(self, bottom):
        """The input forward saw, when it ran in place (and overwrote it)."""
        if self.input_from is not None:
            return self.input_from.normalized().reshape(bottom[0].shape)
        return self._temp

    def _split(self, fn):
        """fn(lo, hi) over ranges of the scale's axis on the cores (split_range); one call when
        the bias spans other axes than the scale."""
        outer, dim, inner = self._layout
        if not self._same_axes:
            fn(0, dim)
            return
        split_range(fn, dim, outer * dim * inner, self.xp)

    def forward(self, bottom, top):
        if self.prescaled:               # the paired BatchNorm made the output (folds_into)
            self.prescaled = False
            return
        xp = self.xp
        scale = bottom[1] if len(bottom) > 1 else self.blobs[0]
        outer, dim, inner = self._layout
        in_place = top[0] is bottom[0]
        x3 = bottom[0].data.reshape(outer, dim, inner)
        y3 = top[0].data.reshape(outer, dim, inner)
        s1 = scale.data.reshape(1, dim, 1)
        t3 = (self._temp.reshape(outer, dim, inner) if in_place and self.input_from is None
              else None)
        same_axes = self._same_axes
        if self.bias_term:
            bo, bd, bi = self._bias_layout
            b1 = self.blobs[-1].data.reshape(1, bd, 1)

        def part(lo, hi):
            if t3 is not None:
                t3[:, lo:hi] = x3[:, lo:hi]              # backward needs the input
            xp.multiply(x3[:, lo:hi], s1[:, lo:hi], out=y3[:, lo:hi])
            if self.bias_term and same_axes:
                y3[:, lo:hi] += b1[:, lo:hi]
            elif self.bias_term:                         # one call (_split): the whole array
                y3.reshape(bo, bd, bi)[...] += b1

        self._split(part)

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        outer, dim, inner = self._layout
        dy = top[0].diff
        one = len(bottom) == 1
        scale = self.blobs[0] if one else bottom[1]
        want_bias = self.bias_term and self.param_propagate_down[-1]
        want_scale = (one and self.param_propagate_down[0]) or (not one and propagate_down[1])
        same_axes = self._same_axes
        d3 = dy.reshape(outer, dim, inner)
        if propagate_down[0] and self._into_norm:
            return self._backward_into_norm(d3, scale, want_scale, want_bias)
        x = self._saved_input(bottom) if top[0] is bottom[0] else bottom[0].data
        x3 = x.reshape(outer, dim, inner)
        s1 = scale.data.reshape(1, dim, 1)
        dx3 = bottom[0].diff.reshape(outer, dim, inner)
        scale_diff = scale.diff.reshape(-1)
        if want_bias:
            bias = self.blobs[-1]
            bo, bd, bi = self._bias_layout

        def part(lo, hi):
            if want_bias and same_axes:
                bias.diff.reshape(-1)[lo:hi] += _reduce(d3[:, lo:hi])
            elif want_bias:                              # one call (_split): the whole array
                bias.diff += _reduce(dy.reshape(bo, bd, bi)).reshape(bias.shape)
            if want_scale:
                grad = _reduce_product(xp, d3[:, lo:hi], x3[:, lo:hi])
                if one:
                    scale_diff[lo:hi] += grad
                else:
                    scale_diff[lo:hi] = grad
            if propagate_down[0]:
                xp.multiply(d3[:, lo:hi], s1[:, lo:hi], out=dx3[:, lo:hi])

        self._split(part)

    def _backward_into_norm(self, d3, scale, want_scale, want_bias):
        """The parameter gradients, and the per-channel sums of dy and dy * x the paired
        BatchNorm needs (BatchNormLayer.take_scale); no input gradient is written here. The
        input x is the BatchNorm's x-hat = a * f (normalized_parts)."""
        xp = self.xp
        dim = self._layout[1]
        a3, f = self.input_from.normalized_parts()
        sum_dy = xp.empty(dim, d3.dtype)
        sum_dy_x = xp.empty(dim, d3.dtype)

        def part(lo, hi):
            sum_dy[lo:hi] = _reduce(d3[:, lo:hi])
            sum_dy_x[lo:hi] = _reduce_product(xp, d3[:, lo:hi], a3[:, lo:hi])

        self._split(part)
        if f is not None:
            sum_dy_x *= f
        if want_bias:
            self.blobs[-1].diff.reshape(-1)[...] += sum_dy
        if want_scale:
            scale.diff.reshape(-1)[...] += sum_dy_x
        self.input_from.take_scale(scale.data, sum_dy, sum_dy_x)
