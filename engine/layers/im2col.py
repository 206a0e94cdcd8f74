"""Shared helpers for the 2-D window layers (Convolution, Deconvolution, Pooling): the window
geometry, and im2col / col2im in the channels-last column layout.

Everything here is written once for numpy and CuPy (the array module is taken from the arrays or
passed as `xp`) and works by looping over the kernel offsets or copying strided views, never by
looping over samples or pixels. The threads that run it are engine/parallel.py's.

Column layout (Convolution). Caffe's im2col turns one sample (C, H, W) into a (C*kh*kw, Ho*Wo)
matrix. Here the image is first copied channels-last and zero-padded, (N, Hp, Wp, C), and the
columns are (N, Ho, Wo, group, kh, kw, C/group): one row per output cell, viewed as a matrix
(N*Ho*Wo, kh*kw*C) per group. In that order a window's row of kw pixels is kw*C consecutive
numbers of the padded image, so the whole im2col is one copy from a strided view
(`nhwc_window_view`) with long contiguous runs; `nhwc_col2im` is its adjoint.
"""
from collections import namedtuple

import numpy


# Caffe initialises max pooling with -FLT_MAX whatever the blob's type.
NEG_FLT_MAX = -float(numpy.finfo(numpy.float32).max)


class Geometry(namedtuple("Geometry", "kh kw sh sw ph pw dh dw")):
    """Kernel, stride, pad and dilation of a 2-D window op (h then w for each)."""

    @property
    def extent_h(self):
        return self.dh * (self.kh - 1) + 1

    @property
    def extent_w(self):
        return self.dw * (self.kw - 1) + 1

    def conv_out(self, h, w):
        """Convolution output size: floor((in + 2p - (d(k-1)+1)) / s) + 1 per dim (may be < 1)."""
        return ((h + 2 * self.ph - self.extent_h) // self.sh + 1,
                (w + 2 * self.pw - self.extent_w) // self.sw + 1)

    def deconv_out(self, h, w):
        """Deconvolution output size: s(in - 1) + d(k-1) + 1 - 2p per dim (may be < 1)."""
        return (self.sh * (h - 1) + self.extent_h - 2 * self.ph,
                self.sw * (w - 1) + self.extent_w - 2 * self.pw)


def offset_slices(i, j, out_h, out_w, geom, start_h=0, start_w=0):
    """Index of the input cells that kernel offset (i, j) meets, one per output cell.

    For an array whose last two axes are the (padded) image, `a[offset_slices(...)]` has the
    output's spatial shape (out_h, out_w).
    """
    h0 = start_h + i * geom.dh
    w0 = start_w + j * geom.dw
    return (Ellipsis, slice(h0, h0 + (out_h - 1) * geom.sh + 1, geom.sh),
            slice(w0, w0 + (out_w - 1) * geom.sw + 1, geom.sw))


def nhwc_window_view(src, geom, out_h, out_w, group, xp):
    """The windows of a padded channels-last array src (N, Hp, Wp, C) as a strided view of shape
    (N, out_h, out_w, group, kh, kw, C/group), without copying: copying it into a buffer of that
    shape is the whole im2col (for group 1 the last two axes are kw*C consecutive numbers)."""
    sn, sh, sw, sc = src.strides
    g = geom
    n, c = src.shape[0], src.shape[3]
    cg = c // group
    return xp.lib.stride_tricks.as_strided(
        src, (n, out_h, out_w, group, g.kh, g.kw, cg),
        (sn, sh * g.sh, sw * g.sw, sc * cg, sh * g.dh, sw * g.dw, sc))


def nhwc_col2im(col, dst, geom):
    """The adjoint of the im2col above: dst (N, Hp, Wp, C) padded channels-last = the sum of the
    columns col (N, Ho, Wo, group, kh, kw, C/group) put back at their cells.

    dst is overwritten (zeroed first); each kernel offset adds one strided slice, so overlapping
    windows accumulate without numpy.add.at.
    """
    n, out_h, out_w, group, kh, kw, cg = col.shape
    g = geom
    dst[...] = 0
    grouped = dst.reshape(dst.shape[:3] + (group, cg))
    for i in range(kh):
        for j in range(kw):
            h0, w0 = i * g.dh, j * g.dw
            grouped[:, h0:h0 + (out_h - 1) * g.sh + 1:g.sh,
                    w0:w0 + (out_w - 1) * g.sw + 1:g.sw] += col[:, :, :, :, i, j]
    return dst
