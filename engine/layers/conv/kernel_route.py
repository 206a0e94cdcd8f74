"""The im2col route through the fused kernels (engine/kernels): how a convolution runs on a GPU.

The whole batch is one chunk, and every pass is a few launches over whole arrays:
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
from ... import kernels
from ...gemm import matmul


class KernelColumns:
    """Im2colConvCore's passes on arrays that have a kernel runner (kernels.runner_for)."""

    def _kernel_columns(self, run, x, out_h, out_w):
        """The columns of input x as a (group, cells, K/g) view of one cached buffer."""
        g, grp = self.geom, self.group
        n, c = x.shape[:2]
        col = self.buffers.get("kcol", (n, out_h, out_w, grp, c // grp, g.kh, g.kw), x.dtype,
                               self._xp_of(x))
        kernels.calls.im2col(run, x, col, g, 0, channel_major=True)
        return col.reshape(n * out_h * out_w, grp, -1).transpose(1, 0, 2)

    def _forward_kernels(self, run, x, weight, out, bias, key, relu):
        xp = self._xp_of(x)
        grp = self.group
        o = weight.shape[0]
        cells = x.shape[0] * out.shape[2] * out.shape[3]
        self._kept[key] = x                                  # read again by the weight gradient
        cols = self._kernel_columns(run, x, *out.shape[2:])
        y = self.buffers.get("ky", (grp, cells, o // grp), out.dtype, xp)
        matmul(xp, cols, weight.reshape(grp, o // grp, -1).transpose(0, 2, 1), out=y)
        kernels.calls.bias_relu_nchw(run, y, bias, out, 0, relu is not None, relu or 0.0)
        return out

    def _backward_kernels(self, run, dy, weight, weight_diff, bias_diff, dx, key, relu, fresh):
        """`relu`: (the top's data, slope) of a fused ReLU, whose mask the top gradient takes
        here; `fresh`: (weight, bias) diffs that hold only the zeros of the clear, and are
        written rather than added to."""
        xp = self._xp_of(dy)
        grp = self.group
        n, o, out_h, out_w = dy.shape
        og, plane = o // grp, out_h * out_w
        rows = self.buffers.get("kdy", (grp, n * plane, og), dy.dtype, xp)
        # (N, g, O/g, cells) -> (g, N, cells, O/g): the forward epilogue's inverse
        order = (1, 0, 3, 2)
        view = rows.reshape(grp, n, plane, og)
        top_rows = dy.reshape(n, grp, og, plane).transpose(order)
        if relu is None:
            view[...] = top_rows
        elif relu[1] == 0.0:
            xp.multiply(top_rows, relu[0].reshape(n, grp, og, plane).transpose(order) > 0,
                        out=view)
        else:
            from ..activation import relu_backward
            relu_backward(dy, relu[0], dy, relu[1], xp)
            view[...] = top_rows
        if bias_diff is not None:
            db = bias_diff.reshape(grp, og)
            if fresh[1]:
                rows.sum(axis=1, out=db)
            else:
                xp.add(db, rows.sum(axis=1), out=db)
        if weight_diff is not None:
            cols = self._kernel_columns(run, self._kept[key], out_h, out_w)
            dw = weight_diff.reshape(grp, og, -1)
            if fresh[0]:
                matmul(xp, rows.transpose(0, 2, 1), cols, out=dw)
            else:
                xp.add(dw, matmul(xp, rows.transpose(0, 2, 1), cols), out=dw)
        if dx is not None:
            dcol = self.buffers.get("kdcol", (grp, n * plane, weight[0].size), dy.dtype, xp)
            matmul(xp, rows, weight.reshape(grp, og, -1), out=dcol)
            kernels.calls.col2im(run, dcol, dx, self.geom, out_h, out_w, channel_major=True)
        return dx
