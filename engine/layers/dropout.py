"""Dropout, Caffe's inverted form: in TRAIN y = x·mask/(1 − ratio) with mask ~ Bernoulli(1 − ratio) drawn
from engine.rng each forward; in TEST the identity. Runs in place; backward reuses the forward's mask.
"""
from .. import rng
from ..layer import TRAIN, Layer, register


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

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        xp = self.xp
        x, y = bottom[0].data, top[0].data
        if self.phase != TRAIN:
            if y is not x:
                y[...] = x
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
        self.xp.multiply(dy, self.mask, out=dx)
