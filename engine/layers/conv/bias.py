"""A convolution's bias gradient, shared by every route: the top gradient summed over its cells and
samples, either at once or as one partial per worker thread added in thread order (so the sum
does not depend on timing)."""
from ...backend import get_array_module


def bias_gradient_sum(dy, lo=0, hi=None):
    """A convolution's bias gradient over samples lo..hi: the top gradient summed over its cells,
    then over the samples."""
    part = dy[lo:hi]
    return part.reshape(part.shape[0], dy.shape[1], -1).sum(axis=2).sum(axis=0)


def bias_gradient_part(buf, dy, lo, hi):
    """A thread's share of a convolution's bias gradient (bias_gradient_sum of samples lo..hi)
    into buf's "db" (bias_gradient_of then gives it back, to be added in thread order, so the
    sum does not depend on timing)."""
    bias_gradient_of(buf, dy)[...] = bias_gradient_sum(dy, lo, hi)


def bias_gradient_of(buf, dy):
    """The partial bias gradient that bias_gradient_part left in buf."""
    return buf.get("db", (dy.shape[1],), dy.dtype, get_array_module(dy))
