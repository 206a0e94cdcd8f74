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


def window_view(src, geom, out_h, out_w, xp):
    """The windows of a padded NCHW array src (N, C, Hp, Wp) as a strided view of shape
    (C, kh, kw, N, out_h, out_w), without copying: `col[...] = window_view(...)` is the whole
    im2col of src in one copy, in the column layout of this module."""
    sn, sc, sh, sw = src.strides
    g = geom
    n, c = src.shape[:2]
    return xp.lib.stride_tricks.as_strided(
        src, (c, g.kh, g.kw, n, out_h, out_w),
        (sc, sh * g.dh, sw * g.dw, sn, sh * g.sh, sw * g.sw))


# ----- batch blocks on several cores ---------------------------------------------------------------
# numpy's elementwise work and copies run on one core, and OpenBLAS splits small GEMMs poorly (the
# weight gradient's long reduction gains nothing from a second thread). So the convolutions cut the
# batch into one contiguous range of samples per core, and each range into blocks small enough that
# a block's columns stay in that core's L2 cache; the ranges run on Python threads (numpy releases
# the GIL in copies, ufuncs and BLAS calls), and InnerProduct splits its GEMMs the same way. Each
# thread keeps its own scratch buffers and partial weight gradient; partials are added in thread
# order, so results do not depend on timing.
#
# While this runs, numpy's OpenBLAS is held to one thread for the whole process (threadpoolctl,
# from the first layer that uses it on): OpenBLAS's own helper threads busy-wait for about 0.1 s
# after each multi-threaded call, and one left spinning beside our threads halves their speed.
# POSEIDON_THREADS=1 turns this off (one Python thread, BLAS threads untouched, batch-wide GEMMs);
# so does a missing threadpoolctl. On CuPy everything runs as one range on the calling thread.
COLUMN_BLOCK_BYTES = 1 << 20


def _cores():
    import os
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:   # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    env = os.environ.get("POSEIDON_THREADS")
    if env:
        try:
            n = max(1, int(env))
        except ValueError:
            pass
    return max(1, min(n, 8))


class _Parallel:
    """Runs fn(worker, lo, hi) over `workers` contiguous ranges of [0, n) at once."""

    def __init__(self):
        self.workers = _cores()
        self._pool = None
        self._limit = None
        if self.workers > 1:
            try:
                from threadpoolctl import ThreadpoolController
                self._limit = ThreadpoolController().select(user_api="blas").limit(limits=1)
            except Exception:   # no threadpoolctl: cannot hold BLAS to one thread; stay serial
                self.workers = 1

    def release(self):
        """Give numpy's BLAS its threads back and run serially from now on."""
        if self._limit is not None:
            self._limit.restore_original_limits()
            self._limit = None
        self.workers = 1

    @staticmethod
    def ranges(n, workers):
        step, extra = divmod(n, workers)
        out, lo = [], 0
        for w in range(workers):
            hi = lo + step + (1 if w < extra else 0)
            if hi > lo:
                out.append((lo, hi))
            lo = hi
        return out

    def run(self, fn, n, xp, min_per_worker=1):
        """fn(worker, lo, hi) for each range; returns the number of ranges (workers used)."""
        workers = self.workers if xp is numpy else 1
        workers = max(1, min(workers, n // max(min_per_worker, 1)))
        parts = self.ranges(n, workers)
        if len(parts) <= 1:
            fn(0, 0, n)
            return 1
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=self.workers - 1,
                                            thread_name_prefix="poseidon")
        futures = [self._pool.submit(fn, w, lo, hi) for w, (lo, hi) in enumerate(parts) if w > 0]
        try:
            fn(0, *parts[0])
        finally:
            for f in futures:
                f.result()
        return len(parts)


_PARALLEL = None


def parallel():
    global _PARALLEL
    if _PARALLEL is None:
        _PARALLEL = _Parallel()
    return _PARALLEL
