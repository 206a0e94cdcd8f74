"""The im2col route through the fused kernels (engine/kernels): how a convolution runs on a GPU.

The whole batch is one chunk (more only where its columns pass GPU_BLOCK_BYTES: a VGG layer's
would take gigabytes), and every pass is a few launches over whole arrays:
- forward: `im2col_nhwc` makes the columns straight from the NCHW input (the padding implicit)
  with each cell's numbers in the weight blob's own order (C/g, kh, kw: channel_major), so one
  GEMM takes the weight as it is; `bias_relu_nchw` writes the GEMM's rows into the NCHW top with
  the bias and a fused ReLU (engine/layers/fusion.py). 3 launches.
- backward: the top gradient reordered once into the GEMM's rows (group, cells, O/g), with the
  fused ReLU's mask in the same pass; the bias gradient one reduction of those rows; the weight
  gradient the columns made again (cheaper than keeping them: they are the largest array of the
  layer) and one GEMM straight into the weight's diff (a GEMM and an add when the diff already
  holds a gradient); the input gradient one GEMM into columns and `col2im_nhwc` gathering them
  into NCHW. 4 to 8 launches.
The CPU keeps columns.py's chunked, threaded passes (its channels-last layout suits OpenBLAS).
"""
import math

from ... import kernels
from ...gemm import matmul
from ..activation import relu_backward


class KernelColumns:
    """Im2colConvCore's passes on arrays that have a kernel runner (kernels.runner_for)."""

    def _sample_chunks(self, n, c, out_h, out_w, itemsize):
        """(first, end) samples of each chunk: the whole batch, or as many samples as keep the
        columns under GPU_BLOCK_BYTES (a VGG layer's would take gigabytes)."""
        g = self.geom
        sample = out_h * out_w * c * g.kh * g.kw * itemsize
        m = max(1, self.GPU_BLOCK_BYTES // max(sample, 1))
        self._chunk = min(m, n)
        return [(s, min(s + m, n)) for s in range(0, n, m)]

    def _scratch(self, name, shape, samples, dtype, xp):
        """A C-contiguous array of `shape` (its size proportional to the chunk's `samples`) at
        the front of one cached buffer sized for a whole chunk, so a last, shorter chunk
        reallocates nothing."""
        size = math.prod(shape)
        flat = self.buffers.get(name, (size // samples * self._chunk,), dtype, xp)
        return flat[:size].reshape(shape)

    def _kernel_columns(self, run, x, out_h, out_w):
        """The columns of input x (a chunk of samples) as a (group, cells, K/g) view of one
        cached buffer."""
        g, grp = self.geom, self.group
        n, c = x.shape[:2]
        col = self._scratch("kcol", (n, out_h, out_w, grp, c // grp, g.kh, g.kw), n, x.dtype,
                            self._xp_of(x))
        kernels.calls.im2col(run, x, col, g, 0, channel_major=True)
        return col.reshape(n * out_h * out_w, grp, -1).transpose(1, 0, 2)

    def _forward_kernels(self, run, x, weight, out, bias, key, relu):
        xp = self._xp_of(x)
        grp = self.group
        o = weight.shape[0]
        out_h, out_w = out.shape[2:]
        wt = weight.reshape(grp, o // grp, -1).transpose(0, 2, 1)   # (g, K/g, O/g), a view
        self._kept[key] = x                                  # read again by the weight gradient
        for s0, s1 in self._sample_chunks(x.shape[0], x.shape[1], out_h, out_w, x.itemsize):
            cols = self._kernel_columns(run, x[s0:s1], out_h, out_w)
            y = self._scratch("ky", (grp, cols.shape[1], o // grp), s1 - s0, out.dtype, xp)
            matmul(xp, cols, wt, out=y)
            kernels.calls.bias_relu_nchw(run, y, bias, out[s0:s1], 0, relu is not None,
                                         relu or 0.0)
        return out

    def _backward_kernels(self, run, dy, weight, weight_diff, bias_diff, dx, key, relu, fresh):
        """`relu`: (the top's data, slope) of a fused ReLU, whose mask the top gradient takes
        here; `fresh`: (weight, bias) diffs that hold only the zeros of the clear, and are
        written rather than added to (by the first chunk)."""
        xp = self._xp_of(dy)
        if relu is not None and relu[1] != 0.0:
            relu_backward(dy, relu[0], dy, relu[1], xp)      # the mask of a leaky ReLU: in place
            relu = None
        x = self._kept.get(key)
        c = weight.shape[1] * self.group if x is None else x.shape[1]
        for s0, s1 in self._sample_chunks(dy.shape[0], c, *dy.shape[2:], dy.itemsize):
            first = s0 == 0
            self._backward_chunk(
                run, dy[s0:s1], None if relu is None else relu[0][s0:s1], weight, weight_diff,
                bias_diff, None if dx is None else dx[s0:s1],
                None if x is None else x[s0:s1], (fresh[0] and first, fresh[1] and first))
        return dx

    def _backward_chunk(self, run, dy, relu_top, weight, weight_diff, bias_diff, dx, x, fresh):
        xp = self._xp_of(dy)
        grp = self.group
        n, o, out_h, out_w = dy.shape
        og, plane = o // grp, out_h * out_w
        rows = self._scratch("kdy", (grp, n * plane, og), n, dy.dtype, xp)
        # (N, g, O/g, cells) -> (g, N, cells, O/g): the forward epilogue's inverse, with the
        # mask of a fused ReLU in the same pass
        order = (1, 0, 3, 2)
        view = rows.reshape(grp, n, plane, og)
        top_rows = dy.reshape(n, grp, og, plane).transpose(order)
        if relu_top is None:
            view[...] = top_rows
        else:
            xp.multiply(top_rows, relu_top.reshape(n, grp, og, plane).transpose(order) > 0,
                        out=view)
        if bias_diff is not None:
            db = bias_diff.reshape(grp, og)
            if fresh[1]:
                rows.sum(axis=1, out=db)
            else:
                xp.add(db, rows.sum(axis=1), out=db)
        if weight_diff is not None:
            cols = self._kernel_columns(run, x, out_h, out_w)
            dw = weight_diff.reshape(grp, og, -1)
            if fresh[0]:
                matmul(xp, rows.transpose(0, 2, 1), cols, out=dw)
            else:
                xp.add(dw, matmul(xp, rows.transpose(0, 2, 1), cols), out=dw)
        if dx is not None:
            dcol = self._scratch("kdcol", (grp, n * plane, weight[0].size), n, dy.dtype, xp)
            matmul(xp, rows, weight.reshape(grp, og, -1), out=dcol)
            kernels.calls.col2im(run, dcol, dx, self.geom, out_h, out_w, channel_major=True)
