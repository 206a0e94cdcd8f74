"""GᵀX into a weight-shaped array against the same product into blocks whose rows are an odd
number of cache lines apart (engine/gemm.padded_row_length), on one thread.

    python -m poseidon.tools.bench.stride_ab [M] [N] [K]     (defaults: fc6 of fc_heavy, 4096 9216 32)

Prints GFLOP/s: straight into the array, in blocks of rows with the array's row stride, in blocks
with padded rows (the GEMM alone, and with each block copied into the array as the diff path does).
"""
import sys
import time

import numpy

from poseidon.engine.gemm import padded_row_length
from poseidon.engine.parallel import block_rows


def best_seconds(fn, repeats=7):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    m, n, k = (int(a) for a in (argv + ["4096", "9216", "32"][len(argv):])[:3])
    from threadpoolctl import threadpool_limits
    with threadpool_limits(1):
        _run(m, n, k)


def _run(m, n, k):
    rs = numpy.random.default_rng(0)
    g = rs.standard_normal((k, m), dtype=numpy.float32)
    x = rs.standard_normal((k, n), dtype=numpy.float32)
    diff = numpy.empty((m, n), numpy.float32)
    rows = block_rows(m, n, 4)
    flops = 2.0 * m * n * k

    def blocks(width, copy):
        scratch = numpy.empty((rows, width), numpy.float32)[:, :n]

        def run():
            for a in range(0, m, rows):
                b = min(a + rows, m)
                numpy.matmul(g[:, a:b].T, x, out=scratch[:b - a])
                if copy:
                    numpy.copyto(diff[a:b], scratch[:b - a])
        return run

    padded = padded_row_length(n, 4)
    cases = {"into the (M, N) array": lambda: numpy.matmul(g.T, x, out=diff),
             f"{rows}-row blocks, rows {4 * n} bytes apart": blocks(n, False),
             f"{rows}-row blocks, rows {4 * padded} bytes apart": blocks(padded, False),
             "  the same, each block copied into the array": blocks(padded, True)}
    print(f"GᵀX, M={m} N={n} K={k}, float32, one thread")
    for label, fn in cases.items():
        print(f"  {label:48s} {flops / best_seconds(fn) / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
