"""Convolution and Deconvolution (Caffe's BaseConvolutionLayer family): 2-D, groups, dilation.

The arithmetic lives in `_ConvCore`, which both layers share: Deconvolution is the transpose of
Convolution, so its forward is the convolution's input gradient and its input gradient is the
convolution's forward (exactly as Caffe's deconv_layer.cpp does it).

How the work is laid out (see im2col.py for the column layout and the batch blocks):
- the batch is cut into one range of samples per core and each range into blocks whose columns
  (C*kh*kw x block*Ho*Wo) fit in L2; the ranges run at once on Python threads with OpenBLAS held
  to one thread (im2col.parallel), so copies, GEMMs and transposes all use every core, and the
  columns never travel to main memory (this machine's memory bandwidth, not its GEMM, was the
  limit of the batch-wide im2col: 82 MB of columns for conv2 of cifar10_quick);
- forward, per block: im2col as one copy from a strided view of the padded input (window_view),
  then for planes of at least PER_SAMPLE_MIN_PLANE cells one GEMM per sample on strided views that
  writes NCHW directly, else one GEMM for the block and one transposing copy into the top, with the
  bias added on the way;
- weight gradient, per block: the columns are made again from the padded input kept from forward
  (a copy in cache is cheaper than reading stored columns back from memory), one GEMM against the
  block's transposed top gradient, summed into a per-thread partial; partials are added in thread
  order, so the result does not depend on timing;
- input gradient, stride 1: the transposed convolution is itself a stride-1 convolution of the
  zero-padded top gradient with the flipped, transposed kernel: im2col + GEMM again per block;
  other strides: GEMM to columns, then col2im per block;
- 1x1 kernels with stride 1 and no pad: no im2col, batched GEMMs straight on the NCHW arrays.
Scratch buffers are cached per thread and reallocated only when a shape changes.
"""
import numpy

from ..backend import get_array_module as _xp
from ..layer import Layer, register
from .im2col import COLUMN_BLOCK_BYTES, BufferCache, Geometry, col2im, parallel, window_view


