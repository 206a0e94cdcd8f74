"""Dropout, Caffe's inverted form: in TRAIN y = x·mask/(1 − ratio) with mask ~ Bernoulli(1 − ratio) drawn
from engine.rng each forward; in TEST the identity. Runs in place; backward reuses the forward's mask.

On CuPy the mask comes from the counter-based generator of engine/kernels/dropout.cu: each forward
draws a seed from engine.rng (so snapshots still replay it) and one launch draws and applies the
mask; backward recomputes it from the same (seed, iteration) instead of keeping it. The pair lives
in a small device buffer the kernels read, written by the forward, so that a backward captured in
a CUDA graph (engine/graphs.py) reads each step's draw rather than the one it was captured with. The CPU keeps
its own draw: the same generator in numpy (engine/kernels/counter_rng.py) is a dozen passes over
64-bit integers, several times the cost of numpy's own uniform numbers, so a CPU and a GPU run of
one seed drop different units (with the same probability).
"""
import numpy

from .. import kernels, rng
from ..kernels import counter_rng
from ..layer import TRAIN, Layer
from ..registry import register

SEED_LIMIT = 1 << 63


@register("Dropout")
class DropoutLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1
    #: its forward draws from the process's random stream: replicas of the net run it one after
    #: the other, in replica order, so the draws do not depend on thread timing (engine/replicas.py)
    draws_random = True

    def layer_setup(self, bottom, top):
        ratio = float(self.param.dropout_param.dropout_ratio)
        if not 0.0 <= ratio < 1.0:
            raise self.error(f"dropout_ratio {ratio} is outside [0, 1): give the probability of "
                             f"dropping a unit, e.g. 0.5")
        self.ratio = ratio
        self.scale = 1.0 / (1.0 - ratio)
        self.mask = None   # the scaled mask of the last TRAIN forward: 0 or 1/(1 − ratio) per element
        self.draws = 0     # TRAIN forwards so far: the iteration of the counter-based draw
        self.draw = None   # (seed, iteration) of the last counter-based draw, for backward
        self._draw_buf = None   # the same pair in the arrays' memory, which the kernels read

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        xp = self.xp
        x, y = bottom[0].data, top[0].data
        if self.phase != TRAIN:
            if y is not x:
                y[...] = x
            return
        run = kernels.runner_for(x)
        if run is not None:
            self.draw = (int(rng.generator().integers(SEED_LIMIT)), self.draws)
            self.draws += 1
            kernels.calls.dropout(run, x, y, self._store_draw(xp),
                                  counter_rng.threshold(self.ratio), self.scale)
            return
        u = rng.uniform(x.shape, xp, self.dtype)               # U[0, 1)
        xp.greater_equal(u, self.dtype.type(self.ratio), out=u)  # 1 with probability 1 − ratio
        u *= self.dtype.type(self.scale)
        self.mask = u
        xp.multiply(x, u, out=y)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff, bottom[0].diff
        if self.phase != TRAIN:
            if dx is not dy:
                dx[...] = dy
            return
        run = kernels.runner_for(dy)
        if run is not None:
            kernels.calls.dropout(run, dy, dx, self._draw_buf, counter_rng.threshold(self.ratio),
                                  self.scale, backward=True)
            return
        self.xp.multiply(dy, self.mask, out=dx)

    def _store_draw(self, xp):
        """The device buffer of the draw, holding self.draw (one small host-to-device copy)."""
        if self._draw_buf is None:
            self._draw_buf = xp.zeros(2, numpy.uint64)
        host = numpy.array(self.draw, numpy.uint64)
        if hasattr(self._draw_buf, "set"):        # CuPy: an asynchronous copy on the stream
            self._draw_buf.set(host)
        else:
            self._draw_buf[...] = host
        return self._draw_buf
