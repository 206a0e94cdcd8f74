"""The layers' matrix products, through one function so that they can be metered.

`matmul(xp, a, b, out)` is `xp.matmul` unless the meter is on; then it also adds the product's
FLOPs and the seconds spent inside it to per-thread totals. The bench uses this to report how fast
the GEMMs themselves run (FLOPs / seconds inside the calls, per core) next to the share of the
machine's peak that whole layers reach (which also pays for im2col, transposes and bias), so a gap
between the two says where the time goes. Off, the meter costs one attribute test per call.

`padded_row_length` gives scratch for a GEMM's output rows a stride that keeps them out of each
other's cache sets (below).
"""
import threading
import time

import numpy

# A GEMM that writes its output rows a multiple of 4 KiB apart puts the rows of each of its
# micro-tiles into the same few cache sets, and they evict each other. InnerProduct weights often
# have such rows (4096 or 9216 floats: 16 and 36 KiB). Scratch whose rows lie an odd number of
# cache lines apart spreads them over all the sets, which matters most for the weight gradient
# Gᵀ·X made block by block inside the update (docs/performance.md, "InnerProduct and the GEMM
# share"; python -m poseidon.tools.bench.stride_ab compares the two strides on any machine).
CACHE_LINE = 64


class GemmMeter:
    """Per-thread FLOP and second totals of the metered matmuls (thread-safe, additive)."""

    def __init__(self):
        self.enabled = False
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        with self._lock:
            self.flops = 0.0
            self.seconds = 0.0
            self.calls = 0

    def add(self, flops, seconds):
        with self._lock:
            self.flops += flops
            self.seconds += seconds
            self.calls += 1

    def snapshot(self):
        with self._lock:
            return {"flops": self.flops, "seconds": self.seconds, "calls": self.calls}


METER = GemmMeter()


def product_flops(a_shape, b_shape, complex_values=False):
    """2*M*K*N times the broadcast batch of a matmul of arrays with these shapes (real FLOPs:
    four times that for complex operands, a complex multiply-add being four real ones)."""
    m, k = a_shape[-2], a_shape[-1]
    n = b_shape[-1]
    batch = numpy.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2]))
    scale = 8.0 if complex_values else 2.0
    return scale * m * k * n * float(numpy.prod(batch, dtype=numpy.float64))


def padded_row_length(row_len, itemsize):
    """The row length (in elements, >= row_len) of a scratch matrix whose rows lie an odd number
    of cache lines apart, so that a GEMM writing it spreads its rows over the cache sets (see
    CACHE_LINE). Row lengths that do not fill whole cache lines are left as they are."""
    row_bytes = row_len * itemsize
    if row_bytes % CACHE_LINE or CACHE_LINE % itemsize:
        return row_len
    lines = row_bytes // CACHE_LINE
    if lines % 2 == 0:
        lines += 1
    return lines * CACHE_LINE // itemsize


_made = [0]     # matmuls called so far: CUDA graphs (engine/graphs.py) run a call with one eagerly


def calls_made():
    """How many matmuls went through here (metered or not) since the process started."""
    return _made[0]


def matmul(xp, a, b, out=None):
    """xp.matmul(a, b, out=out), metered when METER.enabled (GPU calls are synchronised then)."""
    _made[0] += 1
    if not METER.enabled:
        return xp.matmul(a, b, out=out)
    sync = None if xp is numpy else xp.cuda.Stream.null.synchronize
    if sync:
        sync()
    t = time.perf_counter()
    result = xp.matmul(a, b, out=out)
    if sync:
        sync()
    METER.add(product_flops(a.shape, b.shape, a.dtype.kind == "c" or b.dtype.kind == "c"),
              time.perf_counter() - t)
    return result
