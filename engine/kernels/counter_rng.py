"""Dropout's counter-based generator in numpy, bit for bit the one in dropout.cu.

Element i of the draw for (seed, iteration) is kept when the top 24 bits of
mix64(key + (i + 1) * GAMMA), key = mix64(seed ^ mix64(iteration + GAMMA)), are at least
threshold = ceil(ratio * 2^24): a unit is dropped with probability ratio (to 2^-24), and the mask
depends on nothing but the three numbers, so a GPU and a CPU given the same seed drop the same
units, and a backward can recompute the forward's mask instead of keeping it.
"""
import math

import numpy

GAMMA = numpy.uint64(0x9E3779B97F4A7C15)     # 2^64 / the golden ratio, splitmix64's increment
_M1 = numpy.uint64(0xBF58476D1CE4E5B9)
_M2 = numpy.uint64(0x94D049BB133111EB)
BITS = 24                                    # the random bits compared with the threshold


def mix64(z):
    """splitmix64's finaliser on uint64 numbers (arrays or scalars; wraps modulo 2^64)."""
    with numpy.errstate(over="ignore"):
        z = numpy.asarray(z, numpy.uint64)
        z = (z ^ (z >> numpy.uint64(30))) * _M1
        z = (z ^ (z >> numpy.uint64(27))) * _M2
        return z ^ (z >> numpy.uint64(31))


def stream_key(seed, iteration):
    with numpy.errstate(over="ignore"):
        return mix64(numpy.uint64(seed) ^ mix64(numpy.uint64(iteration) + GAMMA))


def threshold(ratio):
    """The 24-bit threshold of a drop probability in [0, 1)."""
    return int(math.ceil(ratio * (1 << BITS)))


def keep_mask(count, seed, iteration, ratio):
    """Boolean (count,): which units the draw for (seed, iteration) keeps."""
    key = stream_key(seed, iteration)
    with numpy.errstate(over="ignore"):
        counter = numpy.arange(1, count + 1, dtype=numpy.uint64)
        counter *= GAMMA
        counter += key
    return (mix64(counter) >> numpy.uint64(64 - BITS)) >= numpy.uint64(threshold(ratio))
