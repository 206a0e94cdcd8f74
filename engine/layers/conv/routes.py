"""Which route a convolution layer takes: im2col (columns.py, with its planar and pointwise
layouts), the frequency domain (fourier.py) or Winograd's F(2x2, 3x3) (winograd.py), and the sizes
im2col cuts its work into.

The choice, per layer and input size, first match wins (`choose`):
1. Caffe's own engine (`engine: CAFFE`) and Deconvolution keep im2col (the layer says so);
2. a route pinned on the layer (Net.set_conv_routes: another rank's or a snapshot's choice);
3. POSEIDON_CONV naming a route: that route wherever it applies, im2col elsewhere;
4. POSEIDON_CONV=auto (the default): the route measured fastest for this layer shape on this
   machine (measure.py), once per process, kept across processes in a per-machine cache
   (route_cache.py); POSEIDON_CONV_REFRESH=1 measures again instead of reading it;
5. with measuring off (POSEIDON_CONV_MEASURE=0), the fallback order: rules fitted on one
   machine's timings (the FALLBACK_ constants below), which need no time at start-up but can be
   wrong elsewhere.
A route that does not apply to a shape is never a candidate; where only im2col applies (strides,
dilation) nothing is measured. The three POSEIDON_CONV* settings come from engine/settings.py
(the variables, or settings.configure from Python and the command line's flags).
"""
import logging
from collections import namedtuple

import numpy

from ... import settings
from ...parallel import CACHE_BLOCK_BYTES, parallel
from . import measure, route_cache
from .fourier import fourier_applies, fourier_flops
from .winograd import winograd_applies

log = logging.getLogger("poseidon")

ROUTES = settings.CONV_ROUTES
SETTINGS = settings.CONV_CHOICES


def conv_setting():
    """POSEIDON_CONV (engine/settings.py): 'auto' or one of ROUTES. A bad value raises a
    ValueError that names the accepted ones."""
    return settings.current().conv


def measuring_on():
    """POSEIDON_CONV_MEASURE (default 1): whether 'auto' may time the routes."""
    return settings.current().conv_measure


def refresh_asked():
    """POSEIDON_CONV_REFRESH=1 (or --refresh-routes): measure again rather than read the route
    cache."""
    return settings.current().conv_refresh


def applies(route, geom, group, h, w):
    """Whether `route` computes this convolution exactly (im2col always does)."""
    if route == "fourier":
        return fourier_applies(geom, group, h, w)
    if route == "winograd":
        return winograd_applies(geom, group)
    return route == "im2col"


def forced_route(route, geom, group, h, w):
    """A route asked for by name: taken where it applies, im2col elsewhere."""
    return route if applies(route, geom, group, h, w) else "im2col"


class LayerShape(namedtuple("LayerShape", "n c h w o geom group dtype device weight_grad "
                                          "input_grad")):
    """Everything a route's speed depends on: the input (n, c, h, w), the outputs o, kernel,
    stride, pad and dilation (geom), groups, dtype, the device (the CPU threads, or the GPU's
    name) and which gradients the net asks for. Equal shapes share one measurement."""

    def key(self):
        g = self.geom
        passes = "forward" + ("+weights" if self.weight_grad else "") + \
            ("+input" if self.input_grad else "")
        return (f"{self.n}x{self.c}x{self.h}x{self.w} -> {self.o} kernel {g.kh}x{g.kw} stride "
                f"{g.sh}x{g.sw} pad {g.ph}x{g.pw} dilation {g.dh}x{g.dw} group {self.group} "
                f"{self.dtype} {self.device} {passes}")

    def candidates(self):
        """The routes that compute this shape exactly, im2col first."""
        return [r for r in ROUTES if applies(r, self.geom, self.group, self.h, self.w)]


_DECIDED = {}   # shape key -> route: this process's measured (or cache-read) choices


def forget_decisions():
    """Forget this process's choices, so that the next layer of each shape consults the cache
    (or, with POSEIDON_CONV_REFRESH=1, measures) again."""
    _DECIDED.clear()


