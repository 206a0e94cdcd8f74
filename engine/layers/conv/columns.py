"""im2col + GEMM: the convolution route for any geometry (Caffe's), and the one Deconvolution runs.

How the work is laid out (the column layout is in ../im2col.py, the threads in engine/parallel.py,
the block sizes in routes.py):
- the input is copied once into a zero-padded channels-last buffer (N, Hp, Wp, C); a window's row
  of kw pixels is then kw*C contiguous numbers, so im2col is one copy from a strided view whose
  inner runs are kw*C long (640 bytes for a 5x5 kernel on 32 channels) instead of Wo-cell image
  rows (64 bytes at 16x16), so the copy moves long runs instead of paying a loop per short row;
- the columns are (cells, kh*kw*C), one row per output cell, and the GEMM is columns x W^T ->
  (cells, O), the layout OpenBLAS runs fastest for these narrow (32-64 output) weights; the result
  goes back to NCHW with the bias in one small transposing add;
- the batch is cut into one range of samples per core (engine.parallel, OpenBLAS held to one
  thread) and each range into chunks whose columns stay in L2 (COLUMN_BLOCK_BYTES): several
  samples when they are small, a band of output rows of one sample when one sample is too large
  (the VGG block's 56x56 planes), but never fewer cells than the GEMM's output width, up to
  MIN_CHUNK_CELLS (each GEMM packs the whole weight: 512-channel layers on 7x7 planes); with
  fewer samples than cores the output rows are cut into bands instead (`_bands`: batch 1, or
  batch 8 on 16 cores);
- the weight goes to the GEMM as a transposed view of (O, kh, kw, C): making that copy only
  reorders each output channel's numbers, where a (K, O) copy moved them all across the array;
- weight gradient, per chunk: the columns are made again from the padded input kept from forward
  (a copy in cache is cheaper than reading stored columns back from memory), one GEMM of the
  chunk's top gradient (O, cells) against them into a per-thread partial; partials are added in
  thread order, so the result does not depend on timing;
- input gradient (data_grad.py), stride 1: a stride-1 convolution of the channels-last,
  zero-padded top gradient with the flipped, transposed kernel (the same chunked pass as
  forward); other strides: GEMM to columns, then col2im into a padded channels-last buffer, per
  chunk of whole samples;
- 1x1 kernels with no pad skip the columns (pointwise.py), and narrow inputs (a net's first
  layer, 3 channels) take Caffe's own column layout in forward and in the input gradient
  (planar.py).
Scratch buffers are cached per thread and reallocated only when a shape changes. Where the fused
kernels run (a GPU, or the tests' host build) the passes are kernel_route.py's instead; without
them CuPy takes these passes with the whole batch as one range and one chunk (up to
GPU_BLOCK_BYTES of columns).

A ReLU handed to the layer (engine/layers/fusion.py) comes as `relu` (its slope) to forward and
as `relu` = (the top's data, slope) to backward: here it is the ReLU's own array code after the
forward and before the backward; on the kernel route it is fused.
"""
import numpy

from ... import kernels
from ...backend import get_array_module as _xp
from ...gemm import matmul
from ...parallel import BufferCache, WorkerBuffers, parallel
from ..activation import relu_backward, relu_forward
from ..im2col import nhwc_window_view
from . import routes
from .bias import bias_gradient_of, bias_gradient_part, bias_gradient_sum
from .data_grad import InputGradient
from .kernel_route import KernelColumns
from .planar import PlanarColumns
from .pointwise import Pointwise


