"""Shared helpers for the 2-D window layers (Convolution, Deconvolution, Pooling).

Everything here is written once for numpy and CuPy (the array module is taken from the arrays) and
works by looping over the kernel offsets (kh x kw iterations, each one vectorised over the whole
batch), never over samples or pixels.

Column layout. Caffe's im2col turns one sample (C, H, W) into a (C*kh*kw, Ho*Wo) matrix. Here the
whole batch is unrolled at once, in the layout (C, kh, kw, N, Ho, Wo): viewed as a matrix it is
(C*kh*kw, N*Ho*Wo), so a convolution is one GEMM for the batch (one per group), and each kernel
offset is a single strided copy whose inner loops run along image rows. The image being unrolled is
given channel-major, (C, N, Hp, Wp), already padded (or an unpadded transposed view of the bottom).
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


def im2col(src, col, geom):
    """Unroll windows: src (C, N, Hp, Wp) padded image -> col (C, kh, kw, N, Ho, Wo)."""
    out_h, out_w = col.shape[-2:]
    for i in range(geom.kh):
        for j in range(geom.kw):
            col[:, i, j] = src[offset_slices(i, j, out_h, out_w, geom)]
    return col


def col2im(col, dst, geom):
    """The adjoint of im2col: dst (C, N, Hp, Wp) = sum of the columns put back at their cells.

    dst is overwritten (zeroed first); each kernel offset adds one strided slice, so overlapping
    windows accumulate without numpy.add.at.
    """
    out_h, out_w = col.shape[-2:]
    dst[...] = 0
    for i in range(geom.kh):
        for j in range(geom.kw):
            dst[offset_slices(i, j, out_h, out_w, geom)] += col[:, i, j]
    return dst


class BufferCache:
    """Scratch arrays kept across iterations, reallocated only when their shape or type changes.

    `get(name, shape, dtype, xp, fill)` returns an array; `fill` (a number) is written only when the
    array is (re)allocated, which is how padded buffers keep their zero (or -FLT_MAX) border while
    only their interior is rewritten each iteration.
    """

    def __init__(self):
        self._arrays = {}

    def get(self, name, shape, dtype, xp, fill=None):
        shape = tuple(int(s) for s in shape)
        dtype = numpy.dtype(dtype)
        a = self._arrays.get(name)
        if a is None or a.shape != shape or a.dtype != dtype or \
                not isinstance(a, xp.ndarray):
            a = xp.empty(shape, dtype) if fill is None else xp.full(shape, fill, dtype)
            self._arrays[name] = a
        return a

    def clear(self):
        self._arrays.clear()