def choose(shape, xp, pinned=None, make_core=None, layer_name="?"):
    """The route for `shape` (see the module's docstring for the order), or None when it must be
    measured and `make_core` (route -> a fresh core) is None: the layer then asks again with one
    at its first forward, so that a route pinned in between is never measured. Raises ValueError
    for a bad POSEIDON_CONV* value."""
    g, group, h, w = shape.geom, shape.group, shape.h, shape.w
    if pinned is not None:
        return forced_route(pinned, g, group, h, w)
    setting = conv_setting()
    if setting != "auto":
        return forced_route(setting, g, group, h, w)
    candidates = shape.candidates()
    if len(candidates) == 1:
        return candidates[0]
    if not measuring_on():
        ranges = min(shape.n, parallel().workers)
        return fallback_route(g, group, shape.n, shape.c, shape.o, h, w, ranges, xp)
    key = shape.key()
    route = _DECIDED.get(key)
    if route is None:
        route = _measured_route(shape, key, candidates, xp, make_core, layer_name)
        if route is not None:
            _DECIDED[key] = route
    return route


def _measured_route(shape, key, candidates, xp, make_core, layer_name):
    """The cached route of this machine for `key`, else (with make_core) the fastest candidate
    timed now and written to the cache; None when it must be timed and make_core is None."""
    path, machine = route_cache.cache_path(), route_cache.machine_key()
    if not refresh_asked():
        cached = route_cache.read_routes(path, machine).get(key)
        if cached in candidates:
            return cached
    if make_core is None:
        return None
    seconds = measure.time_routes(shape, make_core, candidates, xp)
    route = min(candidates, key=lambda r: (seconds[r], candidates.index(r)))
    times = ", ".join(f"{r} {seconds[r] * 1e3:.2f} ms" for r in candidates)
    log.info(f"layer '{layer_name}': convolution route {route} for {key} ({times})")
    route_cache.write_route(path, machine, key, route, seconds)
    return route


# ----- how im2col cuts its work ------------------------------------------------------------------
# A chunk's columns stay under COLUMN_BLOCK_BYTES (L2-sized: engine/parallel.py says why), and,
# past that size, hold at least as many cells (GEMM rows) as the GEMM has output columns, up to
# MIN_CHUNK_CELLS: OpenBLAS packs the whole weight again for every call, which a few rows do not
# pay for, while a wide product makes up for columns spilling out of L2 (Im2colConvCore._chunks).
COLUMN_BLOCK_BYTES = CACHE_BLOCK_BYTES
MIN_CHUNK_CELLS = 512
# On CuPy (one range, one thread) chunks are only cut to bound the columns' memory.
GPU_BLOCK_BYTES = 1 << 28
# Forward and input gradient in Caffe's own column layout (planar.py) when a window row of the
# channels-last input is at most this many bytes: a net's first layer (3 channels).
PLANAR_MAX_RUN_BYTES = 132


# ----- the fallback order: rules fitted on one machine -------------------------------------------
# The frequency route on a CPU (docs/performance.md, "Convolutions"), a cost model in two terms:
# - the frequency route's products are smaller (K = C, or a plane side) and it adds transposing
#   copies, so each of its FLOPs costs more than one of im2col's wide GEMMs: it must need at most
#   FALLBACK_FOURIER_WORK_SHARE of im2col's FLOPs;
# - each channel product streams the whole weight spectrum (F x C x O complex, many times the
#   weight) once per thread range for only samples-per-thread rows, so with many channels and few
#   samples that read, not the arithmetic, sets the time: it is charged
#   FALLBACK_SPECTRUM_FLOPS_PER_BYTE FLOPs per byte.
# The two constants were fitted on one machine's timings (docs/performance.md, "Convolutions");
# they apply only with measuring off, where a wrong guess costs time, never results.
FALLBACK_FOURIER_WORK_SHARE = 0.65
FALLBACK_SPECTRUM_FLOPS_PER_BYTE = 18.0


def fourier_pays(geom, group, n, c, o, h, w, ranges=1):
    """The CPU fallback rule for the frequency route (see FALLBACK_FOURIER_WORK_SHARE): it
    applies, and its FLOPs plus its weight-spectrum traffic come to at most
    FALLBACK_FOURIER_WORK_SHARE of im2col's FLOPs."""
    if not fourier_applies(geom, group, h, w):
        return False
    direct, fourier, spectrum = fourier_flops(geom, n, c, o, h, w, ranges, group)
    return (fourier + FALLBACK_SPECTRUM_FLOPS_PER_BYTE * spectrum
            <= FALLBACK_FOURIER_WORK_SHARE * direct)