class Im2colConvCore(PlanarColumns, Pointwise, KernelColumns, InputGradient):
    """Convolution arithmetic for one geometry and group count (input x: N x C x H x W).

    Deconvolution shares it as the transpose: its forward is `backward_data`, its input
    gradient `forward` (as Caffe's deconv_layer.cpp does)."""

    algorithm = "im2col"
    takes_relu = True   # forward and backward take a fused ReLU (the module docstring)
    _xp_of = staticmethod(_xp)

    # class attributes, so that tests can make chunks tiny (see routes.py for why these sizes)
    COLUMN_BLOCK_BYTES = routes.COLUMN_BLOCK_BYTES
    MIN_CHUNK_CELLS = routes.MIN_CHUNK_CELLS
    GPU_BLOCK_BYTES = routes.GPU_BLOCK_BYTES
    PLANAR_MAX_RUN_BYTES = routes.PLANAR_MAX_RUN_BYTES

    def __init__(self, geom, group):
        self.geom = geom
        self.group = group
        self.buffers = BufferCache()
        self._wbuf = WorkerBuffers()
        self.sources = {}
        self._kept = {}       # key -> the NCHW input of a kernel-route forward (kernel_route.py)
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
        a chunk past L2 costs a trip to memory per cell, paid for by the product's width. So a
        wide layer on small planes (512 channels at 7x7, whose L2-sized chunks would hold a few
        dozen cells) takes at least MIN_CHUNK_CELLS cells a GEMM; but the bound is the product's
        width where that is less, because a narrow product (an input gradient 80 wide) does
        too little work per cell to pay for columns that spill out of L2."""
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
        (3 numbers for an image), paying a loop's start-up for every pixel, where a copy per
        channel runs over whole planes; with many channels the per-channel copies' strided
        writes cost more, and the transposing copy wins."""
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
        self._kept[key] = x
        if self.pointwise:
            src = self.sources[key] = self._subsampled(x, key) if self.strided else x
            return src
        src = self.sources[key] = self._padded(x, f"xpad{key}", g.ph, g.pw)
        self._fill(x, src, g.ph, g.pw, 0, x.shape[0])
        return src

    # ----- im2col and one chunk's GEMM ---------------------------------------------------------------
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
    def forward(self, x, weight, out, bias=None, key=0, relu=None):
        """out (N, O, Ho, Wo) = convolution of x with weight (+ bias), then a fused ReLU of slope
        `relu` (None: none); x is kept for backward."""
        run = None if self.pointwise else kernels.runner_for(out)
        if run is not None:
            return self._forward_kernels(run, x, weight, out, bias, key, relu)
        self._forward_arrays(x, weight, out, bias, key)
        if relu is not None:
            relu_forward(out, out, relu, _xp(out))
        return out

    def _forward_arrays(self, x, weight, out, bias, key):
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
        # the array, a cache miss for most of them on a large weight; BLAS takes the view as is
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

    # ----- backward --------------------------------------------------------------------------------
    def backward(self, dy, weight, weight_diff=None, bias_diff=None, dx=None, key=0, relu=None,
                 fresh=(False, False)):
        """Gradients for top gradient dy (N, O, Ho, Wo): weight_diff and bias_diff (when given)
        accumulate, dx (when given, N x C x H x W) is overwritten. The weight gradient uses the
        input that forward (or prepare) kept under `key`. `relu`: (top data, slope) of a fused
        ReLU, whose mask dy takes first; `fresh`: whether the weight and bias diffs hold only
        the clear's zeros (the kernel route then writes them instead of adding)."""
        xp = _xp(dy)
        run = None if self.pointwise else kernels.runner_for(dy)
        if run is not None:
            return self._backward_kernels(run, dy, weight, weight_diff, bias_diff, dx, key, relu,
                                          fresh)
        if relu is not None:
            relu_backward(dy, relu[0], dy, relu[1], xp)
        if self.strided and dx is not None:           # strided implies pointwise
            return self._backward_strided(dy, weight, weight_diff, bias_diff, dx, key)
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

    def _backward_strided(self, dy, weight, weight_diff, bias_diff, dx, key):
        """backward of a strided 1x1 layer: the input gradient of the cells the kernel met, made
        as a 1x1's, then scattered into dx (zeros elsewhere)."""
        dxs = self.buffers.get("dxsub", dy.shape[:1] + dx.shape[1:2] + dy.shape[2:], dx.dtype,
                               _xp(dy))
        self._backward_pointwise(dy, weight, weight_diff, bias_diff, dxs, key)
        self._scatter(dxs, dx)
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
