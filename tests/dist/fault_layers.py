"""Python layers for the distributed tests: two that misbehave on one rank (the straggler and NaN
tests) and one with a parameter whose arrays it keeps (CachedScale, the shared-memory tests).

Both pass their bottom through unchanged and count their own forward passes in the TRAIN phase
(one per iteration with iter_size 1, starting at 0). They find their worker's rank through
dist.session.current(), so every rank runs the same prototxt. param_str is JSON:
  SleepOnRank   {"rank": 2, "iters": [4], "seconds": 3.0}   sleep before the forward pass
  NaNOnRank     {"rank": 1, "iter": 7}                       NaN into the gradient below it
  SlowBackward  {"seconds": 0.03}                            sleep in every backward pass (the
                                                             syncs above it start first for sure)
  Stamp         (none)                                       notes when each forward ran (the
                                                             per-layer wait's timing probe)
"""
import json
import time

from poseidon import engine
from poseidon.engine.layer import TRAIN
from poseidon.dist.job.session import current


def _rank():
    session = current()
    return None if session is None else session.rank


class _PassThrough(engine.Layer):
    exact_bottoms = 1

    def setup(self, bottom, top):
        self.config = json.loads(self.param_str or "{}")
        self.calls = -1

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].shape)

    def forward(self, bottom, top):
        if self.phase == TRAIN:
            self.calls += 1
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff


class SleepOnRank(_PassThrough):
    def forward(self, bottom, top):
        super().forward(bottom, top)
        c = self.config
        if _rank() == c["rank"] and self.calls in c["iters"]:
            time.sleep(float(c["seconds"]))


class SlowBackward(_PassThrough):
    def backward(self, top, propagate_down, bottom):
        time.sleep(float(self.config["seconds"]))
        super().backward(top, propagate_down, bottom)


class Stamp(_PassThrough):
    """Keeps the time.time() of each TRAIN forward in `stamps` (one per iteration)."""

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.stamps = []

    def forward(self, bottom, top):
        super().forward(bottom, top)
        if self.phase == TRAIN:
            self.stamps.append(time.time())


class NaNOnRank(_PassThrough):
    def backward(self, top, propagate_down, bottom):
        super().backward(top, propagate_down, bottom)
        if propagate_down[0] and _rank() == self.config["rank"] and self.calls == self.config["iter"]:
            bottom[0].diff.reshape(-1)[0] = float("nan")


class CachedScale(engine.Layer):
    """y = x * s per feature, s a learnable blob whose arrays the layer keeps from setup on (as
    pycaffe code may): a worker must not move such a parameter's storage
    (dist/transport/onehost/kvshm.py placement), or the layer would go on reading arrays nobody
    updates."""
    exact_bottoms = 1

    def setup(self, bottom, top):
        self.blobs.add_blob(bottom[0].shape[1])
        self.blobs[0].data[...] = 1.0
        self.scale, self.scale_diff = self.blobs[0].data, self.blobs[0].diff

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data * self.scale

    def backward(self, top, propagate_down, bottom):
        self.scale_diff[...] += (top[0].diff * bottom[0].data).sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff * self.scale
