"""Narrow inputs in Caffe's own column layout: the forward and input gradient of a layer whose
channels-last window rows would be short (a net's first layer, 3 channels).

With 3 input channels a channels-last window row is only kw*C numbers (15 for cifar10_quick's
conv1, 33 for AlexNet's), so the channels-last im2col copies one short run per window row and its
narrow GEMM output needs a transposing copy into NCHW. Here instead: columns (C*kh*kw, cells) from
a zero-padded NCHW copy in output-row runs, the GEMM W x columns writing NCHW, and for the input
gradient W^T x the top gradient's rows, then col2im on NCHW planes. The weight gradient keeps the
channels-last columns (columns.py), whose copy of the input is then made in backward. Which layers
qualify is PLANAR_MAX_RUN_BYTES (routes.py).

`PlanarColumns` is a part of `Im2colConvCore` (columns.py), written apart to keep each file to
one layout; it uses that class's buffers, chunks and forward driver.
"""
import numpy

from ...backend import get_array_module as _xp
from ...gemm import matmul
from ..im2col import offset_slices


class PlanarColumns:
    """Forward and input gradient in Caffe's (C*kh*kw, cells) column layout."""

    def _planar(self, x):
        """Whether forward takes Caffe's own column layout (`_forward_planar`): on the CPU, one
        group, and channels-last window rows of at most PLANAR_MAX_RUN_BYTES (kw*C numbers: 15
        for cifar10_quick's conv1, 33 for AlexNet's), whose copy would be one short run per
        window row and whose narrow GEMM output would need the transposing copy into NCHW."""
        return self._planar_width(x.shape[1], x.itemsize, _xp(x))

    def _planar_width(self, channels, itemsize, xp):
        """The rule of `_planar` for an input of `channels` channels (also the input gradient's
        route: `_data_grad_planar`)."""
        return (xp is numpy and self.group == 1 and not self.pointwise
                and self.geom.kw * channels * itemsize <= self.PLANAR_MAX_RUN_BYTES)

    def _forward_planar(self, x, weight, out, bias, key):
        """Forward as Caffe lays it out: columns (C*kh*kw, cells) copied from a zero-padded NCHW
        copy in runs of output-row length, and the GEMM W (O, C*kh*kw) x columns writes NCHW
        (in place for a chunk of one sample). The channels-last copy that the weight gradient
        reads is made in backward (`_source`), so a forward-only pass never pays for it.

        Why: with 3 input channels a channels-last window row is 9-33 numbers, and copying the
        columns a run at a time plus the transposing copy of the (cells, 32-96) output cost as
        much as the GEMM, the layer's only real work. In this layout the copies run along whole
        output rows and the GEMM writes NCHW itself, which pays on every such first layer. The
        weight gradient from these columns paid on some such layers and not on others (large
        strided kernels, 7x7/2 and 11x11/4), so backward keeps the channels-last columns."""
        xp = numpy
        g = self.geom
        n, c, h, w = x.shape
        o = weight.shape[0]
        wk = weight.reshape(o, -1)                        # (O, C*kh*kw): Caffe's column order
        xpad = self.buffers.get(f"xnchw{key}", (n, c, h + 2 * g.ph, w + 2 * g.pw), x.dtype, xp, 0)
        self.sources.pop(key, None)
        self._unpadded[key] = x

        def fill(lo, hi):
            xpad[lo:hi, :, g.ph:g.ph + h, g.pw:g.pw + w] = x[lo:hi]

        self._run_forward(n, out.shape[2], xp, fill,
                          lambda buf, lo, hi, rows=None: self._planar_pass(
                              buf, xpad, wk, out, bias, lo, hi, rows=rows))
        return out

    def _planar_pass(self, buf, xpad, wk, out, bias, lo, hi, rows=None):
        """out[lo:hi] (or output rows `rows` of the one sample lo) from the padded NCHW input:
        per chunk, one copy into (C, kh, kw, samples, rows, Wo) columns and one GEMM."""
        xp = numpy
        g = self.geom
        c = xpad.shape[1]
        o, k = wk.shape
        out_h, out_w = out.shape[2:]
        plane = out_h * out_w
        sn, sc, sh, sw = xpad.strides
        for s0, m, r0, r1 in self._chunks(lo, hi, out_h, out_w, k * out.itemsize, o, xp,
                                          rows=rows):
            cells = (r1 - r0) * out_w
            shape = (c, g.kh, g.kw, m, r1 - r0, out_w)
            view = xp.lib.stride_tricks.as_strided(
                xpad[s0, :, r0 * g.sh:], shape,
                (sc, sh * g.dh, sw * g.dw, sn, sh * g.sh, sw * g.sw))
            col = buf.get(f"pcol{shape}", shape, out.dtype, xp)
            col[...] = view
            cols = col.reshape(k, m * cells)
            if m == 1:                # straight into the sample's rows (strided by its plane)
                dst = out[s0].reshape(o, plane)[:, r0 * out_w:r1 * out_w]
                matmul(xp, wk, cols, out=dst)
                if bias is not None:
                    dst += bias[:, None]
                continue
            y = buf.get(f"py{m * cells}", (o, m, cells), out.dtype, xp)
            matmul(xp, wk, cols, out=y.reshape(o, m * cells))
            dst = out[s0:s0 + m].reshape(m, o, plane)
            if bias is None:
                dst[...] = y.transpose(1, 0, 2)
            else:
                xp.add(y.transpose(1, 0, 2), bias.reshape(1, o, 1), out=dst)

    def _data_grad_planar(self, buf, wk, dy, dx, lo, hi):
        """dx[lo:hi] for a narrow input (`_planar_width`), in Caffe's layout: columns (C*kh*kw,
        cells) = W^T x the top gradient's (O, cells) rows, then col2im into a padded NCHW buffer,
        one strided add of (C, Ho, Wo) planes per kernel offset.

        Why: the correlate route makes this a convolution with C outputs, a GEMM 3 columns wide
        for an image, which no BLAS runs near its peak, and channels-last col2im adds and copies
        runs of C numbers. Here the GEMM is as wide as the cells and col2im adds whole planes (a
        Deconvolution to 3 channels runs this pass as its forward)."""
        xp = numpy
        g = self.geom
        o, k = wk.shape
        out_h, out_w = dy.shape[2:]
        n, c, h, w = dx.shape
        plane = out_h * out_w
        for s0, m, _, _ in self._chunks(lo, hi, out_h, out_w, k * dy.itemsize, k, xp,
                                        whole_samples=True):
            if m == 1:
                rows = dy[s0].reshape(o, plane)
            else:
                rows = buf.get(f"pdy{m}", (o, m, plane), dy.dtype, xp)
                rows[...] = dy[s0:s0 + m].reshape(m, o, plane).transpose(1, 0, 2)
                rows = rows.reshape(o, m * plane)
            dcol = buf.get(f"pdcol{m}", (k, m * plane), dy.dtype, xp)
            matmul(xp, wk.T, rows, out=dcol)
            cols = dcol.reshape(c, g.kh, g.kw, m, out_h, out_w)
            dpad = buf.get(f"pdxpad{m}", (m, c, h + 2 * g.ph, w + 2 * g.pw), dy.dtype, xp)
            dpad.fill(0)
            for i in range(g.kh):
                for j in range(g.kw):
                    dpad[offset_slices(i, j, out_h, out_w, g)] += \
                        cols[:, i, j].transpose(1, 0, 2, 3)
            dx[s0:s0 + m] = dpad[:, :, g.ph:g.ph + h, g.pw:g.pw + w]
