"""The process's random stream (Caffe's global RNG): seeded by the solver's random_seed.

Fillers, Dropout and data augmentation all draw from here, and its state travels with snapshots, so
a resumed run draws exactly what an uninterrupted one would have.
"""
import numpy

_generator = numpy.random.default_rng()


def seed(value):
    """Reseed; a negative value (Caffe's default -1) means 'from the operating system'."""
    global _generator
    _generator = numpy.random.default_rng(None if value is None or value < 0 else int(value))


def generator():
    return _generator


def get_state():
    return _generator.bit_generator.state


def set_state(state):
    _generator.bit_generator.state = state


def uniform(shape, xp, dtype=numpy.float32):
    """Uniform [0, 1) numbers on the array module xp, drawn from the host stream for reproducibility."""
    values = _generator.random(shape, dtype=numpy.float64).astype(dtype, copy=False)
    return values if xp is numpy else xp.asarray(values)
