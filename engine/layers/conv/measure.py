"""Timing the convolution routes on the machine that runs them, for one layer shape.

Why measure rather than predict: which route is fastest depends on the BLAS, the cache sizes, the
core count and the card as much as on the shape, and the rules fitted on one machine (routes.py,
the fallback order) were off by tens of percent on another. So, as cuDNN's benchmark mode does,
each candidate route runs a few forward(+backward) passes of the layer's own shape on scratch data
and the fastest is kept. A pass is what the net will run: forward, plus the weight and bias
gradients and the input gradient where the net asks for them.

The scratch data come from a generator of their own, never from engine.rng: measuring must not
move the random stream a seeded run draws its weights and dropout masks from.
"""
import time

import numpy

from ...backend import synchronize

# Timed passes per route after one untimed pass (which makes the route's buffers and plans).
# The routes take turns, and each keeps its fastest pass: the least disturbed by whatever else
# the machine was doing.
REPEATS = 3


def scratch_arrays(shape, xp):
    """Input, weight, bias, output and gradients of the layer shape's convolution, in its dtype
    (random normal data: a route's speed does not depend on the values, but zeros could take
    shortcuts that real data never does)."""
    g = shape.geom
    out_h, out_w = g.conv_out(shape.h, shape.w)
    gen = numpy.random.default_rng(0)

    def normal(*dims):
        return xp.asarray(gen.standard_normal(dims).astype(shape.dtype))

    a = {"x": normal(shape.n, shape.c, shape.h, shape.w),
         "weight": normal(shape.o, shape.c // shape.group, g.kh, g.kw),
         "bias": normal(shape.o),
         "dy": normal(shape.n, shape.o, out_h, out_w)}
    a["y"] = xp.empty_like(a["dy"])
    a["dx"] = xp.empty_like(a["x"]) if shape.input_grad else None
    a["weight_diff"] = xp.zeros_like(a["weight"]) if shape.weight_grad else None
    a["bias_diff"] = xp.zeros_like(a["bias"]) if shape.weight_grad else None
    return a


def one_pass(core, a, backward):
    """One forward (and, when `backward`, the backward the net will ask for) on arrays `a`."""
    core.forward(a["x"], a["weight"], a["y"], a["bias"])
    if backward:
        core.backward(a["dy"], a["weight"], weight_diff=a["weight_diff"],
                      bias_diff=a["bias_diff"], dx=a["dx"])


def time_routes(shape, make_core, candidates, xp):
    """{route: seconds of its fastest pass} for each of `candidates`, each run by a fresh core
    from make_core(route) on the same scratch arrays."""
    a = scratch_arrays(shape, xp)
    backward = shape.weight_grad or shape.input_grad
    cores = {route: make_core(route) for route in candidates}
    for core in cores.values():
        one_pass(core, a, backward)
    best = {route: float("inf") for route in candidates}
    for _ in range(REPEATS):
        for route, core in cores.items():
            synchronize(xp)
            start = time.perf_counter()
            one_pass(core, a, backward)
            synchronize(xp)
            best[route] = min(best[route], time.perf_counter() - start)
    return best
