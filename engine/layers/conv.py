"""Convolution and Deconvolution (Caffe's BaseConvolutionLayer family): 2-D, groups, dilation.

The arithmetic lives in `_ConvCore`, which both layers share: Deconvolution is the transpose of
Convolution, so its forward is the convolution's input gradient and its input gradient is the
convolution's forward (exactly as Caffe's deconv_layer.cpp does it).

How the work is laid out (see im2col.py for the column layout):
- forward: im2col of the whole batch (one strided copy per kernel offset) into a cached
  (C*kh*kw, N*Ho*Wo) column buffer, one GEMM per group against the (O, C/g*kh*kw) weights, and one
  copy that transposes (O, N, Ho*Wo) into the NCHW top, with the bias added on the way; for large
  planes (numpy, Ho*Wo >= 1024) one GEMM per sample on strided views of the same buffer instead,
  which writes NCHW directly and saves that transpose;
- weight gradient: one GEMM per group against the columns kept from forward (not recomputed);
- input gradient, stride 1: the transposed convolution is itself a stride-1 convolution of the
  zero-padded top gradient with the flipped, transposed kernel, so it is im2col + GEMM again (much
  faster in numpy than a col2im scatter); other strides: GEMM to columns, then col2im;
- 1x1 kernels with stride 1 and no pad: no im2col, batched GEMMs straight on the NCHW arrays.
Scratch buffers are cached and reallocated only when a shape changes.
"""
import numpy

from ..backend import get_array_module as _xp
from ..layer import Layer, register
from .im2col import BufferCache, Geometry, col2im, im2col


