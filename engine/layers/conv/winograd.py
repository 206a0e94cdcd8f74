"""3x3 stride-1 convolution by Winograd's minimal filtering, F(2x2, 3x3).

Why. im2col spends 9 multiply-adds per output cell, input channel and output channel. Winograd's
F(2x2, 3x3) computes a 2x2 block of outputs from a 4x4 block of input with 16 products per channel
pair instead of 36, so the GEMMs do 2.25x fewer FLOPs; the price is two linear transforms on each
side of them, which here are additions and subtractions of whole arrays (numpy or CuPy
elementwise work, no Python loop over cells). Wide 3x3 layers on planes of 14 px or more (VGG's
128-512-channel stages) are what this is for: there the GEMMs saved outweigh the transforms'
elementwise passes, whose cost does not grow with the channel counts. With 64-96 channels, small
planes or few samples a thread the transforms cost what the GEMMs save; routes.py times the
routes and keeps the faster one (docs/performance.md, "Convolutions").

The arithmetic, with d a 4x4 input tile (rows 2ty..2ty+3 and columns 2tx..2tx+3 of the zero-padded
input), g a 3x3 kernel and y the 2x2 output tile at (2ty, 2tx):
    y = A^T [(G g G^T) . (B^T d B)] A          . the elementwise product, summed over channels
    B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
    G   = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]
    A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]
Per transformed position (i, j) of the 16, the sum over channels is one GEMM: M_ij (tiles x O) =
V_ij (tiles x C) x U_ij (C x O), with V = B^T d B and U = G g G^T. The map is linear in d and in
g, so backward runs its transposes exactly: dM = A dY A^T from the top gradient's 2x2 tiles, then
dU_ij = dM_ij^T V_ij (the weight gradient, dW = G^T dU G) and dV_ij = dM_ij U_ij^T, whose
transform B dV B^T is added back over the overlapping input tiles (the input gradient). The
gradients are those of the computed forward, to rounding (float32 error about 1e-6 relative,
like im2col's; tests hold both to float64 references).

Layout. The input is copied once into a zero-padded channels-last buffer whose columns are split by
parity, (N, Hq, 2, Wq/2, C): the tiles' rows 2ty + i are then a strided slice over rows, and their
columns 2tx + j the contiguous run [j//2, j//2 + tw) of parity j%2, so every transform step is one
array operation on long contiguous runs. The batch is cut into one range of samples per core (as
im2col does) and each range into chunks of whole samples; the padded input is kept from forward
for the weight gradient, and V is made again in backward (in cache, cheaper than storing 4x the
input).
"""
import numpy

from ...backend import get_array_module as _xp
from ...gemm import matmul
from ...parallel import CACHE_BLOCK_BYTES, WorkerBuffers, parallel, scratch
from .bias import bias_gradient_of, bias_gradient_part

def winograd_applies(geom, group):
    """F(2x2, 3x3) computes this convolution exactly: a 3x3 kernel, stride 1, no dilation, one
    group (grouped layers keep im2col)."""
    g = geom
    return (g.kh == 3 and g.kw == 3 and g.sh == 1 and g.sw == 1 and g.dh == 1 and g.dw == 1
            and group == 1)


