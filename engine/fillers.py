"""Parameter initialisers named by FillerParameter.type, with Caffe's fan-in/fan-out conventions.

Values are drawn on the host from the process stream (engine.rng) and then moved, so a CPU and a GPU
run of the same seed start from the same weights.
"""
import numpy

from . import rng
from .errors import ModelError


def _fans(shape):
    # Caffe: fan_in = count / shape[0], fan_out = count / shape[1].
    count = int(numpy.prod(shape)) if shape else 1
    fan_in = count // shape[0] if len(shape) >= 1 and shape[0] else count
    fan_out = count // shape[1] if len(shape) >= 2 and shape[1] else count
    return fan_in, fan_out


def _norm(filler, shape):
    fan_in, fan_out = _fans(shape)
    mode = filler.variance_norm  # FAN_IN=0, FAN_OUT=1, AVERAGE=2
    if mode == 1:
        return fan_out
    if mode == 2:
        return (fan_in + fan_out) / 2.0
    return fan_in


def _values(filler, shape):
    g = rng.generator()
    kind = filler.type or "constant"
    if kind == "constant":
        return numpy.full(shape, filler.value)
    if kind == "uniform":
        return g.uniform(filler.min, filler.max, shape)
    if kind == "gaussian":
        values = g.normal(filler.mean, filler.std, shape)
        if filler.sparse >= 0:
            # Caffe keeps each weight with probability sparse / num_outputs.
            keep = filler.sparse / float(shape[0])
            values *= g.random(shape) < keep
        return values
    if kind == "positive_unitball":
        values = g.random(shape)
        flat = values.reshape(shape[0], -1) if shape else values.reshape(1, -1)
        flat /= flat.sum(axis=1, keepdims=True)
        return values
    if kind == "xavier":
        scale = numpy.sqrt(3.0 / _norm(filler, shape))
        return g.uniform(-scale, scale, shape)
    if kind == "msra":
        return g.normal(0.0, numpy.sqrt(2.0 / _norm(filler, shape)), shape)
    if kind == "bilinear":
        if len(shape) != 4 or shape[2] != shape[3]:
            raise ModelError("bilinear filler needs a 4-axis weight with square kernels")
        k = shape[3]
        f = numpy.ceil(k / 2.0)
        c = (2 * f - 1 - f % 2) / (2.0 * f)
        x = numpy.arange(k)
        line = 1 - numpy.abs(x / f - c)
        return numpy.broadcast_to(numpy.outer(line, line), shape).copy()
    raise ModelError(f"unknown filler type '{kind}' (known: constant, uniform, gaussian, "
                     f"positive_unitball, xavier, msra, bilinear)")


def fill(filler, shape, xp=numpy, dtype=numpy.float32):
    """An array of `shape` filled as the FillerParameter says, on module xp."""
    values = numpy.asarray(_values(filler, tuple(shape)), dtype=dtype)
    return values if xp is numpy else xp.asarray(values)
