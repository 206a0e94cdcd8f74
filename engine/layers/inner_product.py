"""InnerProduct (fully connected): y = x·Wᵀ + b over the axes from `axis` on, as GEMMs in the blob dtype.

Weight `blobs[0]` is (num_output, N_in) — or (N_in, num_output) with `transpose: true` — and the optional
bias `blobs[1]` is (num_output,). With K samples (the product of the axes before `axis`) the top gradient
G is K×M (M = num_output) and the input X is K×N (N = N_in); the weight gradient is Gᵀ·X, a sum of K
rank-1 products: the layer's *sufficient factors*, which a caller can send instead of the gradient
(K·(M + N) numbers instead of M·N) and turn into the gradient where it is needed.
"""
import numpy

from .. import kernels
from ..gemm import matmul
from ..layer import Layer
from ..registry import register
from ..parallel import BufferCache, WorkerBuffers, block_rows, l2_cache_bytes, parallel
from .activation import relu_backward, relu_forward

# Weights at least this large are multiplied by the cores at once (columns of the weight split
# into one range per core, see engine/parallel.py); smaller ones in one call.
PARALLEL_MIN_WEIGHTS = 1 << 20

# Rows of a large weight per forward GEMM (Yᵀ = W·Xᵀ). With a batch of 32 each weight element
# meets only 32 columns, so what OpenBLAS does with the weight rows it packs decides the speed:
# one call per core over thousands of rows runs them from L3, calls over a few hundred rows from
# L2. The block is sized from the L2 (256 rows of 512 KiB, and as many more as the L2 is larger),
# so each call's packed rows stay in the core's own cache while the next call runs beside it.
# Only for batches up to FORWARD_ROWS_MAX_BATCH: with more columns each packed row is used often
# enough that the extra calls cost more than the cache misses they avoid.
# (docs/performance.md, "InnerProduct and the GEMM share".)
FORWARD_ROWS = max(64, l2_cache_bytes() // 2048)
FORWARD_ROWS_MAX_BATCH = 128


@register("InnerProduct")
class InnerProductLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1
    # backward(..., weight_grad=False) leaves the weight gradient to whoever makes it from
    # sufficient_factors() instead, block by block inside the update (engine/solvers/factored.py:
    # the solver, or any caller that makes the weight gradient from the factors, e.g. a
    # sufficient-factor scheme): it then computes only the bias gradient and the bottom diff,
    # and leaves the weight's diff alone, saving a K·M·N GEMM and two passes over the weight.
    has_sufficient_factors = True
    fused_relu = None   # the slope of a following ReLU this layer runs (take_relu)

    def take_relu(self, slope):
        """Run the in-place ReLU (negative slope `slope`) that follows this layer
        (engine/layers/fusion.py): in the fused bias epilogue where the kernels run, else the
        ReLU's own code after the GEMM; its mask goes on the top gradient before backward."""
        self.fused_relu = slope
        return True

    def layer_setup(self, bottom, top):
        p = self.param.inner_product_param
        if p.num_output <= 0:
            raise self.error("inner_product_param.num_output is not set: give the number of outputs "
                             "(num_output > 0)")
        self.num_output = int(p.num_output)
        self.bias_term = bool(p.bias_term)
        self.transpose = bool(p.transpose)
        self.axis = self._axis(bottom[0])
        self.n_in = bottom[0].count_range(self.axis)            # N: inputs per sample
        shape = (self.n_in, self.num_output) if self.transpose else (self.num_output, self.n_in)
        # An unset filler is FillerParameter's default: constant 0 (as in Caffe).
        self.add_param(shape, p.weight_filler)
        if self.bias_term:
            self.add_param((self.num_output,), p.bias_filler)
        self.buffers = BufferCache()                            # scratch kept across iterations
        self.thread_buffers = WorkerBuffers()                   # the same, one per core

    def _axis(self, blob):
        try:
            return blob.canonical_axis(self.param.inner_product_param.axis)
        except ValueError:
            raise self.error(f"axis {self.param.inner_product_param.axis} is out of range for a "
                             f"bottom of shape {tuple(blob.shape)}") from None

    def reshape(self, bottom, top):
        b = bottom[0]
        axis = self._axis(b)
        n_in = b.count_range(axis)
        if n_in != self.n_in:
            raise self.error(f"bottom shape {tuple(b.shape)} gives {n_in} inputs per sample (axes "
                             f"{axis}.. flattened), but the weights were set up for {self.n_in}: an "
                             f"InnerProduct's input size is fixed at setup: give every record the same "
                             f"size (resize or crop them in the data, or set a crop_size)")
        self.axis = axis
        self.k = b.count_range(0, axis)                         # K: samples (rows of the GEMM)
        top[0].reshape(tuple(b.shape[:axis]) + (self.num_output,))

    # ----- the GEMMs ----------------------------------------------------------------------------
    def _split(self, n, fn, with_worker=False):
        """fn(lo, hi) over ranges of [0, n) on the cores when the weight is large, else once;
        with_worker: fn(worker, lo, hi), for scratch of its own (self.thread_buffers)."""
        call = fn if with_worker else (lambda worker, lo, hi: fn(lo, hi))
        if self.blobs[0].count < PARALLEL_MIN_WEIGHTS:
            call(0, 0, n)
            return
        parallel().run(call, n, self.xp, min_per_worker=64)

    def gemm_dims(self, bottom):
        """(num_output, inputs per sample, samples): Y (K×M) = X (K×N) · Wᵀ."""
        return int(self.num_output), int(self.n_in), int(self.k)

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data.reshape(self.k, self.n_in)           # K×N view
        y = top[0].data.reshape(self.k, self.num_output)        # K×M view
        w = self.blobs[0].data
        wt = w if self.transpose else w.T                       # N×M
        b = self.blobs[1].data if self.bias_term else None
        relu = self.fused_relu
        run = kernels.runner_for(y)
        if run is not None:   # one GEMM, then the bias and the ReLU in one fused pass
            matmul(xp, x, wt, out=y)
            kernels.calls.bias_relu_rows(run, y, b, relu is not None, relu or 0.0)
            return

        if not self.transpose and w.size >= PARALLEL_MIN_WEIGHTS:
            # Yᵀ = W·Xᵀ: with the big weight as the left operand OpenBLAS packs it in cache-sized
            # blocks and reads it once, where X·Wᵀ packs whole panels of it first and reads it
            # twice, and with few samples reading the weight is what the product costs; the
            # small Yᵀ is then transposed
            yt = self.buffers.get("yt", (self.num_output, self.k), self.dtype, xp)

            step = (FORWARD_ROWS if xp is numpy and self.k <= FORWARD_ROWS_MAX_BATCH
                    else self.num_output)

            def part(lo, hi):
                for a in range(lo, hi, step):
                    c = min(a + step, hi)
                    matmul(xp, w[a:c], x.T, out=yt[a:c])
                if b is None:
                    y[:, lo:hi] = yt[lo:hi].T
                else:
                    xp.add(yt[lo:hi].T, b[lo:hi], out=y[:, lo:hi])
        else:
            def part(lo, hi):                                   # output columns lo..hi
                matmul(xp, x, wt[:, lo:hi], out=y[:, lo:hi])     # K×M = X·Wᵀ (or X·W)
                if b is not None:
                    y[:, lo:hi] += b[lo:hi]

        self._split(self.num_output, part)
        if relu is not None:
            relu_forward(y, y, relu, xp)

    def backward(self, top, propagate_down, bottom, weight_grad=True):
        xp = self.xp
        if self.fused_relu is not None:                         # the ReLU's backward, in place
            relu_backward(top[0].diff, top[0].data, top[0].diff, self.fused_relu, xp)
        g, x = self.sufficient_factors(bottom, top)             # K×M, K×N
        w = self.blobs[0]
        grad_w = self.param_propagate_down[0] and weight_grad
        grad_b = self.bias_term and self.param_propagate_down[1]
        # the diff still holds the zeros of ClearParamDiffs: write the gradient over it; else
        # make it in scratch and add that
        over = w.diff_fresh
        # a large weight on the CPU: Gᵀ·X block by block of rows into cache-sized scratch whose
        # rows are an odd number of cache lines apart, each block then copied (or added) into the
        # diff while in cache: rows a multiple of 4 KiB apart (e.g. 16 or 36 KiB) written
        # straight into the diff make the GEMM's rows evict each other (engine/gemm.py)
        blocked = (not self.transpose and xp is numpy
                   and w.count >= PARALLEL_MIN_WEIGHTS)
        buf = (w.diff if over or not grad_w or blocked
               else self.buffers.get("dw", w.shape, self.dtype, xp))

        def params(worker, lo, hi):                             # outputs lo..hi
            if grad_w and blocked:                              # M×N = Gᵀ·X, by blocks
                step = block_rows(hi - lo, self.n_in, w.diff.itemsize, factor_rows=self.k)
                part = self.thread_buffers(worker).get_rows("dw", step, self.n_in, self.dtype, xp)
                for a in range(lo, hi, step):
                    b = min(a + step, hi)
                    matmul(xp, g[:, a:b].T, x, out=part[:b - a])
                    if over:
                        numpy.copyto(w.diff[a:b], part[:b - a])
                    else:
                        w.diff[a:b] += part[:b - a]
            elif grad_w:
                if self.transpose:                              # N×M = Xᵀ·G
                    matmul(xp, x.T, g[:, lo:hi], out=buf[:, lo:hi])
                    if not over:
                        w.diff[:, lo:hi] += buf[:, lo:hi]
                else:                                           # M×N = Gᵀ·X
                    matmul(xp, g[:, lo:hi].T, x, out=buf[lo:hi])
                    if not over:
                        w.diff[lo:hi] += buf[lo:hi]
            if grad_b:                                          # written over fresh zeros
                db = self.blobs[1].diff[lo:hi]
                if self.blobs[1].diff_fresh:
                    g[:, lo:hi].sum(axis=0, out=db)
                else:
                    xp.add(db, g[:, lo:hi].sum(axis=0), out=db)

        if grad_w or grad_b:
            self._split(self.num_output, params, with_worker=True)
        if propagate_down[0]:
            dx = bottom[0].diff.reshape(self.k, self.n_in)
            wd = w.data.T if self.transpose else w.data         # M×N

            def data(lo, hi):                                   # inputs lo..hi
                matmul(xp, g, wd[:, lo:hi], out=dx[:, lo:hi])    # K×N = G·W (or G·Wᵀ)

            self._split(self.n_in, data)

    # ----- sufficient factors (for a caller that makes the weight gradient from them) ----------
    def sufficient_factors(self, bottom, top):
        """(G, X): top diff as a K×M view and bottom data as a K×N view (no copies).

        The weight gradient of this batch is weight_grad_from_factors(G, X); the bias gradient G.sum(0).
        """
        g = top[0].diff.reshape(self.k, self.num_output)
        x = bottom[0].data.reshape(self.k, self.n_in)
        return g, x

    def weight_grad_from_factors(self, G, X, out=None, rows=None, split=True):
        """Weight gradient in this layer's weight layout from (stacked) factors G (K×M) and X (K×N):
        Gᵀ·X (M×N), or Xᵀ·G (N×M) with `transpose: true`. `rows=(lo, hi)` gives only those rows
        of it (a block of the weight's first axis, for an update made block by block while the
        block is in cache). Written into `out` (the block's shape, rows contiguous) when given, else
        into a new array; returns it. Large weights: the columns split over the cores, as in
        forward and backward, unless `split` is False (a caller that runs one block per thread)."""
        lo, hi = (0, self.blobs[0].shape[0]) if rows is None else rows
        a, b = (X, G) if self.transpose else (G, X)             # block = a[:, lo:hi]ᵀ·b
        if out is None:
            out = self.xp.empty((hi - lo, b.shape[1]), self.xp.result_type(G.dtype, X.dtype))
        elif out.shape != (hi - lo, b.shape[1]):
            raise self.error(f"weight_grad_from_factors: out has shape {tuple(out.shape)}, rows "
                             f"{lo}..{hi} of the gradient need {(hi - lo, b.shape[1])}")
        a = a[:, lo:hi].T

        def part(c0, c1):                                       # output columns c0..c1
            matmul(self.xp, a, b[:, c0:c1], out=out[:, c0:c1])

        if split:
            self._split(out.shape[1], part)
        else:
            part(0, out.shape[1])
        return out
