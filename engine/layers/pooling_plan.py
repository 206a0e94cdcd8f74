"""What a pooling layer works out once per input shape (`PoolingPlan`): the windows' slices and
padding for the direct strided form, AVE's divisors, and the stride-phase grid that the passes
run on (pooling.py's docstring describes it), cut into runs of samples that stay in cache."""
import numpy

from .im2col import offset_slices

# The grid passes run over runs of samples whose grid takes about this many bytes, so that the
# half-dozen arrays a pass touches (phases, maxima, gradients, masks) stay in cache across the
# kernel offsets instead of streaming from memory at each: a quarter to half of a typical L2, so
# those arrays fit beside each other. Much smaller runs (a single small sample) pay more in the
# per-call cost of the numpy calls, a handful per offset, than they save in cache misses.
CHUNK_BYTES = 256 << 10


def _phase_span(a, s, pad, size, q):
    """Phase a of stride s along one axis: (first grid index, first image index, -, count) of the
    image cells it holds within a grid of q cells (padded coordinate a + s*k <-> image a + s*k -
    pad), or None when it holds none."""
    k0 = max(0, -((a - pad) // s)) if a < pad else 0
    first = a + s * k0 - pad
    if first >= size or k0 >= q:
        return None
    count = min(q - k0, (size - 1 - first) // s + 1)
    return (k0, first, None, count)


class PoolingPlan:
    """Everything that depends only on the input shape: window slices, padding, AVE divisors."""

    def __init__(self, h, w, out_h, out_w, geom, dtype, xp):
        g = self.geom = geom
        self.h, self.w = h, w
        self.out_h, self.out_w = out_h, out_w
        self.global_reduce = (g.ph == 0 and g.pw == 0 and out_h == 1 and out_w == 1
                              and g.kh >= h and g.kw >= w)
        self.overlap = g.sh < g.kh or g.sw < g.kw
        # rows/columns the windows span, in padded coordinates (row 0 = first padding row)
        self.ext_h = (out_h - 1) * g.sh + g.kh
        self.ext_w = (out_w - 1) * g.sw + g.kw
        self.padded = bool(g.ph or g.pw or self.ext_h > h or self.ext_w > w)
        # the part of the image that the windows reach
        self.used_h = min(h, self.ext_h - g.ph)
        self.used_w = min(w, self.ext_w - g.pw)
        # does every input pixel lie in some window?
        self.covers_all = (g.sh <= g.kh and g.sw <= g.kw and self.used_h == h and self.used_w == w)
        self.slices = [offset_slices(i, j, out_h, out_w, g) for i in range(g.kh)
                       for j in range(g.kw)]
        self.inv_divisor = _ave_inv_divisor(h, w, out_h, out_w, g, dtype, xp)
        self._index_planes = None
        # ----- the stride-phase grid (pooling.py's docstring) -----
        sh, sw = g.sh, g.sw
        self.qh = out_h + (g.kh - 1) // sh
        self.qw = out_w + (g.kw - 1) // sw
        # per kernel offset, row-major: (phase index, flat shift inside the phase)
        self.offsets = [((i % sh) * sw + (j % sw), (i // sh) * self.qw + j // sw)
                        for i in range(g.kh) for j in range(g.kw)]
        self.margin = max(off for _, off in self.offsets)
        # offsets that never share a phase (kernel <= stride): backward writes instead of adding
        self.disjoint = g.kh <= sh and g.kw <= sw
        self.regions, self.grid_covers_all = _phase_regions(g, h, w, self.qh, self.qw)

    # ----- the stride-phase grid ------------------------------------------------------------------
    def grid_size(self, n, c):
        return n * c * self.qh * self.qw

    def phases(self, n, c, buffers, fill, dtype, xp):
        """The cached (sh*sw, N*C*Qh*Qw + margin) buffer of the stride phases of n samples,
        whose padding cells keep `fill` (written once, when the buffer is made)."""
        return buffers.get(f"phases{fill}", (len(self.regions), self.grid_size(n, c) + self.margin),
                           dtype, xp, fill)

    def chunks(self, n, c, itemsize, xp):
        """(first sample, end sample, first grid cell, end grid cell) of the runs of samples that
        a pass takes at once: on the CPU a run's grid arrays fit the L2 cache together (see
        CHUNK_BYTES); on a GPU, all n."""
        per = self.grid_size(1, c)
        step = n if xp is not numpy else max(1, min(n, CHUNK_BYTES // (per * itemsize)))
        return [(s0, min(n, s0 + step), s0 * per, min(n, s0 + step) * per)
                for s0 in range(0, n, step)]

    def split(self, x, buf, start):
        """Write x's samples into the phase buffer from sample `start` on."""
        k, c = x.shape[:2]
        lo = self.grid_size(start, c)
        for p, region in enumerate(self.regions):
            if region is None:
                continue
            (gr, gc), (ir, ic) = region
            buf[p, lo:lo + self.grid_size(k, c)].reshape(k, c, self.qh, self.qw)[:, :, gr, gc] = \
                x[:, :, ir, ic]

    def scatter_back(self, dphases, dx, start=0):
        """dx (k, C, H, W) = the phase gradients of samples start..start+k written back at their
        image cells."""
        k, c = dx.shape[:2]
        lo = self.grid_size(start, c)
        if not self.grid_covers_all:
            dx.fill(0)
        for p, region in enumerate(self.regions):
            if region is None:
                continue
            (gr, gc), (ir, ic) = region
            dx[:, :, ir, ic] = dphases[p, lo:lo + self.grid_size(k, c)].reshape(
                k, c, self.qh, self.qw)[:, :, gr, gc]

    def valid(self, grid, n, c):
        """The (N, C, out_h, out_w) cells of a flat (N*C*Qh*Qw) grid array (a view)."""
        return grid.reshape(n, c, self.qh, self.qw)[:, :, :self.out_h, :self.out_w]

    def index_planes(self, dtype, xp):
        """For the argmax top: per offset, the flat input index h*W + w of each output cell."""
        if self._index_planes is None:
            g = self.geom
            planes = []
            for i in range(g.kh):
                for j in range(g.kw):
                    rows = numpy.arange(self.out_h) * g.sh - g.ph + i
                    cols = numpy.arange(self.out_w) * g.sw - g.pw + j
                    plane = rows[:, None] * self.w + cols[None, :]
                    planes.append(xp.asarray(plane.astype(dtype)))
            self._index_planes = planes
        return self._index_planes

    def source(self, x, buffers, fill, xp, copy=True):
        """x as the windows see it: the padded copy (a cached buffer, refreshed unless copy is
        False, as in backward, which reuses forward's copy) or x itself."""
        if not self.padded:
            return x
        g = self.geom
        n, c = x.shape[:2]
        buf = buffers.get("xpad", (n, c, self.ext_h, self.ext_w), x.dtype, xp, fill)
        if copy:
            buf[:, :, g.ph:g.ph + self.used_h, g.pw:g.pw + self.used_w] = \
                x[:, :, :self.used_h, :self.used_w]
        return buf

    def grad_target(self, dx, buffers, xp):
        """Where backward accumulates: a zeroed padded buffer, or dx itself (zeroed if needed)."""
        if self.padded:
            n, c = dx.shape[:2]
            buf = buffers.get("dxpad", (n, c, self.ext_h, self.ext_w), dx.dtype, xp)
            buf.fill(0)
            return buf
        if self.overlap or not self.covers_all:
            dx.fill(0)
        return dx

    def grad_finish(self, target, dx):
        if self.padded:
            g = self.geom
            if self.used_h < self.h or self.used_w < self.w:
                dx.fill(0)
            dx[:, :, :self.used_h, :self.used_w] = \
                target[:, :, g.ph:g.ph + self.used_h, g.pw:g.pw + self.used_w]


def _ave_inv_divisor(h, w, out_h, out_w, g, dtype, xp):
    """AVE's 1 / divisor per output cell, the divisor counting the window clipped to
    [start, in + pad) before clipping to the image (0 for a window without pixels); one float
    when every cell has the same, which is cheaper to apply."""
    hs = numpy.arange(out_h) * g.sh - g.ph
    ws = numpy.arange(out_w) * g.sw - g.pw
    pool_h = numpy.minimum(hs + g.kh, h + g.ph) - hs
    pool_w = numpy.minimum(ws + g.kw, w + g.pw) - ws
    real_h = numpy.minimum(hs + g.kh, h) - numpy.maximum(hs, 0)
    real_w = numpy.minimum(ws + g.kw, w) - numpy.maximum(ws, 0)
    divisor = numpy.outer(pool_h, pool_w).astype(numpy.float64)
    has_pixel = numpy.outer(real_h > 0, real_w > 0)
    inv = numpy.where(has_pixel & (divisor > 0), 1.0 / numpy.where(divisor > 0, divisor, 1), 0)
    if numpy.all(inv == inv.flat[0]):
        return float(inv.flat[0])
    return xp.asarray(inv.astype(dtype))


def _phase_regions(g, h, w, qh, qw):
    """Per stride phase (a, b), row-major: the part of the image it holds, as ((grid rows, grid
    cols), (image rows, image cols)) slices, or None when it holds no pixel; and whether every
    image pixel sits in some phase's grid (else backward zeroes dx first)."""
    sh, sw = g.sh, g.sw
    row_parts = [_phase_span(a, sh, g.ph, h, qh) for a in range(sh)]
    col_parts = [_phase_span(b, sw, g.pw, w, qw) for b in range(sw)]
    rows_covered = sum(p[3] for p in row_parts if p)
    cols_covered = sum(p[3] for p in col_parts if p)
    regions = []
    for a in range(sh):
        for b in range(sw):
            r, c = row_parts[a], col_parts[b]
            if r is None or c is None:
                regions.append(None)
                continue
            regions.append(((slice(r[0], r[0] + r[3]), slice(c[0], c[0] + c[3])),
                            (slice(r[1], r[1] + (r[3] - 1) * sh + 1, sh),
                             slice(c[1], c[1] + (c[3] - 1) * sw + 1, sw))))
    return regions, rows_covered == h and cols_covered == w
