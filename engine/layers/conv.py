"""Convolution and Deconvolution (Caffe's BaseConvolutionLayer family): 2-D, groups, dilation.

The arithmetic lives in `_ConvCore`, which both layers share: Deconvolution is the transpose of
Convolution, so its forward is the convolution's input gradient and its input gradient is the
convolution's forward (exactly as Caffe's deconv_layer.cpp does it). A Convolution layer may
instead run in the frequency domain (`conv_fourier.FourierConvCore`) or, for wide 3x3 layers, by
Winograd's F(2x2, 3x3) (`conv_winograd.WinogradConvCore`), both with the same interface: reshape
picks the route per layer and input size (`_pick_core`, POSEIDON_CONV).

How the im2col work is laid out (the column layout is in im2col.py, the threads in engine/parallel.py):
- the input is copied once into a zero-padded channels-last buffer (N, Hp, Wp, C); a window's row
  of kw pixels is then kw*C contiguous numbers, so im2col is one copy from a strided view whose
  inner runs are kw*C long (640 bytes for a 5x5 kernel on 32 channels) instead of Wo-cell image
  rows (64 bytes at 16x16): 3-7x faster here;
- the columns are (cells, kh*kw*C), one row per output cell, and the GEMM is columns x W^T ->
  (cells, O), the layout OpenBLAS runs fastest for these narrow (32-64 output) weights; the result
  goes back to NCHW with the bias in one small transposing add;
- the batch is cut into one range of samples per core (engine.parallel, OpenBLAS held to one
  thread) and each range into chunks whose columns stay in L2 (COLUMN_BLOCK_BYTES): several
  samples when they are small, a band of output rows of one sample when one sample is too large
  (the VGG block's 56x56 planes), but never fewer cells than the GEMM's output width, up to
  MIN_CHUNK_CELLS (each GEMM packs the whole weight: 512-channel layers on 7x7 planes); with
  fewer samples than cores the output rows are cut into bands instead (`_bands`: batch 1, or
  batch 8 on 16 cores), and 1x1 layers cut their output channels and their plane;
- the weight goes to the GEMM as a transposed view of (O, kh, kw, C): making that copy only
  reorders each output channel's numbers, where a (K, O) copy moved them all across the array;
- weight gradient, per chunk: the columns are made again from the padded input kept from forward
  (a copy in cache is cheaper than reading stored columns back from memory), one GEMM of the
  chunk's top gradient (O, cells) against them into a per-thread partial; partials are added in
  thread order, so the result does not depend on timing;
- input gradient, stride 1: a stride-1 convolution of the channels-last, zero-padded top gradient
  with the flipped, transposed kernel (the same chunked pass as forward); other strides: GEMM to
  columns, then col2im into a padded channels-last buffer, per chunk of whole samples;
- 1x1 kernels with no pad: no im2col, batched GEMMs straight on the NCHW arrays, one range of
  samples per core as well (output channels or plane ranges below that batch); with a stride,
  on a contiguous copy of the cells the kernel meets, and the input gradient scattered back;
- narrow inputs (a net's first layer, 3 channels: window rows of kw*C <= 33 numbers) take
  Caffe's own layout in forward and in the input gradient (`_planar`): columns (C*kh*kw, cells)
  from a padded NCHW copy in output-row runs, the GEMM W x columns writing NCHW, and for the
  input gradient W^T x the top gradient's rows then col2im on NCHW planes; their weight
  gradient keeps the channels-last columns, whose copy of the input is then made in backward.
Scratch buffers are cached per thread and reallocated only when a shape changes. On CuPy the
whole batch is one range and one chunk (up to GPU_BLOCK_BYTES of columns).
"""
import os

import numpy

from ..backend import get_array_module as _xp
from ..gemm import matmul
from ..layer import Layer, register
from ..proto import caffe_pb2
from .conv_fourier import (FourierConvCore, fourier_applies, fourier_pays,
                           fourier_pays_on_gpu)
from .conv_winograd import WinogradConvCore, winograd_applies, winograd_pays
from ..parallel import CACHE_BLOCK_BYTES, BufferCache, WorkerBuffers, parallel
from .im2col import (Geometry, bias_gradient_of, bias_gradient_part, bias_gradient_sum, nhwc_col2im,
                     nhwc_window_view, offset_slices)


ALGORITHMS = ("auto", "im2col", "fourier", "winograd")


def conv_algorithm():
    """The POSEIDON_CONV setting: 'auto' (default: per layer, by the cost rules of conv_fourier
    and conv_winograd), 'im2col', 'fourier' or 'winograd' (wherever that route applies; im2col
    elsewhere)."""
    value = os.environ.get("POSEIDON_CONV", "auto").strip().lower() or "auto"
    if value not in ALGORITHMS:
        raise ValueError(f"POSEIDON_CONV={value!r}: use one of {', '.join(ALGORITHMS)}")
    return value