class _ConvCore:
    """Convolution arithmetic for one geometry and group count (input x: N x C x H x W)."""

    def __init__(self, geom, group):
        self.geom = geom
        self.group = group
        self.buffers = BufferCache()
        self._worker_buffers = {}
        self.sources = {}
        g = geom
        self.pointwise = (g.kh == 1 and g.kw == 1 and g.sh == 1 and g.sw == 1
                          and g.ph == 0 and g.pw == 0)

    # Planes at least this large (Ho*Wo) are multiplied one sample at a time (GEMMs straight into
    # NCHW); smaller ones as one GEMM over the block plus a transposing copy, which is cheaper than
    # many small GEMMs. CuPy always takes the one-GEMM path.
    PER_SAMPLE_MIN_PLANE = 256

    def _per_sample(self, plane, xp):
        return xp is numpy and plane >= self.PER_SAMPLE_MIN_PLANE

    def _wbuf(self, worker):
        buf = self._worker_buffers.get(worker)
        if buf is None:
            buf = self._worker_buffers[worker] = BufferCache()
        return buf

    # a block's columns stay under this many bytes (L2-sized); tests make it tiny to get blocks
    COLUMN_BLOCK_BYTES = COLUMN_BLOCK_BYTES

    def _block(self, rows, plane, n, xp, itemsize):
        """Samples per block: the block's columns (rows x block*plane) fit COLUMN_BLOCK_BYTES
        (the whole range on CuPy, where one large GEMM is best)."""
        if xp is not numpy or parallel().workers == 1:
            return max(n, 1)       # one thread: BLAS keeps its threads, large GEMMs are best
        return max(1, min(n, self.COLUMN_BLOCK_BYTES // max(rows * plane * itemsize, 1)))

    # ----- the padded input ----------------------------------------------------------------------
    def _source(self, x, key, xp):
        """The padded NCHW buffer kept under `key` for the columns (x itself without padding);
        its interior is filled by `_fill_source` (per sample range, on the worker threads)."""
        g = self.geom
        if self.pointwise or (g.ph == 0 and g.pw == 0):
            src = x
        else:
            n, c, h, w = x.shape
            src = self.buffers.get(f"xpad{key}", (n, c, h + 2 * g.ph, w + 2 * g.pw), x.dtype,
                                   xp, 0)
        self.sources[key] = src
        return src

    def _fill_source(self, x, src, lo, hi):
        if src is not x:
            g = self.geom
            h, w = x.shape[2:]
            src[lo:hi, :, g.ph:g.ph + h, g.pw:g.pw + w] = x[lo:hi]

    def prepare(self, x, key=0):
        """Keep x (padded) under `key` for a later weight gradient, without computing anything."""
        src = self._source(x, key, _xp(x))
        self._fill_source(x, src, 0, x.shape[0])
        return src

    def _columns(self, buf, src, lo, m, out_h, out_w, name="col"):
        """im2col of samples lo..lo+m of the padded source into a cached per-thread buffer
        (C, kh, kw, m, out_h, out_w): one copy from a strided view."""
        xp = _xp(src)
        g = self.geom
        c = src.shape[1]
        col = buf.get(f"{name}{m}", (c, g.kh, g.kw, m, out_h, out_w), src.dtype, xp)
        col[...] = window_view(src[lo:lo + m], g, out_h, out_w, xp)
        return col

    def _gemm_into_nchw(self, buf, wmat, col, out, bias, m, plane):
        """out (m, O, plane) NCHW block = wmat (grp, O/g, K/g) x col (K, m*plane) (+ bias)."""
        xp = _xp(out)
        grp, og, kg = wmat.shape
        o = grp * og
        if self._per_sample(plane, xp):
            # sample s's columns are a (K/g, plane) block of the (K/g, m*plane) matrix (leading
            # dimension m*plane): one GEMM per sample writes NCHW directly, no transpose
            xp.matmul(wmat, col.reshape(grp, kg, m, plane).transpose(2, 0, 1, 3),
                      out=out.reshape(m, grp, og, plane))
            if bias is not None:
                out += bias.reshape(1, o, 1, 1)
            return
        tmp = buf.get(f"ytmp{m}", (grp, og, m * plane), out.dtype, xp)
        xp.matmul(wmat, col.reshape(grp, kg, m * plane), out=tmp)
        ont = tmp.reshape(o, m, plane).transpose(1, 0, 2)
        if bias is None:
            out.reshape(m, o, plane)[...] = ont
        else:
            xp.add(ont, bias.reshape(1, o, 1), out=out.reshape(m, o, plane))

    # ----- forward ---------------------------------------------------------------------------------
    def forward(self, x, weight, out, bias=None, key=0):
        """out (N, O, Ho, Wo) = convolution of x with weight (+ bias); x is kept for backward."""
        xp = _xp(x)
        if self.pointwise:
            return self._forward_pointwise(x, weight, out, bias, key)
        g = self.geom
        grp = self.group
        n, c = x.shape[:2]
        o = weight.shape[0]
        out_h, out_w = out.shape[2:]
        plane = out_h * out_w
        wmat = weight.reshape(grp, o // grp, -1)
        src = self._source(x, key, xp)
        rows = c * g.kh * g.kw

        def work(worker, lo, hi):
            buf = self._wbuf(worker)
            self._fill_source(x, src, lo, hi)
            nb = self._block(rows, plane, hi - lo, xp, x.itemsize)
            for s0 in range(lo, hi, nb):
                m = min(nb, hi - s0)
                col = self._columns(buf, src, s0, m, out_h, out_w)
                self._gemm_into_nchw(buf, wmat, col, out[s0:s0 + m], bias, m, plane)

        parallel().run(work, n, xp)
        return out

    def _forward_pointwise(self, x, weight, out, bias, key):
        xp = _xp(x)
        self.sources[key] = x
        grp = self.group
        o = weight.shape[0]
        n, c = x.shape[:2]
        xp.matmul(weight.reshape(grp, o // grp, c // grp),
                  x.reshape(n, grp, c // grp, -1), out=out.reshape(n, grp, o // grp, -1))
        if bias is not None:
            out += bias.reshape(1, o, 1, 1)
        return out

    # ----- backward --------------------------------------------------------------------------------
    def backward(self, dy, weight, weight_diff=None, bias_diff=None, dx=None, key=0):
        """Gradients for top gradient dy (N, O, Ho, Wo): weight_diff and bias_diff (when given)
        accumulate, dx (when given, N x C x H x W) is overwritten. The weight gradient uses the
        input that forward (or prepare) kept under `key`."""
        xp = _xp(dy)
        if self.pointwise:
            return self._backward_pointwise(dy, weight, weight_diff, bias_diff, dx, key)
        g = self.geom
        grp = self.group
        n, o, out_h, out_w = dy.shape
        og = o // grp
        plane = out_h * out_w
        src = self.sources.get(key) if weight_diff is not None else None
        c = weight.shape[1] * grp
        kk = g.kh * g.kw
        rows = c * kk
        data = self._data_grad_plan(dy, weight, dx) if dx is not None else None

        def work(worker, lo, hi):
            buf = self._wbuf(worker)
            nb = self._block(max(rows, o * kk), max(plane, dx[0, 0].size if dx is not None
                                                      else 1), hi - lo, xp, dy.itemsize)
            if weight_diff is not None:
                dwp = buf.get("dw", (grp, og, rows // grp), dy.dtype, xp)
                dwp.fill(0)
            if bias_diff is not None:
                dbp = buf.get("db", (o,), dy.dtype, xp)
                dbp.fill(0)
            for s0 in range(lo, hi, nb):
                m = min(nb, hi - s0)
                dyt = None
                if weight_diff is not None or bias_diff is not None or \
                        (data is not None and data["mode"] == "col2im"):
                    dyt = buf.get(f"dyt{m}", (grp, og, m * plane), dy.dtype, xp)
                    dyt.reshape(o, m, plane)[...] = \
                        dy[s0:s0 + m].reshape(m, o, plane).transpose(1, 0, 2)
                if weight_diff is not None:
                    col = self._columns(buf, src, s0, m, out_h, out_w)
                    tmp = buf.get("dwtmp", (grp, og, rows // grp), dy.dtype, xp)
                    xp.matmul(dyt, col.reshape(grp, rows // grp, -1).transpose(0, 2, 1), out=tmp)
                    dwp += tmp
                if bias_diff is not None:
                    dbp += dyt.reshape(o, -1).sum(axis=1)
                if data is not None:
                    self._data_grad_block(buf, data, dy, dyt, dx, s0, m)

        parts = parallel().run(work, n, xp)
        for worker in range(parts):
            buf = self._wbuf(worker)
            if weight_diff is not None:
                weight_diff += buf.get("dw", (grp, og, rows // grp), dy.dtype,
                                       xp).reshape(weight_diff.shape)
            if bias_diff is not None:
                bias_diff += buf.get("db", (o,), dy.dtype, xp)
        return dx

    def backward_data(self, dy, weight, dx):
        """dx (N, C, H, W) = dL/dx for top gradient dy (N, O, Ho, Wo); dx is overwritten."""
        return self.backward(dy, weight, dx=dx)

    def _data_grad_plan(self, dy, weight, dx):
        """What the input gradient needs besides the blocks: the mode and the flipped kernel."""
        xp = _xp(dy)
        g = self.geom
        grp = self.group
        o = weight.shape[0]
        c = dx.shape[1]
        cg, og = c // grp, o // grp
        qh = g.dh * (g.kh - 1) - g.ph
        qw = g.dw * (g.kw - 1) - g.pw
        if g.sh == 1 and g.sw == 1 and qh >= 0 and qw >= 0:
            # full correlation of the padded gradient with the flipped, transposed kernel
            flipped = weight.reshape(grp, og, cg, g.kh, g.kw)[:, :, :, ::-1, ::-1]
            flipped = xp.ascontiguousarray(flipped.transpose(0, 2, 1, 3, 4))
            return {"mode": "correlate", "qh": qh, "qw": qw,
                    "wmat": flipped.reshape(grp, cg, og * g.kh * g.kw),
                    "geom": Geometry(g.kh, g.kw, 1, 1, 0, 0, g.dh, g.dw)}
        return {"mode": "col2im",
                "wmat": weight.reshape(grp, og, cg * g.kh * g.kw).transpose(0, 2, 1)}

    def _data_grad_block(self, buf, data, dy, dyt, dx, s0, m):
        xp = _xp(dy)
        g = self.geom
        o, out_h, out_w = dy.shape[1:]
        c, h, w = dx.shape[1:]
        if data["mode"] == "correlate":
            qh, qw = data["qh"], data["qw"]
            dpad = buf.get(f"dypad{m}", (m, o, out_h + 2 * qh, out_w + 2 * qw), dy.dtype, xp, 0)
            dpad[:, :, qh:qh + out_h, qw:qw + out_w] = dy[s0:s0 + m]
            col = buf.get(f"dcol{m}", (o, g.kh, g.kw, m, h, w), dy.dtype, xp)
            col[...] = window_view(dpad, data["geom"], h, w, xp)
            self._gemm_into_nchw(buf, data["wmat"], col, dx[s0:s0 + m], None, m, h * w)
            return
        # general stride: GEMM to columns, then scatter them back (col2im)
        grp = self.group
        dcol = buf.get(f"dcolg{m}", (c, g.kh, g.kw, m, out_h, out_w), dy.dtype, xp)
        xp.matmul(data["wmat"], dyt, out=dcol.reshape(grp, -1, m * out_h * out_w))
        dpad = buf.get(f"dxpad{m}", (m, c, h + 2 * g.ph, w + 2 * g.pw), dy.dtype, xp)
        col2im(dcol, dpad.transpose(1, 0, 2, 3), g)
        dx[s0:s0 + m] = dpad[:, :, g.ph:g.ph + h, g.pw:g.pw + w]

    def _backward_pointwise(self, dy, weight, weight_diff, bias_diff, dx, key):
        xp = _xp(dy)
        grp = self.group
        o = weight.shape[0]
        n = dy.shape[0]
        og = o // grp
        if weight_diff is not None:
            x = self.sources[key]
            c = x.shape[1]
            per = xp.matmul(dy.reshape(n, grp, og, -1),
                            x.reshape(n, grp, c // grp, -1).transpose(0, 1, 3, 2))
            weight_diff += per.sum(axis=0).reshape(weight_diff.shape)
        if bias_diff is not None:
            bias_diff += dy.reshape(n, o, -1).sum(axis=2).sum(axis=0)
        if dx is not None:
            c = dx.shape[1]
            xp.matmul(weight.reshape(grp, og, c // grp).transpose(0, 2, 1),
                      dy.reshape(n, grp, og, -1), out=dx.reshape(n, grp, c // grp, -1))
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
            self.core.backward(
                t.diff, weight.data,
                weight_diff=weight.diff if self.param_propagate_down[0] else None,
                bias_diff=self.blobs[1].diff if self.bias_term and self.param_propagate_down[1]
                else None,
                dx=b.diff if propagate_down[k] else None, key=k)


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
                n = t.diff.shape[0]
                self.blobs[1].diff += t.diff.reshape(n, self.num_output, -1).sum(axis=2).sum(axis=0)
            if not (self.param_propagate_down[0] or propagate_down[k]):
                continue
            # the top gradient plays the convolution's input: bottom diff = its convolution
            if propagate_down[k]:
                self.core.forward(t.diff, weight.data, b.diff, key=k)
            else:
                self.core.prepare(t.diff, key=k)
            if self.param_propagate_down[0]:
                # dW = x (as a "top gradient" of the convolution) against the columns of dtop
                self.core.backward(b.data, weight.data, weight_diff=weight.diff, key=k)