# On CuPy the costs differ in kind: cuBLAS's GEMMs are cheap, while im2col's columns (kh*kw times
# the input) go through the card's memory three times (written, read by the GEMMs, scattered back
# by col2im), and each kernel launch has a fixed cost whatever its size. So the frequency route
# pays on a GPU where the columns are large (FALLBACK_GPU_FOURIER_MIN_COLUMNS: below it the
# launches, not the columns' traffic, set the time, and the route only adds launches), the planes
# wide enough for its DFT products to fill the card (MIN_CELLS), and the input wide enough that
# its transforms are not most of its work (MIN_CHANNELS: a 3-channel first layer loses); a 1x1
# kernel has no columns to save. The thresholds sit between the layers on which the route won and
# lost on data-centre GPUs (docs/performance.md, "GPU").
FALLBACK_GPU_FOURIER_MIN_CELLS = 28 * 28
FALLBACK_GPU_FOURIER_MIN_CHANNELS = 32
FALLBACK_GPU_FOURIER_MIN_COLUMNS = 40_000_000
FALLBACK_GPU_FOURIER_MAX_FLOP_RATIO = 2.0


def fourier_pays_on_gpu(geom, group, n, c, o, h, w):
    """The CuPy fallback rule for the frequency route (see FALLBACK_GPU_FOURIER_MIN_CELLS): it
    applies, the kernel is wider than one cell, the plane has at least that many cells, the
    input at least FALLBACK_GPU_FOURIER_MIN_CHANNELS channels a group, im2col's columns would
    hold at least FALLBACK_GPU_FOURIER_MIN_COLUMNS numbers, and the route needs at most
    FALLBACK_GPU_FOURIER_MAX_FLOP_RATIO times im2col's FLOPs."""
    if not fourier_applies(geom, group, h, w) or geom.kh * geom.kw == 1:
        return False
    if h * w < FALLBACK_GPU_FOURIER_MIN_CELLS or c // group < FALLBACK_GPU_FOURIER_MIN_CHANNELS:
        return False
    out_h, out_w = geom.conv_out(h, w)
    if n * c * geom.kh * geom.kw * out_h * out_w < FALLBACK_GPU_FOURIER_MIN_COLUMNS:
        return False
    direct, fourier, _ = fourier_flops(geom, n, c, o, h, w, 1, group)
    return fourier <= FALLBACK_GPU_FOURIER_MAX_FLOP_RATIO * direct


# Winograd on a CPU (docs/performance.md, "Convolutions"). The transforms are element-wise passes
# over arrays 4x the input's and the output's size whatever the channel counts, while the GEMMs
# they save grow with C x O: so both sides need many channels (FALLBACK_WINOGRAD_MIN_CHANNELS).
# Small planes pay the per-sample cost of the transforms and waste more of each tile (a 7x7 plane
# computes 8x8), hence MIN_PLANE; and a thread's GEMMs need rows, hence MIN_TILES_PER_RANGE. On
# CuPy the fallback never takes it: the card's GEMMs are cheap, so the transforms' passes through
# memory cost more than the FLOPs they save.
FALLBACK_WINOGRAD_MIN_CHANNELS = 128
FALLBACK_WINOGRAD_MIN_PLANE = 14
FALLBACK_WINOGRAD_MIN_TILES_PER_RANGE = 256


def winograd_pays(geom, group, n, c, o, h, w, ranges=1):
    """The CPU fallback rule for Winograd: it applies, both sides have
    FALLBACK_WINOGRAD_MIN_CHANNELS channels, the output planes are at least
    FALLBACK_WINOGRAD_MIN_PLANE a side, and each of the `ranges` thread ranges has
    FALLBACK_WINOGRAD_MIN_TILES_PER_RANGE tiles."""
    if not winograd_applies(geom, group):
        return False
    out_h, out_w = geom.conv_out(h, w)
    samples = -(-n // max(1, ranges))
    tiles = samples * -(-out_h // 2) * -(-out_w // 2)
    return (min(c, o) >= FALLBACK_WINOGRAD_MIN_CHANNELS
            and min(out_h, out_w) >= FALLBACK_WINOGRAD_MIN_PLANE
            and tiles >= FALLBACK_WINOGRAD_MIN_TILES_PER_RANGE)


def fallback_route(geom, group, n, c, o, h, w, ranges, xp):
    """The fallback order, for when measuring is off (the fitted rules' choice): on a CPU the
    frequency route where fourier_pays (it was fitted against im2col on all shapes), then
    Winograd where winograd_pays, im2col elsewhere; on CuPy the frequency route where
    fourier_pays_on_gpu, im2col elsewhere."""
    if xp is not numpy:
        return "fourier" if fourier_pays_on_gpu(geom, group, n, c, o, h, w) else "im2col"
    if fourier_pays(geom, group, n, c, o, h, w, ranges):
        return "fourier"
    if winograd_pays(geom, group, n, c, o, h, w, ranges):
        return "winograd"
    return "im2col"
