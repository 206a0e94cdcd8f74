"""The input gradient of the im2col route: for stride 1 a convolution of the zero-padded top
gradient with the flipped, transposed kernel (the forward's chunked pass, `_conv_pass`); for other
strides a GEMM into channels-last columns per chunk of whole samples, then col2im into a padded
buffer; for narrow inputs Caffe's own layout (planar.py).

`InputGradient` is a part of `Im2colConvCore` (columns.py), written apart to keep each file to
one pass; it uses that class's buffers, chunks and passes.
"""
from ...backend import get_array_module as _xp
from ...gemm import matmul
from ...parallel import parallel
from ..im2col import Geometry, nhwc_col2im


class InputGradient:
    """How the input gradient is made (`_data_grad_plan`) and its pass over samples lo..hi."""

    def _data_grad_plan(self, dy, weight):
        """How the input gradient is made: 'correlate' (stride 1: a convolution of the padded
        top gradient with the flipped kernel), 'planar' (narrow inputs, planar.py) or 'col2im',
        with the weight in the needed order."""
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