def pass_flops(n, c, o, out_h, out_w, weight_grad=True, input_grad=True):
    """(forward, backward) FLOPs of the GEMMs WinogradConvCore runs (16 per tile set: 2 x tiles x
    C x O each); tests hold the GEMM meter to this."""
    tiles = n * -(-out_h // 2) * -(-out_w // 2)
    one = 2.0 * 16 * tiles * c * o
    return one, one * (int(weight_grad) + int(input_grad))


_G = ((1.0, 0.0, 0.0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0.0, 0.0, 1.0))


def _kernel_matrix(dtype, xp):
    """K (9, 16) with vec(G g G^T) = vec(g) K for a 3x3 kernel g: K[3i + j, 4a + b] =
    G[a, i] G[b, j]."""
    G = numpy.array(_G)
    return xp.asarray(numpy.einsum("ai,bj->ijab", G, G).reshape(9, 16).astype(dtype))


def _a_transposed(xp, r, out0, out1):
    """A^T applied over the first index of r (4, ...): out0 = r0 + r1 + r2, out1 = r1 - r2 - r3."""
    xp.add(r[0], r[1], out=out0)
    out0 += r[2]
    xp.subtract(r[1], r[2], out=out1)
    out1 -= r[3]


def _a_applied(xp, y0, y1, out):
    """A applied to the pair (y0, y1), into out (4, ...): y0, y0 + y1, y0 - y1, -y1."""
    out[0] = y0
    xp.add(y0, y1, out=out[1])
    xp.subtract(y0, y1, out=out[2])
    xp.negative(y1, out=out[3])


class _Shape:
    """Sizes of one input shape: tiles per side, the padded parity-split buffer, the parity runs
    that hold the image's columns."""

    def __init__(self, geom, h, w):
        g = geom
        self.h, self.w = h, w
        self.out_h, self.out_w = g.conv_out(h, w)
        self.th, self.tw = -(-self.out_h // 2), -(-self.out_w // 2)
        self.hq, self.wh = 2 * self.th + 2, self.tw + 1        # rows, columns per parity
        self.ph, self.pw = g.ph, g.pw
        # per parity q: (first image column, first slot, count) of the columns w with
        # (w + pad) % 2 == q, which sit at slot (w + pad) // 2
        self.parities = []
        for q in (0, 1):
            w0 = (q - g.pw) % 2
            count = len(range(w0, w, 2))
            self.parities.append((w0, (w0 + g.pw) // 2, count))

    def fill(self, x, xq):
        """xq[:, rows of the image, parity, slots] = x (N, C, H, W) in channels-last order."""
        for q, (w0, s0, count) in enumerate(self.parities):
            if count:
                xq[:, self.ph:self.ph + self.h, q, s0:s0 + count] = \
                    x[:, :, :, w0::2].transpose(0, 2, 3, 1)

    def unfill(self, xq, dx):
        """dx (N, C, H, W) = the image cells of a parity-split padded buffer."""
        for q, (w0, s0, count) in enumerate(self.parities):
            if count:
                dx[:, :, :, w0::2] = xq[:, self.ph:self.ph + self.h, q, s0:s0 + count
                                        ].transpose(0, 3, 1, 2)


class WinogradConvCore:
    """F(2x2, 3x3) convolution with the interface of `Im2colConvCore` (forward, backward)."""

    algorithm = "winograd"
    CHUNK_BYTES = CACHE_BLOCK_BYTES     # V of a chunk of samples stays about this size
    GPU_CHUNK_BYTES = 1 << 28
    MIN_TILES = 512

    def __init__(self, geom, group=1):
        if not winograd_applies(geom, group):
            raise ValueError("Winograd F(2x2, 3x3) needs a 3x3 kernel, stride 1, no dilation and "
                             "one group")
        self.geom = geom
        self._wbuf = WorkerBuffers()
        self._kept = {}      # key -> (input shape, the padded input buffer)
        self._shapes = {}

    def _shape(self, h, w):
        s = self._shapes.get((h, w))
        if s is None:
            s = self._shapes[(h, w)] = _Shape(self.geom, h, w)
        return s

    def _chunks(self, lo, hi, s, c, itemsize, xp):
        """(first sample, samples) pieces of lo..hi: V of a piece about CHUNK_BYTES, but at
        least MIN_TILES tiles (GEMM rows: OpenBLAS is slow on GEMMs with few rows)."""
        per_sample = 16 * s.th * s.tw * c * itemsize
        limit = self.CHUNK_BYTES if xp is numpy else self.GPU_CHUNK_BYTES
        m = max(1, limit // max(per_sample, 1), -(-self.MIN_TILES // (s.th * s.tw)))
        return [(a, min(m, hi - a)) for a in range(lo, hi, m)]

    # ----- the transforms ------------------------------------------------------------------------
    @staticmethod
    def kernel_transform(weight, xp):
        """U (16, C, O) = G g G^T of weight (O, C, 3, 3), position-major: one (16 x 9) x (9 x C*O)
        product (a batch of tiny 4x3 products would run one small loop per kernel, far from a
        GEMM's speed), cut into ranges of input channels on the cores (its relayout moves every
        number across the array, at cache-miss speed on one core)."""
        o, c = weight.shape[:2]
        g = _kernel_matrix(weight.dtype, xp).T
        w3 = weight.reshape(o, c, 9)
        u = xp.empty((16, c, o), weight.dtype)

        def part(worker, lo, hi):
            taps = xp.ascontiguousarray(w3[:, lo:hi].transpose(2, 1, 0)).reshape(9, -1)
            xp.matmul(g, taps, out=u[:, lo:hi].reshape(16, -1))

        parallel().run(part, c, xp, min_per_worker=16)
        return u

    @staticmethod
    def kernel_untransform(du, weight_shape, xp):
        """dW (O, C, 3, 3) = G^T dU G of dU (16, O, C), the transpose of kernel_transform, by
        ranges of output channels on the cores."""
        o, c = weight_shape[:2]
        g = _kernel_matrix(du.dtype, xp)
        dw = xp.empty((o, c, 3, 3), du.dtype)

        def part(worker, lo, hi):
            taps = xp.matmul(g, du[:, lo:hi].reshape(16, -1))                 # (9, range*C)
            dw[lo:hi] = taps.reshape(3, 3, hi - lo, c).transpose(2, 3, 0, 1)

        parallel().run(part, o, xp, min_per_worker=16)
        return dw

    @staticmethod
    def _input_transform(xq, s, s0, m, take):
        """V (4, 4, m, th, tw, C) = B^T d B of every tile of samples s0..s0+m."""
        xp = _xp(xq)
        th, tw = s.th, s.tw
        c = xq.shape[-1]
        rows = [xq[s0:s0 + m, i:i + 2 * th:2] for i in range(4)]    # (m, th, 2, wh, C) each
        r = take((4, m, th, 2, s.wh, c), xq.dtype)
        xp.subtract(rows[0], rows[2], out=r[0])
        xp.add(rows[1], rows[2], out=r[1])
        xp.subtract(rows[2], rows[1], out=r[2])
        xp.subtract(rows[1], rows[3], out=r[3])
        v = take((4, 4, m, th, tw, c), xq.dtype)
        for k in range(4):
            cols = [r[k][:, :, j % 2, j // 2:j // 2 + tw] for j in range(4)]
            xp.subtract(cols[0], cols[2], out=v[k, 0])
            xp.add(cols[1], cols[2], out=v[k, 1])
            xp.subtract(cols[2], cols[1], out=v[k, 2])
            xp.subtract(cols[1], cols[3], out=v[k, 3])
        return v

    @staticmethod
    def _input_untransform(dv, dxq, s, s0, m, take):
        """dxq[s0:s0+m] = the sum over tiles of B dV B^T at each tile's 4x4 cells (the transpose
        of _input_transform; dxq's rows and slots outside the tiles are left alone)."""
        xp = _xp(dv)
        th, tw = s.th, s.tw
        c = dv.shape[-1]
        dr = take((4, m, th, 2, s.wh, c), dv.dtype)
        for k in range(4):
            d = dv[k]                                                 # (4, m, th, tw, C)
            even, odd = dr[k][:, :, 0], dr[k][:, :, 1]                # (m, th, wh, C)
            # column j of a tile -> parity j % 2, slot tx + j // 2; tiles overlap by 2 columns
            even[:, :, :tw] = d[0]
            even[:, :, tw] = 0
            xp.subtract(even[:, :, 1:], d[0], out=even[:, :, 1:])     # j = 2: -d0 + d1 + d2
            even[:, :, 1:] += d[1]
            even[:, :, 1:] += d[2]
            xp.subtract(d[1], d[2], out=odd[:, :, :tw])               # j = 1: d1 - d2 + d3
            odd[:, :, :tw] += d[3]
            odd[:, :, tw] = 0
            odd[:, :, 1:] -= d[3]                                     # j = 3: -d3
        rows = dxq[s0:s0 + m, :2 * th + 2].reshape(m, th + 1, 2, 2, s.wh, c)
        top, bottom = rows[:, :, 0], rows[:, :, 1]                    # rows 2t and 2t + 1
        top[:, :th] = dr[0]
        top[:, th] = 0
        xp.subtract(top[:, 1:], dr[0], out=top[:, 1:])               # i = 2: -r0 + r1 + r2
        top[:, 1:] += dr[1]
        top[:, 1:] += dr[2]
        xp.subtract(dr[1], dr[2], out=bottom[:, :th])                 # i = 1: r1 - r2 + r3
        bottom[:, :th] += dr[3]
        bottom[:, th] = 0
        bottom[:, 1:] -= dr[3]                                        # i = 3: -r3

    @staticmethod
    def _output_transform(mm, s, m, take):
        """Y (m, 2th, 2tw, O) channels-last = A^T M A of M (16, tiles, O)."""
        xp = _xp(mm)
        th, tw = s.th, s.tw
        o = mm.shape[-1]
        t = m * th * tw
        mk = mm.reshape(4, 4, t, o)
        rows = take((2, 4, t, o), mm.dtype)                           # A^T over the first index
        _a_transposed(xp, mk, rows[0], rows[1])
        y = take((m, th, 2, tw, 2, o), mm.dtype)
        for a in range(2):                                            # then over the second
            r = rows[a].reshape(4, m, th, tw, o)
            _a_transposed(xp, r, y[:, :, a, :, 0], y[:, :, a, :, 1])
        return y.reshape(m, 2 * th, 2 * tw, o)

    @staticmethod
    def _output_untransform(dyc, s, m, take):
        """dM (16, tiles, O) = A dY A^T of the top gradient's tiles dyc (m, 2th, 2tw, O)."""
        xp = _xp(dyc)
        th, tw = s.th, s.tw
        o = dyc.shape[-1]
        t = m * th * tw
        dy6 = dyc.reshape(m, th, 2, tw, 2, o)
        half = take((2, 4, m, th, tw, o), dyc.dtype)                  # over the output column b
        for a in range(2):
            _a_applied(xp, dy6[:, :, a, :, 0], dy6[:, :, a, :, 1], half[a])
        dm = take((4, 4, t, o), dyc.dtype)                            # over the output row a
        _a_applied(xp, half[0].reshape(4, t, o), half[1].reshape(4, t, o), dm)
        return dm.reshape(16, t, o)

    # ----- forward / backward ------------------------------------------------------------------
    def _padded(self, shape, dtype, xp, name, key):
        """The parity-split zero-padded (N, Hq, 2, Wq/2, C) buffer `name` of `key`; its border
        is written once, when it is made, and stays zero (only the image cells are rewritten)."""
        n, c = shape[:2]
        s = self._shape(*shape[2:])
        return self._wbuf(-1).get(f"{name}{key}", (n, s.hq, 2, s.wh, c), dtype, xp, 0)

    def forward(self, x, weight, out, bias=None, key=0):
        """out (N, O, Ho, Wo) = convolution of x (N, C, H, W) with weight (+ bias); the padded
        input is kept under `key` for the weight gradient."""
        xp = _xp(x)
        n, c, h, w = x.shape
        o = weight.shape[0]
        s = self._shape(h, w)
        u = self.kernel_transform(weight, xp)
        xq = self._padded(x.shape, x.dtype, xp, "xq", key)
        self._kept[key] = (x.shape, xq)

        def work(worker, lo, hi):
            s.fill(x[lo:hi], xq[lo:hi])
            for s0, m in self._chunks(lo, hi, s, c, x.itemsize, xp):
                with scratch(xp).frame() as take:
                    v = self._input_transform(xq, s, s0, m, take)
                    t = m * s.th * s.tw
                    mm = take((16, t, o), x.dtype)
                    matmul(xp, v.reshape(16, t, c), u, out=mm)
                    y = self._output_transform(mm, s, m, take)[:, :s.out_h, :s.out_w]
                    dst = out[s0:s0 + m]
                    if bias is None:
                        dst[...] = y.transpose(0, 3, 1, 2)
                    else:
                        xp.add(y.transpose(0, 3, 1, 2), bias.reshape(1, o, 1, 1), out=dst)

        parallel().run(work, n, xp)
        return out

    def backward(self, dy, weight, weight_diff=None, bias_diff=None, dx=None, key=0):
        """Gradients for top gradient dy (N, O, Ho, Wo): weight_diff and bias_diff (when given)
        accumulate, dx (N, C, H, W, when given) is overwritten."""
        xp = _xp(dy)
        n, o = dy.shape[:2]
        shape, xq = self._kept.get(key, (None, None))
        if weight_diff is not None and (shape is None or shape[0] != n):
            raise RuntimeError("Winograd convolution: backward without a forward on this batch "
                               "(the weight gradient needs the input)")
        c = weight.shape[1]
        h, w = (dx.shape if dx is not None else shape)[2:]
        s = self._shape(h, w)
        u = self.kernel_transform(weight, xp) if dx is not None else None
        dxq = self._padded((n, c, h, w), dy.dtype, xp, "dxq", key) if dx is not None else None

        def work(worker, lo, hi):
            buf = self._wbuf(worker)
            if bias_diff is not None:
                bias_gradient_part(buf, dy, lo, hi)
            if weight_diff is None and dx is None:
                return
            if weight_diff is not None:
                du = buf.get("du", (16, o, c), dy.dtype, xp)
                du.fill(0)
            for s0, m in self._chunks(lo, hi, s, max(c, o), dy.itemsize, xp):
                t = m * s.th * s.tw
                # the top gradient's tiles, channels-last; the cells past Ho x Wo stay zero
                dyc = buf.get(f"dyc{m}", (m, 2 * s.th, 2 * s.tw, o), dy.dtype, xp, 0)
                dyc[:, :s.out_h, :s.out_w] = dy[s0:s0 + m].transpose(0, 2, 3, 1)
                with scratch(xp).frame() as take:
                    dm = self._output_untransform(dyc, s, m, take)
                    if weight_diff is not None:
                        v = self._input_transform(xq, s, s0, m, take)
                        part = take((16, o, c), dy.dtype)
                        matmul(xp, dm.transpose(0, 2, 1), v.reshape(16, t, c), out=part)
                        du += part
                    if dx is not None:
                        dv = take((4, 4, m, s.th, s.tw, c), dy.dtype)
                        matmul(xp, dm, u.transpose(0, 2, 1), out=dv.reshape(16, t, c))
                        self._input_untransform(dv, dxq, s, s0, m, take)
            if dx is not None:
                s.unfill(dxq[lo:hi], dx[lo:hi])

        parts = parallel().run(work, n, xp)
        du_total = None
        for worker in range(parts):   # in thread order: the sum does not depend on timing
            buf = self._wbuf(worker)
            if weight_diff is not None:
                part = buf.get("du", (16, o, c), dy.dtype, xp)
                du_total = part.copy() if du_total is None else du_total + part
            if bias_diff is not None:
                bias_diff += bias_gradient_of(buf, dy)
        if du_total is not None:
            weight_diff += self.kernel_untransform(du_total, weight.shape, xp)
        return dx