class _ConvCore:
    """Convolution arithmetic for one geometry and group count (input x: N x C x H x W)."""

    def __init__(self, geom, group):
        self.geom = geom
        self.group = group
        self.buffers = BufferCache()
        self.cols = {}
        g = geom
        self.pointwise = (g.kh == 1 and g.kw == 1 and g.sh == 1 and g.sw == 1
                          and g.ph == 0 and g.pw == 0)

    # Planes at least this large (Ho*Wo) are multiplied one sample at a time (batched GEMMs
    # straight into NCHW); smaller ones as one GEMM over the batch plus a transposing copy, which is
    # cheaper than many small GEMMs. CuPy always takes the one-GEMM path.
    PER_SAMPLE_MIN_PLANE = 1024

    def _per_sample(self, plane, xp):
        return xp is numpy and plane >= self.PER_SAMPLE_MIN_PLANE

    # ----- columns ------------------------------------------------------------------------------
    def columns(self, x, key=0):
        """Unroll x into the column buffer kept under `key` (for the weight gradient later)."""
        if self.pointwise:
            self.cols[key] = x
            return x
        xp = _xp(x)
        g = self.geom
        n, c, h, w = x.shape
        out_h, out_w = g.conv_out(h, w)
        if g.ph or g.pw:
            src = self.buffers.get("xpad", (c, n, h + 2 * g.ph, w + 2 * g.pw), x.dtype, xp, 0)
            src[:, :, g.ph:g.ph + h, g.pw:g.pw + w] = x.transpose(1, 0, 2, 3)
        else:
            src = x.transpose(1, 0, 2, 3)
        col = self.buffers.get(f"col{key}", (c, g.kh, g.kw, n, out_h, out_w), x.dtype, xp)
        im2col(src, col, g)
        self.cols[key] = col
        return col

    def gemm_forward(self, key, weight, out, bias=None):
        """out (N, O, Ho, Wo) = convolution of the columns under `key` with weight (+ bias)."""
        col = self.cols[key]
        xp = _xp(out)
        grp = self.group
        o = weight.shape[0]
        n = out.shape[0]
        if self.pointwise:
            c = col.shape[1]
            xp.matmul(weight.reshape(grp, o // grp, c // grp),
                      col.reshape(n, grp, c // grp, -1), out=out.reshape(n, grp, o // grp, -1))
            if bias is not None:
                out += bias.reshape(1, o, 1, 1)
            return out
        k = weight[0].size
        plane = col.size // (k * grp * n)
        if self._per_sample(plane, xp):
            # Sample n's columns are a (K, Ho*Wo) block of the (K, N*Ho*Wo) matrix (leading
            # dimension N*Ho*Wo): one GEMM per sample writes NCHW directly, no transpose.
            xp.matmul(weight.reshape(grp, o // grp, k), _per_sample_view(col, grp, n),
                      out=out.reshape(n, grp, o // grp, plane))
            if bias is not None:
                out += bias.reshape(1, o, 1, 1)
            return out
        tmp = self.buffers.get("ytmp", (grp, o // grp, n * plane), out.dtype, xp)
        xp.matmul(weight.reshape(grp, o // grp, k), col.reshape(grp, k, -1), out=tmp)
        ont = tmp.reshape(o, n, -1).transpose(1, 0, 2)
        if bias is None:
            out.reshape(n, o, -1)[...] = ont
        else:
            xp.add(ont, bias.reshape(1, o, 1), out=out.reshape(n, o, -1))
        return out

    def forward(self, x, weight, out, bias=None, key=0):
        self.columns(x, key)
        return self.gemm_forward(key, weight, out, bias)

    # ----- gradients ----------------------------------------------------------------------------
    def transposed_grad(self, dy):
        """dy (N, O, Ho, Wo) as a (group, O/g, N*Ho*Wo) array (a cached copy)."""
        xp = _xp(dy)
        n, o = dy.shape[:2]
        dyt = self.buffers.get("dyt", (self.group, o // self.group, dy.size // o), dy.dtype, xp)
        dyt.reshape(o, n, -1)[...] = dy.reshape(n, o, -1).transpose(1, 0, 2)
        return dyt

    def weight_grad(self, dy, weight_diff, key=0, dyt=None):
        """weight_diff += dL/dW, from dy and the columns that forward kept under `key`."""
        col = self.cols[key]
        xp = _xp(dy)
        grp = self.group
        o = weight_diff.shape[0]
        if self.pointwise:
            n, c = col.shape[:2]
            per = xp.matmul(dy.reshape(n, grp, o // grp, -1),
                            col.reshape(n, grp, c // grp, -1).transpose(0, 1, 3, 2))
            weight_diff += per.sum(axis=0).reshape(weight_diff.shape)
            return dyt
        k = weight_diff[0].size
        n = dy.shape[0]
        plane = dy[0, 0].size
        if dyt is None and self._per_sample(plane, xp):
            per = xp.matmul(dy.reshape(n, grp, o // grp, plane),
                            _per_sample_view(col, grp, n).transpose(0, 1, 3, 2))
            weight_diff += per.sum(axis=0).reshape(weight_diff.shape)
            return None
        if dyt is None:
            dyt = self.transposed_grad(dy)
        tmp = self.buffers.get("dwtmp", (grp, o // grp, k), dy.dtype, xp)
        xp.matmul(dyt, col.reshape(grp, k, -1).transpose(0, 2, 1), out=tmp)
        weight_diff += tmp.reshape(weight_diff.shape)
        return dyt

    def backward_data(self, dy, weight, dx, dyt=None):
        """dx (N, C, H, W) = dL/dx for top gradient dy (N, O, Ho, Wo); dx is overwritten."""
        xp = _xp(dy)
        g = self.geom
        grp = self.group
        n, c, h, w = dx.shape
        o = weight.shape[0]
        cg, og = c // grp, o // grp
        kk = g.kh * g.kw
        if self.pointwise:
            xp.matmul(weight.reshape(grp, og, cg).transpose(0, 2, 1),
                      dy.reshape(n, grp, og, -1), out=dx.reshape(n, grp, cg, -1))
            return dx
        qh = g.dh * (g.kh - 1) - g.ph
        qw = g.dw * (g.kw - 1) - g.pw
        if g.sh == 1 and g.sw == 1 and qh >= 0 and qw >= 0:
            # Full correlation of the padded gradient with the flipped, transposed kernel.
            out_h, out_w = dy.shape[2:]
            dpad = self.buffers.get("dypad", (o, n, out_h + 2 * qh, out_w + 2 * qw), dy.dtype,
                                    xp, 0)
            dpad[:, :, qh:qh + out_h, qw:qw + out_w] = dy.transpose(1, 0, 2, 3)
            col = self.buffers.get("dcol", (o, g.kh, g.kw, n, h, w), dy.dtype, xp)
            im2col(dpad, col, Geometry(g.kh, g.kw, 1, 1, 0, 0, g.dh, g.dw))
            flipped = weight.reshape(grp, og, cg, g.kh, g.kw)[:, :, :, ::-1, ::-1]
            flipped = xp.ascontiguousarray(flipped.transpose(0, 2, 1, 3, 4))
            flipped = flipped.reshape(grp, cg, og * kk)
            if self._per_sample(h * w, xp):
                xp.matmul(flipped, _per_sample_view(col, grp, n),
                          out=dx.reshape(n, grp, cg, h * w))
                return dx
            tmp = self.buffers.get("dxtmp", (grp, cg, n * h * w), dy.dtype, xp)
            xp.matmul(flipped, col.reshape(grp, og * kk, -1), out=tmp)
            dx[...] = tmp.reshape(c, n, h, w).transpose(1, 0, 2, 3)
            return dx
        # General stride: GEMM to columns, then scatter them back (col2im).
        if dyt is None:
            dyt = self.transposed_grad(dy)
        out_h, out_w = dy.shape[2:]
        dcol = self.buffers.get("dcol", (c, g.kh, g.kw, n, out_h, out_w), dy.dtype, xp)
        xp.matmul(weight.reshape(grp, og, cg * kk).transpose(0, 2, 1), dyt,
                  out=dcol.reshape(grp, cg * kk, -1))
        dpad = self.buffers.get("dxpad", (c, n, h + 2 * g.ph, w + 2 * g.pw), dy.dtype, xp)
        col2im(dcol, dpad, g)
        dx[...] = dpad[:, :, g.ph:g.ph + h, g.pw:g.pw + w].transpose(1, 0, 2, 3)
        return dx


def _pair(layer, cp, name, h_name, w_name, default):
    """Caffe's rules for one per-dimension setting: `name` repeated once or once per spatial
    dimension, or the _h/_w pair (2-D only, not mixed with the repeated form)."""
    values = list(getattr(cp, name))
    if h_name is not None and (cp.HasField(h_name) or cp.HasField(w_name)):
        if values:
            raise layer.error(f"gives both {name} and {h_name}/{w_name}: use one form")
        return int(getattr(cp, h_name)), int(getattr(cp, w_name))
    if not values:
        if default is None:
            raise layer.error("gives no kernel size: set kernel_size (once, or once per spatial "
                              "dimension) or kernel_h and kernel_w")
        return default, default
    if len(values) == 1:
        return int(values[0]), int(values[0])
    if len(values) == 2:
        return int(values[0]), int(values[1])
    raise layer.error(f"gives {name} {len(values)} times: give it once, or once per spatial "
                      f"dimension (this engine does 2-D convolution: 2)")


@register("Convolution")
class ConvolutionLayer(Layer):
    """Caffe's Convolution: cross-correlation, zero padding, groups, dilation, 2-D spatial axes.

    Bottoms and tops pair up (bottom i -> top i, same weights). Weight (num_output, C/g, kh, kw),
    bias (num_output,).
    """

    min_bottoms = 1
    min_tops = 1
    equal_bottoms_tops = True
    reverse = False   # Deconvolution swaps the roles of input and output

    def layer_setup(self, bottom, top):
        cp = self.param.convolution_param
        x = bottom[0]
        try:
            axis = x.canonical_axis(cp.axis)
        except ValueError:
            raise self.error(f"axis {cp.axis} is out of range for a bottom of shape {x.shape}") \
                from None
        if axis != 1:
            raise self.error(f"axis {cp.axis}: only axis 1 (N x C x H x W, channels second) is "
                             f"supported")
        if x.ndim != 4:
            raise self.error(f"needs a 4-axis bottom (N x C x H x W), got shape {x.shape}: only "
                             f"2-D convolution is supported (no N-d)")
        for b, t in zip(bottom, top):
            if b is t:
                raise self.error("cannot run in place: give the top its own name")
        kh, kw = _pair(self, cp, "kernel_size", "kernel_h", "kernel_w", None)
        if kh < 1 or kw < 1:
            raise self.error(f"kernel size {kh}x{kw}: both kernel dimensions must be positive "
                             f"(with kernel_h/kernel_w give both)")
        sh, sw = _pair(self, cp, "stride", "stride_h", "stride_w", 1)
        if sh < 1 or sw < 1:
            raise self.error(f"stride {sh}x{sw}: strides must be positive")
        ph, pw = _pair(self, cp, "pad", "pad_h", "pad_w", 0)
        dh, dw = _pair(self, cp, "dilation", None, None, 1)
        if dh < 1 or dw < 1:
            raise self.error(f"dilation {dh}x{dw}: dilations must be positive")
        self.geom = Geometry(kh, kw, sh, sw, ph, pw, dh, dw)

        self.channels = x.shape[1]
        self.num_output = int(cp.num_output)
        if self.num_output < 1:
            raise self.error("num_output must be set to a positive number")
        self.group = int(cp.group)
        if self.group < 1:
            raise self.error(f"group {self.group} must be at least 1")
        if self.channels % self.group:
            raise self.error(f"the bottom's {self.channels} channels are not divisible by "
                             f"group {self.group}")
        if self.num_output % self.group:
            raise self.error(f"num_output {self.num_output} is not divisible by group {self.group}")
        if self.reverse:   # conv in = this layer's output, conv out = this layer's input
            conv_out, conv_in = self.channels, self.num_output
        else:
            conv_out, conv_in = self.num_output, self.channels
        self.core = _ConvCore(self.geom, self.group)
        self.bias_term = bool(cp.bias_term)
        self.add_param((conv_out, conv_in // self.group, kh, kw), cp.weight_filler)
        if self.bias_term:
            self.add_param((self.num_output,), cp.bias_filler)

    def _out_size(self, h, w):
        return self.geom.conv_out(h, w)

    def reshape(self, bottom, top):
        x = bottom[0]
        if x.ndim != 4:
            raise self.error(f"bottom changed to shape {x.shape}: it must stay 4-axis "
                             f"(N x C x H x W)")
        if x.shape[1] != self.channels:
            raise self.error(f"bottom now has {x.shape[1]} channels but the layer was set up for "
                             f"{self.channels}: the channel count may not change after setup")
        for b in bottom[1:]:
            if b.shape != x.shape:
                raise self.error(f"all bottoms must have one shape: {b.shape} vs {x.shape}")
        n, _, h, w = x.shape
        out_h, out_w = self._out_size(h, w)
        if out_h < 1 or out_w < 1:
            g = self.geom
            raise self.error(f"output would be {out_h}x{out_w} for a {h}x{w} input (kernel "
                             f"{g.kh}x{g.kw}, pad {g.ph}x{g.pw}, stride {g.sh}x{g.sw}, dilation "
                             f"{g.dh}x{g.dw}): use a larger input or a smaller kernel/more pad")
        for t in top:
            t.reshape(n, self.num_output, out_h, out_w)

    def forward(self, bottom, top):
        weight = self.blobs[0].data
        bias = self.blobs[1].data if self.bias_term else None
        for k, (b, t) in enumerate(zip(bottom, top)):
            self.core.forward(b.data, weight, t.data, bias, key=k)

    def backward(self, top, propagate_down, bottom):
        weight = self.blobs[0]
        for k, (t, b) in enumerate(zip(top, bottom)):
            dyt = None
            if self.param_propagate_down[0]:
                dyt = self.core.weight_grad(t.diff, weight.diff, key=k)
            if self.bias_term and self.param_propagate_down[1]:
                self.blobs[1].diff += _channel_sum(t.diff, dyt, self.num_output)
            if propagate_down[k]:
                self.core.backward_data(t.diff, weight.data, b.diff, dyt)


def _per_sample_view(col, group, n):
    """Columns (C, kh, kw, N, Ho, Wo) seen as (N, group, C/g*kh*kw, Ho*Wo), without copying."""
    plane = col.shape[-2] * col.shape[-1]
    return col.reshape(group, -1, n, plane).transpose(2, 0, 1, 3)


def _channel_sum(dy, dyt, channels):
    if dyt is not None:
        return dyt.reshape(channels, -1).sum(axis=1)
    n = dy.shape[0]
    return dy.reshape(n, channels, -1).sum(axis=2).sum(axis=0)


@register("Deconvolution")
class DeconvolutionLayer(ConvolutionLayer):
    """Caffe's Deconvolution: the transpose of Convolution (its forward is Convolution's backward).

    Weight (C_in, num_output/g, kh, kw); output size s(in-1) + d(k-1) + 1 - 2p per dimension.
    """

    reverse = True

    def _out_size(self, h, w):
        return self.geom.deconv_out(h, w)

    def forward(self, bottom, top):
        weight = self.blobs[0].data
        for b, t in zip(bottom, top):
            self.core.backward_data(b.data, weight, t.data)
            if self.bias_term:
                t.data += self.blobs[1].data.reshape(1, -1, 1, 1)

    def backward(self, top, propagate_down, bottom):
        weight = self.blobs[0]
        for k, (t, b) in enumerate(zip(top, bottom)):
            if self.bias_term and self.param_propagate_down[1]:
                self.blobs[1].diff += _channel_sum(t.diff, None, self.num_output)
            if not (self.param_propagate_down[0] or propagate_down[k]):
                continue
            self.core.columns(t.diff, key=k)
            if self.param_propagate_down[0]:
                # dW = x^T (as a "top gradient" of the convolution) against the columns of dtop
                self.core.weight_grad(b.data, weight.diff, key=k)
            if propagate_down[k]:
                self.core.gemm_forward(k, weight.data, b.diff)
