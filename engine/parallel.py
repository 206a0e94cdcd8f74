"""The engine's CPU threads: `parallel()` runs a layer's work as one range per core, `split_rows`
/ `split_range` do it for the elementwise and per-channel layers, and each worker thread keeps
its own scratch (`WorkerBuffers`, `scratch`).

Why threads. numpy runs each op on one core, so a layer written as a few large numpy calls uses
one core however many the machine has. But BLAS and most numpy kernels (copies, ufuncs,
reductions) release the GIL while they run, so Python threads that each call them on their own
range of samples, rows or channels do run at once, with no process boundary and no copies: the
arrays stay shared and each thread writes only its own slice. Work that must be summed across
threads (a weight gradient) is left as one partial per thread and added in thread order, so the
result does not depend on timing.

Everything here works for numpy and CuPy alike; on CuPy the work runs as one range on the calling
thread (the device is already parallel).
"""
import os
import threading

import numpy

from . import settings
from .gemm import padded_row_length


# ----- batch blocks on several cores --------------------------------------------------------------
# numpy's elementwise work and copies run on one core, and OpenBLAS splits small GEMMs poorly (the
# weight gradient's long reduction gains nothing from a second thread). So the convolutions cut the
# batch into one contiguous range of samples per core, and each range into blocks small enough that
# a block's columns stay in that core's L2 cache; the ranges run on Python threads (numpy releases
# the GIL in copies, ufuncs and BLAS calls), and InnerProduct splits its GEMMs the same way. Each
# thread keeps its own scratch buffers and partial weight gradient; partials are added in thread
# order, so results do not depend on timing.
#
# While this runs, numpy's OpenBLAS is held to one thread for the whole process (threadpoolctl,
# from the first layer that uses it on): OpenBLAS's own helper threads busy-wait for a while
# after each multi-threaded call, and one left spinning takes a core from our threads.
# POSEIDON_THREADS=1 (or settings.configure(threads=1)) turns this off (one Python thread, BLAS
# threads untouched, batch-wide GEMMs); so does a missing threadpoolctl. The count is taken when
# the pool is made, at the first layer that runs. On CuPy everything runs as one range on the
# calling thread.
def l2_cache_bytes():
    """The per-core L2 cache size from sysfs (1 MiB when it cannot be read)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            text = f.read().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        return 1 << 20


def _cache_block_bytes():
    """Work block for one core: twice the per-core L2 cache (a convolution's chunk of columns,
    an InnerProduct weight's block of rows).

    A block is written by one pass (im2col, a GEMM into scratch) and read by the next (the GEMM,
    the update rule); sized near the L2, the second pass finds most of it still in the core's own
    cache, where a block of several MiB goes to L3 or memory between the two. Twice the L2 rather
    than once: the GEMM reads its block in panels, so the block need not fit whole, and larger
    blocks mean fewer, longer GEMMs; the bounds keep it sane where sysfs reports an odd size."""
    return max(1 << 19, min(2 * l2_cache_bytes(), 1 << 23))


CACHE_BLOCK_BYTES = _cache_block_bytes()

# A block of an InnerProduct weight's gradient (made and then updated, or copied into the diff,
# while in cache) is as large as a convolution's chunk of columns, for the same reason: the
# update reads the block right after the GEMM wrote it.
# At least MIN_BLOCK_ROWS rows, since OpenBLAS is slow on GEMMs with very few rows.
# And at least ROWS_PER_FACTOR_ROW rows for each of the K rows of factors it is made from: OpenBLAS
# packs the K x N factor again for every block, so with many factor rows (a caller that stacks the
# factors of several processes) small blocks would pay mostly for packing.
WEIGHT_BLOCK_BYTES = CACHE_BLOCK_BYTES
MIN_BLOCK_ROWS = 16
ROWS_PER_FACTOR_ROW = 2
# Weights of at least this many elements get their gradient blocks in padded rows
# (BufferCache.get_rows); a small weight's GEMM is short, so the rule's passes over a
# non-contiguous block cost more than the GEMM gains from the spread rows.
PADDED_ROWS_MIN = 1 << 20


def block_rows(rows, row_len, itemsize, factor_rows=0):
    """Rows of a weight made (and updated) together from `factor_rows` rows of factors: a block
    of about WEIGHT_BLOCK_BYTES, or more when there are many factor rows."""
    return min(rows, max(MIN_BLOCK_ROWS, ROWS_PER_FACTOR_ROW * factor_rows,
                         WEIGHT_BLOCK_BYTES // max(row_len * itemsize, 1)))


def _cores():
    """The threads to run: the threads setting (POSEIDON_THREADS, engine/settings.py), else the
    cores this process may use; at most 8."""
    n = settings.current().threads
    if n is None:
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:   # pragma: no cover - not Linux
            n = os.cpu_count() or 1
    return max(1, min(n, 8))


class _Parallel:
    """Runs fn(worker, lo, hi) over `workers` contiguous ranges of [0, n) at once."""

    def __init__(self):
        self.workers = _cores()
        self._pool = None
        self._limit = None
        if self.workers > 1:
            try:
                from threadpoolctl import ThreadpoolController
                self._limit = ThreadpoolController().select(user_api="blas").limit(limits=1)
            except Exception:   # no threadpoolctl: cannot hold BLAS to one thread; stay serial
                self.workers = 1

    def release(self):
        """Give numpy's BLAS its threads back and run serially from now on."""
        if self._limit is not None:
            self._limit.restore_original_limits()
            self._limit = None
        self.workers = 1

    @staticmethod
    def ranges(n, workers):
        step, extra = divmod(n, workers)
        out, lo = [], 0
        for w in range(workers):
            hi = lo + step + (1 if w < extra else 0)
            if hi > lo:
                out.append((lo, hi))
            lo = hi
        return out

    def run(self, fn, n, xp, min_per_worker=1):
        """fn(worker, lo, hi) for each range; returns the number of ranges (workers used)."""
        workers = self.workers if xp is numpy else 1
        workers = max(1, min(workers, n // max(min_per_worker, 1)))
        parts = self.ranges(n, workers)
        if len(parts) <= 1:
            fn(0, 0, n)
            return 1
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=self.workers - 1,
                                            thread_name_prefix="poseidon")
        futures = [self._pool.submit(fn, w, lo, hi) for w, (lo, hi) in enumerate(parts) if w > 0]
        try:
            fn(0, *parts[0])
        finally:
            for f in futures:
                f.result()
        return len(parts)


_PARALLEL = None

# Elementwise layers and per-channel reductions (ReLU, BatchNorm, Scale, Eltwise, Split, LRN) split
# arrays of at least this many elements into one range per core (numpy runs each of their ops
# on one core); below it the threads' start-up costs more than they save.
SPLIT_MIN_ELEMENTS = 1 << 16


def split_range(fn, n, size, xp, run=None):
    """fn(lo, hi) over one range of [0, n) per core when the work covers `size` >=
    SPLIT_MIN_ELEMENTS elements, else fn(0, n): for per-channel work, each channel's numbers
    computed exactly as in one call. `run` (numpy only): each range taken at most that many
    items a call, so that work making several passes keeps one run in cache between them."""
    if run is not None and xp is numpy and run < n:
        whole = fn

        def fn(lo, hi):
            for a in range(lo, hi, run):
                whole(a, min(a + run, hi))
    if size < SPLIT_MIN_ELEMENTS:
        fn(0, n)
        return
    parallel().run(lambda worker, lo, hi: fn(lo, hi), n, xp)


def split_rows(fn, arrays, xp, run=None):
    """fn(*slices) over one range of axis 0 per core for large arrays (all with the same first
    axis; split_range, `run` rows a call at most), else on the whole arrays."""
    a = arrays[0]
    if a.ndim == 0:
        fn(*arrays)
        return
    split_range(lambda lo, hi: fn(*(b[lo:hi] for b in arrays)), a.shape[0], a.size, xp, run)


def parallel():
    global _PARALLEL
    if _PARALLEL is None:
        _PARALLEL = _Parallel()
    return _PARALLEL


# ----- scratch kept per layer and per thread ----------------------------------------------------
class BufferCache:
    """Scratch arrays kept across iterations, reallocated only when their shape or type changes.

    `get(name, shape, dtype, xp, fill)` returns an array; `fill` (a number) is written only when the
    array is (re)allocated, which is how padded buffers keep their zero (or -FLT_MAX) border while
    only their interior is rewritten each iteration.
    """

    def __init__(self):
        self._arrays = {}

    def get(self, name, shape, dtype, xp, fill=None):
        shape = tuple(int(s) for s in shape)
        dtype = numpy.dtype(dtype)
        a = self._arrays.get(name)
        if a is None or a.shape != shape or a.dtype != dtype or \
                not isinstance(a, xp.ndarray):
            a = xp.empty(shape, dtype) if fill is None else xp.full(shape, fill, dtype)
            self._arrays[name] = a
        return a

    def get_rows(self, name, rows, row_len, dtype, xp, pad=True):
        """A (rows, row_len) scratch matrix for a GEMM to write: on the CPU (with `pad`) a view
        of a wider array whose rows lie an odd number of cache lines apart
        (engine.gemm.padded_row_length), so its rows are contiguous but the matrix is not."""
        if xp is not numpy or not pad:
            return self.get(name, (rows, row_len), dtype, xp)
        wide = padded_row_length(int(row_len), numpy.dtype(dtype).itemsize)
        return self.get(name, (rows, wide), dtype, xp)[:, :row_len]

    def clear(self):
        self._arrays.clear()


class WorkerBuffers:
    """One BufferCache per worker thread, made on first use: `bufs(worker)`, with the worker
    index that parallel().run passes, gives that thread's scratch and partials, which no other
    thread touches."""

    def __init__(self):
        self._caches = {}

    def __call__(self, worker):
        buf = self._caches.get(worker)
        if buf is None:
            buf = self._caches[worker] = BufferCache()
        return buf

    def values(self):
        return self._caches.values()

    def clear(self):
        self._caches.clear()


class ScratchArena:
    """Per-thread scratch memory that every layer shares: one flat buffer, handed out in frames.

    Transient buffers (alive only during one layer's pass) come from here instead of a per-layer
    BufferCache, so a deep net needs the largest layer's scratch, not the sum over its layers
    (the frequency-domain convolution's spectra are several times its weights). `frame()` is a
    context manager whose `take(shape, dtype)` carves uninitialised arrays one after another;
    frames nest (a thread's own work inside a pass that holds buffers), and leaving a frame gives
    its space back. When a frame needs more than the buffer holds, a larger one is made; arrays
    already handed out keep the old one alive until they go.
    """

    ALIGN = 64

    def __init__(self, xp):
        self.xp = xp
        self._flat = xp.empty(0, numpy.uint8)
        self._top = 0

    def frame(self):
        return _Frame(self)

    def _take(self, shape, dtype):
        dtype = numpy.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
        start = -(-self._top // self.ALIGN) * self.ALIGN
        end = start + nbytes
        if end > self._flat.size:
            self._flat = self.xp.empty(max(end, 2 * self._flat.size), numpy.uint8)
        self._top = end
        return self._flat[start:end].view(dtype).reshape(shape)


class _Frame:
    def __init__(self, arena):
        self.arena = arena

    def __enter__(self):
        self._saved = self.arena._top
        return self.arena._take

    def __exit__(self, *exc):
        self.arena._top = self._saved
        return False


_ARENAS = threading.local()


def scratch(xp):
    """This thread's ScratchArena for the array module xp."""
    arenas = getattr(_ARENAS, "by_module", None)
    if arenas is None:
        arenas = _ARENAS.by_module = {}
    arena = arenas.get(xp.__name__)
    if arena is None:
        arena = arenas[xp.__name__] = ScratchArena(xp)
    return arena
