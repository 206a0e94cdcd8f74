"""1x1 convolutions without padding: no im2col, GEMMs straight on the NCHW arrays.

A 1x1 kernel's columns would be the input itself, so the products run on (C, plane) slices of
each sample: one range of samples per core, or, when the batch has fewer samples than cores,
ranges of output channels (forward, weight gradient) and of the plane (input gradient). With a
stride (ResNet's downsampling 1x1s) the layer is the pointwise one on a contiguous copy of the
cells its kernel meets, and the input gradient is scattered back.

`Pointwise` is a part of `Im2colConvCore` (columns.py), written apart to keep each file to one
layout; it uses that class's buffers and per-thread scratch.
"""
from ...backend import get_array_module as _xp
from ...gemm import matmul
from ...parallel import parallel
from .bias import bias_gradient_of, bias_gradient_part, bias_gradient_sum


class Pointwise:
    """Forward and backward of a 1x1 layer without padding (and its strided form)."""

    def _subsampled(self, x, key):
        """Every sh-th row and sw-th column of x as a contiguous (N, C, Ho, Wo) array kept under
        `key`: the strided 1x1 layer is the pointwise one on it. Through im2col the same numbers
        would take a channels-last copy, then GEMMs into the transposing add; this copy is a
        quarter of the input (stride 2), and the GEMMs run on it straight into NCHW."""
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
        # and x (fewer numbers than the partials when plane*(O+C) < O*C), and one product with a
        # long K runs near the GEMM's peak where many with K = 49 do not.
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