class _ConvCore:
    """Convolution arithmetic for one geometry and group count (input x: N x C x H x W)."""

    algorithm = "im2col"

    # a chunk's columns stay under this many bytes (L2-sized); tests make it tiny to get chunks
    COLUMN_BLOCK_BYTES = CACHE_BLOCK_BYTES
    # and, past that size, at least as many cells (GEMM rows) as the GEMM has output columns, up
    # to this many: OpenBLAS packs the whole weight again for every call, which a few rows do not
    # pay for, while a wide product makes up for columns spilling out of L2 (see _chunks)
    MIN_CHUNK_CELLS = 512
    # on CuPy (one range, one thread) chunks are only cut to bound the columns' memory
    GPU_BLOCK_BYTES = 1 << 28
    # forward in Caffe's own column layout (`_forward_planar`) when a window row of the
    # channels-last input is at most this many bytes: a net's first layer (3 channels)
    PLANAR_MAX_RUN_BYTES = 132

    def __init__(self, geom, group):
        self.geom = geom
        self.group = group
        self.buffers = BufferCache()
        self._wbuf = WorkerBuffers()
        self.sources = {}
        self._unpadded = {}   # key -> the input of a planar forward, padded channels-last on demand
        g = geom
        # 1x1 without padding: no im2col, GEMMs on the NCHW arrays; with a stride (ResNet's
        # downsampling 1x1s) on a contiguous copy of the cells the kernel meets (_subsampled)
        self.pointwise = g.kh == 1 and g.kw == 1 and g.ph == 0 and g.pw == 0
        self.strided = self.pointwise and (g.sh > 1 or g.sw > 1)

    def _chunks(self, lo, hi, out_h, out_w, cell_bytes, width, xp, whole_samples=False,
                rows=None):
        """(first sample, samples, first row, end row) pieces of samples lo..hi whose columns
        (cell_bytes per output cell, out_w cells per output row) fit the block size, or hold
        min(width, MIN_CHUNK_CELLS) cells where that is more (width: the GEMM's output columns):
        several whole samples, or bands of output rows of one sample (unless whole_samples).
        rows=(r0, r1): only those output rows of the one sample lo (a band of `_bands`).

        Why the least cells: each GEMM packs the whole weight, paid for by the chunk's rows, and
        a chunk past L2 costs a trip to memory per cell, paid for by the product's width. 2
        threads, forward / backward ms, one process taking turns, 2 MiB blocks against at least
        512 cells: 512 -> 512 channels at 7x7, batch 8, 13.1 / 27.1 against 12.2 / 24.3 (batch
        32: 48.7 / 96.2 against 42.1 / 81.8); 288 -> 384 at 35x35, stride 2, 41.3 / 72.6
        against 34.4 / 69.6; 448 -> 384 at 8x8, 10.6 / 20.8 against 9.9 / 19.6. The width bound
        keeps narrow products in L2: Inception's 80 -> 192 at 71x71 lost 140 -> 153 ms in
        backward when its input gradient (80 wide) took 512-cell chunks; cifar10_quick's and
        the VGG block's layers are unchanged."""
        row_bytes = max(out_w * cell_bytes, 1)
        least = min(self.MIN_CHUNK_CELLS, width) if xp is numpy else 1
        if rows is not None:
            band = max(self.COLUMN_BLOCK_BYTES // row_bytes, -(-least // out_w), 1)
            return [(lo, 1, r, min(r + band, rows[1])) for r in range(rows[0], rows[1], band)]
        if xp is numpy:
            if parallel().workers == 1:   # one thread: BLAS keeps its threads, large GEMMs
                return [(lo, hi - lo, 0, out_h)]
            limit = self.COLUMN_BLOCK_BYTES
        else:
            limit = self.GPU_BLOCK_BYTES
        sample_bytes = out_h * row_bytes
        if sample_bytes <= limit or out_h * out_w < least or whole_samples:
            m = max(limit // sample_bytes, -(-least // (out_h * out_w)), 1)
            return [(s, min(m, hi - s), 0, out_h) for s in range(lo, hi, m)]
        band = max(limit // row_bytes, -(-least // out_w), 1)
        return [(s, 1, r, min(r + band, out_h)) for s in range(lo, hi)
                for r in range(0, out_h, band)]

    @staticmethod
    def _short_batch(n, xp):
        """Whether the batch has fewer samples than there are cores (numpy only): then cutting
        it by samples would leave cores idle (batch 1, or batch 8 on 16 cores)."""
        return xp is numpy and 0 < n < parallel().workers

    @classmethod
    def _bands(cls, n, out_h, xp):
        """For a short batch (_short_batch): the work cut into bands of output rows instead,
        (sample, first row, end row), at least one per core. None when whole samples go round."""
        if not cls._short_batch(n, xp):
            return None
        per = min(out_h, -(-parallel().workers // n))
        return [(s, lo, hi) for s in range(n) for lo, hi in parallel().ranges(out_h, per)]

    # ----- the padded channels-last input -------------------------------------------------------
    def _padded(self, x, name, ph, pw):
        """A cached (N, H + 2ph, W + 2pw, C) buffer whose border stays zero (written once, when
        the buffer is made); its interior is filled by `_fill` per sample range."""
        n, c, h, w = x.shape
        return self.buffers.get(name, (n, h + 2 * ph, w + 2 * pw, c), x.dtype, _xp(x), 0)

    @staticmethod
    def _fill(x, dst, ph, pw, lo, hi):
        """dst's interior (samples lo..hi) = x (NCHW) channels-last. With under 8 channels one
        plane at a time: numpy's transposing copy runs its inner loop over the few channels
        (3 numbers for an image), 3x slower here (AlexNet's input at batch 16: 7.3 against 2.4
        ms) than a copy per channel, which loses from 16 channels on."""
        h, w = x.shape[2:]
        inner = dst[lo:hi, ph:ph + h, pw:pw + w]
        if x.shape[1] < 8:
            for c in range(x.shape[1]):
                inner[..., c] = x[lo:hi, c]
        else:
            inner[...] = x[lo:hi].transpose(0, 2, 3, 1)

    def prepare(self, x, key=0):
        """Keep x (padded, channels-last) under `key` for a later weight gradient."""
        g = self.geom
        self._unpadded.pop(key, None)
        if self.pointwise:
            src = self.sources[key] = self._subsampled(x, key) if self.strided else x
            return src
        src = self.sources[key] = self._padded(x, f"xpad{key}", g.ph, g.pw)
        self._fill(x, src, g.ph, g.pw, 0, x.shape[0])
        return src

    # ----- strided 1x1: a pointwise layer on the cells its kernel meets ----------------------------
    def _subsampled(self, x, key):
        """Every sh-th row and sw-th column of x as a contiguous (N, C, Ho, Wo) array kept under
        `key`: the strided 1x1 layer is the pointwise one on it. Its columns through im2col (a
        channels-last copy, then GEMMs into the transposing add) ran at 57-97 GFLOP/s on ResNet's
        shapes against 160-185 for the pointwise GEMMs on the same numbers."""
        g = self.geom
        n, c, h, w = x.shape
        xs = self.buffers.get(f"xsub{key}", (n, c, (h - 1) // g.sh + 1, (w - 1) // g.sw + 1),
                              x.dtype, _xp(x))
        cells = x.reshape(n * c, h, w)[:, ::g.sh, ::g.sw]
        flat = xs.reshape(n * c, xs.shape[2], xs.shape[3])

        def part(worker, lo, hi):
            flat[lo:hi] = cells[lo:hi]

        parallel().run(part, n * c, _xp(x), min_per_worker=64)
        return xs

    def _scatter(self, dxs, dx):
        """dx (N, C, H, W) = zero but for the strided cells, which get dxs (N, C, Ho, Wo): the
        adjoint of _subsampled."""
        g = self.geom
        n, c, h, w = dx.shape
        flat = dx.reshape(n * c, h, w)
        small = dxs.reshape(n * c, dxs.shape[2], dxs.shape[3])

        def part(worker, lo, hi):
            flat[lo:hi] = 0
            flat[lo:hi, ::g.sh, ::g.sw] = small[lo:hi]

        parallel().run(part, n * c, _xp(dx), min_per_worker=64)

    def _columns(self, buf, view, s0, m, r0, r1, name="col"):
        """im2col of a chunk into a cached per-thread buffer (m, rows, Wo, grp, kh, kw, C/grp):
        one copy from the strided window view."""
        shape = (m, r1 - r0) + view.shape[2:]
        col = buf.get(f"{name}{shape}", shape, view.dtype, _xp(view))
        col[...] = view[s0:s0 + m, r0:r1]
        return col

    def _conv_pass(self, buf, src, geom, wt, out, bias, lo, hi, name, wgrad=None, rows=None):
        """out[lo:hi] (NCHW) = the windows of src (padded channels-last) x wt (grp, K/grp, O/grp)
        (+ bias): chunked im2col, one GEMM per chunk, one transposing copy into NCHW.

        wgrad (input gradient only): (x source, pad h, pad w, partial) -- the same columns (of the
        padded top gradient) also give the weight gradient: partial (grp, K/grp, C/grp) += the
        columns^T x the chunk's input cells (see backward)."""
        xp = _xp(out)
        grp, kg, og = wt.shape
        out_h, out_w = out.shape[2:]
        plane = out_h * out_w
        view = nhwc_window_view(src, geom, out_h, out_w, grp, xp)
        for s0, m, r0, r1 in self._chunks(lo, hi, out_h, out_w, grp * kg * out.itemsize, og, xp,
                                          rows=rows):
            cells = m * (r1 - r0) * out_w
            col = self._columns(buf, view, s0, m, r0, r1, name)
            cmat = col.reshape(cells, grp, kg)
            y = buf.get(f"{name}y{cells}", (grp, cells, og), out.dtype, xp)
            matmul(xp, cmat.transpose(1, 0, 2), wt, out=y)
            ynchw = y.reshape(grp, m, cells // m, og).transpose(1, 0, 3, 2)
            dst = out[s0:s0 + m].reshape(m, grp, og, plane)[..., r0 * out_w:r1 * out_w]
            if bias is None:
                dst[...] = ynchw
            else:
                xp.add(ynchw, bias.reshape(grp, og, 1), out=dst)
            if wgrad is not None:
                xsrc, ph, pw, dwp = wgrad
                cin = xsrc.shape[3]
                xc = buf.get(f"xcells{cells}", (m, r1 - r0, out_w, cin), out.dtype, xp)
                xc[...] = xsrc[s0:s0 + m, ph + r0:ph + r1, pw:pw + out_w]
                tmp = buf.get("dwtmp", dwp.shape, out.dtype, xp)
                matmul(xp, cmat.transpose(1, 2, 0), xc.reshape(cells, grp, -1).transpose(1, 0, 2),
                          out=tmp)
                dwp += tmp

    # ----- forward ---------------------------------------------------------------------------------
    def forward(self, x, weight, out, bias=None, key=0):
        """out (N, O, Ho, Wo) = convolution of x with weight (+ bias); x is kept for backward."""
        xp = _xp(x)
        if self.pointwise:
            if self.strided:
                x = self._subsampled(x, key)
            return self._forward_pointwise(x, weight, out, bias, key)
        if self._planar(x):
            return self._forward_planar(x, weight, out, bias, key)
        self._unpadded.pop(key, None)
        g = self.geom
        grp = self.group
        o, cg = weight.shape[:2]
        og = o // grp
        # W (O, C/g, kh, kw) -> (g, kh*kw*C/g, O/g), the K order of the channels-last columns, as
        # the transposed view of (g, O/g, kh, kw, C/g): that copy only reorders each output
        # channel's own numbers (none for 1x1), where a (K, O) copy moves every number across
        # the array (12 ms for a 2048 x 1024 weight here, on one core); BLAS takes the view as is
        wt = xp.ascontiguousarray(weight.reshape(grp, og, cg, g.kh, g.kw).transpose(0, 1, 3, 4, 2)
                                  ).reshape(grp, og, g.kh * g.kw * cg).transpose(0, 2, 1)
        src = self.sources[key] = self._padded(x, f"xpad{key}", g.ph, g.pw)
        self._run_forward(x.shape[0], out.shape[2], xp,
                          lambda lo, hi: self._fill(x, src, g.ph, g.pw, lo, hi),
                          lambda buf, lo, hi, rows=None: self._conv_pass(
                              buf, src, g, wt, out, bias, lo, hi, "col", rows=rows))
        return out

    def _run_forward(self, n, out_h, xp, fill, conv):
        """A forward over the cores: fill(lo, hi) copies samples lo..hi of the input into its
        padded buffer, conv(buf, lo, hi, rows=None) makes their output (or output rows `rows` of
        the one sample lo); a range of samples per core, or with fewer samples than cores every
        input first, then bands of output rows (`_bands`)."""
        bands = self._bands(n, out_h, xp)
        if bands is not None:
            parallel().run(lambda worker, lo, hi: fill(lo, hi), n, xp)

            def band_work(worker, lo, hi):
                for s, r0, r1 in bands[lo:hi]:
                    conv(self._wbuf(worker), s, s + 1, rows=(r0, r1))

            parallel().run(band_work, len(bands), xp)
            return

        def work(worker, lo, hi):
            fill(lo, hi)
            conv(self._wbuf(worker), lo, hi)

        parallel().run(work, n, xp)

    # ----- forward in Caffe's column layout, for narrow inputs ------------------------------------
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
        much as the GEMM. Forward, 2 threads on the 2-core EPYC, the two alternated, channels-last
        -> this layout: Inception-v3's conv1 (3x3/2, batch 8) 14.9 -> 9.4 ms, VGG19's conv1_1
        (batch 4) 25.8 -> 13.9, GoogLeNet's conv1 (7x7/2, batch 16) 61.1 -> 54.9, ResNet-50's
        (batch 8) 30.4 -> 27.1, AlexNet's (11x11/4, batch 32) 81.6 -> 77.0, cifar10_quick's conv1
        12.2 -> 10.5. The weight gradient from these columns won on some of those layers and lost
        on others (7x7/2, 11x11/4), so backward keeps the channels-last columns."""
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

    def _source(self, key):
        """The padded channels-last input kept under `key` for the weight gradient; after a
        planar forward, made now from that forward's input (which, as in Caffe, backward
        expects unchanged)."""
        x = self._unpadded.pop(key, None)
        if x is None:
            return self.sources.get(key)
        g = self.geom
        src = self.sources[key] = self._padded(x, f"xpad{key}", g.ph, g.pw)
        parallel().run(lambda worker, lo, hi: self._fill(x, src, g.ph, g.pw, lo, hi),
                       x.shape[0], _xp(x))
        return src

    def _forward_pointwise(self, x, weight, out, bias, key):
        """1x1, stride 1, no pad: per sample one GEMM on the NCHW arrays, no im2col; one range
        of samples per core (numpy's BLAS is held to one thread while parallel() runs)."""
        xp = _xp(x)
        self.sources[key] = x
        grp = self.group
        o = weight.shape[0]
        c = x.shape[1]
        n = x.shape[0]
        if grp == 1 and self._short_batch(n, xp):
            # fewer samples than cores: each core makes a range of output channels
            def rows(worker, lo, hi):
                matmul(xp, weight.reshape(o, c)[lo:hi], x.reshape(n, c, -1),
                       out=out.reshape(n, o, -1)[:, lo:hi])
                if bias is not None:
                    out[:, lo:hi] += bias[lo:hi].reshape(1, -1, 1, 1)

            parallel().run(rows, o, xp)
            return out
        w3 = weight.reshape(grp, o // grp, c // grp)

        def work(worker, lo, hi):
            m = hi - lo
            matmul(xp, w3, x[lo:hi].reshape(m, grp, c // grp, -1),
                   out=out[lo:hi].reshape(m, grp, o // grp, -1))
            if bias is not None:
                out[lo:hi] += bias.reshape(1, o, 1, 1)

        parallel().run(work, x.shape[0], xp)
        return out

    # ----- backward --------------------------------------------------------------------------------
    def backward(self, dy, weight, weight_diff=None, bias_diff=None, dx=None, key=0):
        """Gradients for top gradient dy (N, O, Ho, Wo): weight_diff and bias_diff (when given)
        accumulate, dx (when given, N x C x H x W) is overwritten. The weight gradient uses the
        input that forward (or prepare) kept under `key`."""
        xp = _xp(dy)
        if self.strided and dx is not None:           # strided implies pointwise
            dxs = self.buffers.get("dxsub", dy.shape[:1] + dx.shape[1:2] + dy.shape[2:],
                                   dx.dtype, xp)
            self._backward_pointwise(dy, weight, weight_diff, bias_diff, dxs, key)
            self._scatter(dxs, dx)
            return dx
        if self.pointwise:
            return self._backward_pointwise(dy, weight, weight_diff, bias_diff, dx, key)
        g = self.geom
        grp = self.group
        n, o = dy.shape[:2]
        og = o // grp
        cg = weight.shape[1]
        kg = g.kh * g.kw * cg
        src = self._source(key) if weight_diff is not None else None
        data = self._data_grad_plan(dy, weight) if dx is not None else None
        if data is not None and data["mode"] == "correlate":   # made here, filled per range
            data["dpad"] = self._padded(dy, "dypad", data["qh"], data["qw"])
        # stride 1 with both gradients: the columns of the padded top gradient serve both (the
        # input gradient's GEMM and, against the input cells, the flipped weight gradient), so
        # the input is never unrolled again in backward
        shared = weight_diff is not None and data is not None and data["mode"] == "correlate"
        if self._short_batch(n, xp):
            parts = self._backward_bands(dy, weight_diff, bias_diff, dx, src, data, shared, cg)
            self._add_weight_partials(weight_diff, parts, shared, dy.dtype, xp, grp, og, cg)
            return dx

        def work(worker, lo, hi):
            buf = self._wbuf(worker)
            if bias_diff is not None:
                bias_gradient_part(buf, dy, lo, hi)
            if shared:
                dwp = buf.get("dwflip", (grp, kg // cg * og, cg), dy.dtype, xp)
                dwp.fill(0)
                self._data_grad_pass(buf, data, dy, dx, lo, hi, (src, g.ph, g.pw, dwp))
                return
            if weight_diff is not None:
                self._weight_grad_pass(buf, src, dy, grp, kg, lo, hi)
            if data is not None:
                self._data_grad_pass(buf, data, dy, dx, lo, hi)

        parts = parallel().run(work, n, xp)
        self._add_weight_partials(weight_diff, parts, shared, dy.dtype, xp, grp, og, cg)
        if bias_diff is not None:
            for worker in range(parts):
                bias_diff += bias_gradient_of(self._wbuf(worker), dy)
        return dx

    def _add_weight_partials(self, weight_diff, parts, shared, dtype, xp, grp, og, cg):
        """weight_diff += the per-thread partials of the first `parts` workers, in their order."""
        if weight_diff is None:
            return
        g = self.geom
        kg = g.kh * g.kw * cg
        w5 = weight_diff.reshape(grp, og, cg, g.kh, g.kw)
        name, shape = ("dwflip", (grp, kg // cg * og, cg)) if shared else ("dw", (grp, og, kg))
        total = self._wbuf(0).get(name, shape, dtype, xp)
        for worker in range(1, parts):          # in thread order: the sum does not depend on timing
            total += self._wbuf(worker).get(name, shape, dtype, xp)
        if shared:   # (g, kh', kw', O/g, C/g) with kh' = kh-1-i -> Caffe's (O, C/g, kh, kw)
            view = total.reshape(grp, g.kh, g.kw, og, cg)[:, ::-1, ::-1].transpose(0, 3, 4, 1, 2)
        else:        # (g, O/g, kh, kw, C/g) -> Caffe's (O, C/g, kh, kw)
            view = total.reshape(grp, og, g.kh, g.kw, cg).transpose(0, 1, 4, 2, 3)

        def part(worker, lo, hi):               # a transposing add: every core takes some rows
            w5[:, lo:hi] += view[:, lo:hi]

        parallel().run(part, og, xp, min_per_worker=64)

    def _backward_bands(self, dy, weight_diff, bias_diff, dx, src, data, shared, cg):
        """backward when the batch has fewer samples than cores: the weight gradient and a
        stride-1 input gradient per band of rows (`_bands`; their columns need no other rows'
        results), a strided input gradient (col2im, whose windows overlap across rows) per
        sample. Returns how many workers hold weight partials."""
        xp = _xp(dy)
        g = self.geom
        grp = self.group
        n, o = dy.shape[:2]
        og = o // grp
        kg = g.kh * g.kw * cg
        if bias_diff is not None:    # one call: the same sums as one worker over the batch
            bias_diff += bias_gradient_sum(dy)
        correlate = data is not None and data["mode"] == "correlate"
        if correlate:
            qh, qw, dpad = data["qh"], data["qw"], data["dpad"]
            parallel().run(lambda worker, lo, hi: self._fill(dy, dpad, qh, qw, lo, hi), n, xp)
        parts = 0
        if shared:
            bands = self._bands(n, dx.shape[2], xp)

            def work(worker, lo, hi):
                buf = self._wbuf(worker)
                dwp = buf.get("dwflip", (grp, kg // cg * og, cg), dy.dtype, xp)
                dwp.fill(0)
                for s, r0, r1 in bands[lo:hi]:
                    self._conv_pass(buf, dpad, data["geom"], data["wt"], dx, None, s, s + 1,
                                    "dcol", (src, g.ph, g.pw, dwp), rows=(r0, r1))

            return parallel().run(work, len(bands), xp)
        if weight_diff is not None:
            bands = self._bands(n, dy.shape[2], xp)
            parts = parallel().run(lambda worker, lo, hi: self._weight_grad_pass(
                self._wbuf(worker), src, dy, grp, kg, bands[lo:hi]), len(bands), xp)
        if correlate:
            bands = self._bands(n, dx.shape[2], xp)

            def data_work(worker, lo, hi):
                for s, r0, r1 in bands[lo:hi]:
                    self._conv_pass(self._wbuf(worker), dpad, data["geom"], data["wt"], dx, None,
                                    s, s + 1, "dcol", rows=(r0, r1))

            parallel().run(data_work, len(bands), xp)
        elif data is not None:
            parallel().run(lambda worker, lo, hi: self._data_grad_pass(
                self._wbuf(worker), data, dy, dx, lo, hi), n, xp)
        return parts

    def _weight_grad_pass(self, buf, src, dy, grp, kg, lo, hi=None):
        """Per-thread partial weight gradient (g, O/g, K/g) over samples lo..hi from the columns
        of the kept input; lo may instead be a list of (sample, first row, end row) bands."""
        xp = _xp(dy)
        g = self.geom
        o, out_h, out_w = dy.shape[1:]
        og = o // grp
        plane = out_h * out_w
        dwp = buf.get("dw", (grp, og, kg), dy.dtype, xp)
        dwp.fill(0)
        tmp = buf.get("dwtmp", (grp, og, kg), dy.dtype, xp)
        view = nhwc_window_view(src, g, out_h, out_w, grp, xp)
        cell_bytes = grp * kg * dy.itemsize
        pieces = (self._chunks(lo, hi, out_h, out_w, cell_bytes, og, xp)
                  if hi is not None else
                  [c for s, r0, r1 in lo for c in self._chunks(
                      s, s + 1, out_h, out_w, cell_bytes, og, xp, rows=(r0, r1))])
        for s0, m, r0, r1 in pieces:
            cells = m * (r1 - r0) * out_w
            band = dy[s0:s0 + m].reshape(m, o, plane)[:, :, r0 * out_w:r1 * out_w]
            if m == 1:   # one sample: its (O, cells) rows are a strided matrix already
                dyt = band.reshape(grp, og, cells)
            else:
                dyt = buf.get(f"dyt{cells}", (grp, og, cells), dy.dtype, xp)
                dyt.reshape(o, m, cells // m)[...] = band.transpose(1, 0, 2)
            col = self._columns(buf, view, s0, m, r0, r1)
            matmul(xp, dyt, col.reshape(cells, grp, kg).transpose(1, 0, 2), out=tmp)
            dwp += tmp

    def backward_data(self, dy, weight, dx):
        """dx (N, C, H, W) = dL/dx for top gradient dy (N, O, Ho, Wo); dx is overwritten."""
        return self.backward(dy, weight, dx=dx)

    def _data_grad_plan(self, dy, weight):
        """How the input gradient is made: 'correlate' (stride 1: a convolution of the padded
        top gradient with the flipped kernel) or 'col2im', with the weight in the needed order."""
        xp = _xp(dy)
        g = self.geom
        grp = self.group
        o, cg = weight.shape[:2]
        og = o // grp
        w5 = weight.reshape(grp, og, cg, g.kh, g.kw)
        qh = g.dh * (g.kh - 1) - g.ph
        qw = g.dw * (g.kw - 1) - g.pw
        if self._planar_width(cg * grp, weight.itemsize, xp):
            return {"mode": "planar", "wk": weight.reshape(o, -1)}
        if g.sh == 1 and g.sw == 1 and qh >= 0 and qw >= 0:
            # K order (kh, kw, O/g) of the padded gradient's columns, output C/g: a copy that
            # moves every number across the array, so the cores share it (by output channels)
            wt = xp.empty((grp, g.kh, g.kw, og, cg), weight.dtype)
            flipped = w5[:, :, :, ::-1, ::-1].transpose(0, 3, 4, 1, 2)

            def part(worker, lo, hi):
                wt[:, :, :, lo:hi] = flipped[:, :, :, lo:hi]

            parallel().run(part, og, xp, min_per_worker=64)
            return {"mode": "correlate", "qh": qh, "qw": qw,
                    "wt": wt.reshape(grp, g.kh * g.kw * og, cg),
                    "geom": Geometry(g.kh, g.kw, 1, 1, 0, 0, g.dh, g.dw)}
        # (g, O/g, kh*kw*C/g): top gradient rows x this -> channels-last columns
        wmat = xp.ascontiguousarray(w5.transpose(0, 1, 3, 4, 2)).reshape(grp, og, -1)
        return {"mode": "col2im", "wmat": wmat}

    def _data_grad_pass(self, buf, data, dy, dx, lo, hi, wgrad=None):
        xp = _xp(dy)
        g = self.geom
        if data["mode"] == "correlate":
            qh, qw = data["qh"], data["qw"]
            dpad = data["dpad"]
            self._fill(dy, dpad, qh, qw, lo, hi)
            self._conv_pass(buf, dpad, data["geom"], data["wt"], dx, None, lo, hi, "dcol", wgrad)
            return
        if data["mode"] == "planar":
            self._data_grad_planar(buf, data["wk"], dy, dx, lo, hi)
            return
        # general stride: GEMM to channels-last columns, then scatter them back (col2im)
        grp, og, kg = data["wmat"].shape
        o, out_h, out_w = dy.shape[1:]
        c, h, w = dx.shape[1:]
        plane = out_h * out_w
        for s0, m, _, _ in self._chunks(lo, hi, out_h, out_w, grp * kg * dy.itemsize, kg, xp,
                                        whole_samples=True):
            cells = m * plane
            dyc = buf.get(f"dyc{m}", (grp, cells, og), dy.dtype, xp)
            dyc.reshape(grp, m, plane, og)[...] = \
                dy[s0:s0 + m].reshape(m, grp, og, plane).transpose(1, 0, 3, 2)
            dcol = buf.get(f"dcolg{m}", (grp, cells, kg), dy.dtype, xp)
            matmul(xp, dyc, data["wmat"], out=dcol)
            cols = dcol.reshape(grp, m, out_h, out_w, g.kh, g.kw, kg // (g.kh * g.kw)
                                ).transpose(1, 2, 3, 0, 4, 5, 6)
            dpad = buf.get(f"dxpad{m}", (m, h + 2 * g.ph, w + 2 * g.pw, c), dy.dtype, xp)
            nhwc_col2im(cols, dpad, g)
            dx[s0:s0 + m] = dpad[:, g.ph:g.ph + h, g.pw:g.pw + w].transpose(0, 3, 1, 2)

    def _data_grad_planar(self, buf, wk, dy, dx, lo, hi):
        """dx[lo:hi] for a narrow input (`_planar_width`), in Caffe's layout: columns (C*kh*kw,
        cells) = W^T x the top gradient's (O, cells) rows, then col2im into a padded NCHW buffer,
        one strided add of (C, Ho, Wo) planes per kernel offset.

        Why: the correlate route makes this a convolution with C outputs, a GEMM 3 columns wide
        for an image, and channels-last col2im adds and copies runs of C numbers. Deconvolution
        64 -> 3 channels, 5x5, 64x64, batch 16 (its forward is this pass), 2 threads: 103 ms
        against PyTorch's 22."""
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

    def _backward_pointwise(self, dy, weight, weight_diff, bias_diff, dx, key):
        """The pointwise gradients, one range of samples per core; the weight and bias gradients
        as per-thread partials added in thread order (the sum does not depend on timing)."""
        xp = _xp(dy)
        grp = self.group
        o = weight.shape[0]
        n = dy.shape[0]
        og = o // grp
        x = self.sources[key] if weight_diff is not None else None
        c = weight.shape[1] * grp
        cg = c // grp
        plane = dy.shape[2] * dy.shape[3]
        # Small planes (ResNet's 7x7): per-sample products have K = plane (49) and leave one
        # partial (O, C) gradient per sample to sum; with the samples moved next to the plane
        # the weight gradient is one product with K = samples*plane, for the price of copying dy
        # and x (fewer numbers than the partials when plane*(O+C) < O*C). Batch 8, 2048 -> 512
        # at 7x7, one thread: 5.3 instead of 12.3 ms (docs/benchmark-history.md, "the layers that
        # still ran on one core").
        if grp == 1 and self._short_batch(n, xp):
            self._backward_pointwise_split(dy, weight, weight_diff, bias_diff, dx, x)
            return dx
        one_product = plane * (og + cg) < og * cg

        def work(worker, lo, hi):
            buf = self._wbuf(worker)
            m = hi - lo
            if bias_diff is not None:
                bias_gradient_part(buf, dy, lo, hi)
            if weight_diff is not None:
                part = buf.get("pw_dw", (grp, og, cg), dy.dtype, xp)
                if one_product and m > 1:
                    dyt = buf.get("pw_dyt", (grp, og, m, plane), dy.dtype, xp)
                    xt = buf.get("pw_xt", (grp, cg, m, plane), x.dtype, xp)
                    dyt[...] = dy[lo:hi].reshape(m, grp, og, plane).transpose(1, 2, 0, 3)
                    xt[...] = x[lo:hi].reshape(m, grp, cg, plane).transpose(1, 2, 0, 3)
                    matmul(xp, dyt.reshape(grp, og, m * plane),
                           xt.reshape(grp, cg, m * plane).transpose(0, 2, 1), out=part)
                else:
                    per = matmul(xp, dy[lo:hi].reshape(m, grp, og, plane),
                                 x[lo:hi].reshape(m, grp, cg, plane).transpose(0, 1, 3, 2))
                    per.sum(axis=0, out=part)
            if dx is not None:
                matmul(xp, weight.reshape(grp, og, cg).transpose(0, 2, 1),
                       dy[lo:hi].reshape(m, grp, og, plane),
                       out=dx[lo:hi].reshape(m, grp, cg, plane))

        parts = parallel().run(work, n, xp)
        for worker in range(parts):
            buf = self._wbuf(worker)
            if weight_diff is not None:
                weight_diff += buf.get("pw_dw", (grp, og, cg), dy.dtype, xp).reshape(
                    weight_diff.shape)
            if bias_diff is not None:
                bias_diff += bias_gradient_of(buf, dy)
        return dx

    def _backward_pointwise_split(self, dy, weight, weight_diff, bias_diff, dx, x):
        """The pointwise gradients when the batch has fewer samples than cores (one group): the
        weight gradient by ranges of output channels (rows of their own, summed over the
        samples in order), the input gradient by ranges of the plane, the bias in one call."""
        xp = _xp(dy)
        n, o = dy.shape[:2]
        c = weight.shape[1]
        d3 = dy.reshape(n, o, -1)
        plane = d3.shape[2]
        if bias_diff is not None:
            bias_diff += bias_gradient_sum(dy)
        if weight_diff is not None:
            x3 = x.reshape(n, c, -1)
            grad = self.buffers.get("pw_rows", (o, c), dy.dtype, xp)
            tmp = self._wbuf

            def rows(worker, lo, hi):
                part = tmp(worker).get(f"pw_row{hi - lo}", (hi - lo, c), dy.dtype, xp)
                matmul(xp, d3[0, lo:hi], x3[0].T, out=grad[lo:hi])
                for s in range(1, n):
                    matmul(xp, d3[s, lo:hi], x3[s].T, out=part)
                    grad[lo:hi] += part

            parallel().run(rows, o, xp)
            weight_diff += grad.reshape(weight_diff.shape)
        if dx is not None:
            wt = weight.reshape(o, c).T
            dx3 = dx.reshape(n, c, -1)

            def cells(worker, lo, hi):
                for s in range(n):
                    matmul(xp, wt, d3[s, :, lo:hi], out=dx3[s, :, lo:hi])

            parallel().run(cells, plane, xp)


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
        self.core = self._im2col = _ConvCore(self.geom, self.group)
        self._fourier = self._winograd = None
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
        self.core = self._pick_core(n, h, w)

    @property
    def algorithm(self):
        """'im2col', 'fourier' or 'winograd': the route this layer's last reshape picked."""
        return self.core.algorithm

    def _pick_core(self, n, h, w):
        """im2col, the frequency route (conv_fourier) or Winograd's F(2x2, 3x3) (conv_winograd)
        for this input size: Caffe's own engine (engine: CAFFE) and Deconvolution keep im2col;
        otherwise POSEIDON_CONV decides, by default through the cost rules: fourier_pays first
        (it was fitted against im2col on all shapes), then winograd_pays (wide 3x3 layers on
        planes of 14 px or more). Those rules were fitted on CPU timings; on CuPy 'auto' asks
        fourier_pays_on_gpu instead (wide layers on planes of 28 px or more) and never takes
        Winograd."""
        cp = self.param.convolution_param
        if self.reverse or cp.engine == caffe_pb2.ConvolutionParameter.CAFFE:
            return self._im2col
        try:
            choice = conv_algorithm()
        except ValueError as e:
            raise self.error(str(e)) from None
        g, c, o = self.geom, self.channels, self.num_output
        ranges = min(parallel().workers, n)
        on_cpu = self.xp is numpy
        auto = choice == "auto" and on_cpu
        fourier_auto = choice == "auto" and (
            fourier_pays(g, self.group, n, c, o, h, w, ranges) if on_cpu else
            fourier_pays_on_gpu(g, self.group, n, c, o, h, w))
        if (choice == "fourier" and fourier_applies(g, self.group, h, w)) or fourier_auto:
            if self._fourier is None:
                self._fourier = FourierConvCore(g, self.group)
            return self._fourier
        if (choice == "winograd" and winograd_applies(g, self.group)) or (
                auto and winograd_pays(g, self.group, n, c, o, h, w, ranges)):
            if self._winograd is None:
                self._winograd = WinogradConvCore(g, self.group)
            return self._winograd
        return self._im2col

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
                self.blobs[1].diff += bias_gradient_sum(t.diff)
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
