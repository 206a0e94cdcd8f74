"""Element-wise activations: ReLU (leaky), Sigmoid, TanH and PReLU.

All run in place (top[0] is bottom[0], as Caffe files write them): then backward finds the *output* in
bottom.data, so ReLU, Sigmoid and TanH take their derivatives from the output, and PReLU keeps a copy
of its input as Caffe does.
"""
import numpy

from ..layer import Layer
from ..registry import register
from ..parallel import split_rows

# numpy's maximum against a scalar takes a loop without SIMD on some builds, where maximum of two
# arrays always has a vectorised one. So on the CPU the input is taken as rows of ZERO_ROW_LENGTH
# numbers against one row of zeros, broadcast. The row is long: rows a small power-of-two
# multiple of 4 KiB apart (2,048-4,096 floats) share cache sets with the row of zeros and lose
# what the vector loop gains.
ZERO_ROW_LENGTH = 16384
_ZERO_ROWS = {}


def _zero_row(dtype):
    row = _ZERO_ROWS.get(dtype)
    if row is None:
        row = numpy.zeros(ZERO_ROW_LENGTH, dtype)
        row.flags.writeable = False
        _ZERO_ROWS[dtype] = row
    return row


def relu_into(x, y, xp):
    """y = max(x, 0) elementwise, for contiguous arrays of one shape (y may be x)."""
    if xp is not numpy or x.size < ZERO_ROW_LENGTH:
        xp.maximum(x, 0, out=y)
        return
    a, b = x.reshape(-1), y.reshape(-1)
    bulk = a.size - a.size % ZERO_ROW_LENGTH
    zeros = _zero_row(a.dtype)
    xp.maximum(a[:bulk].reshape(-1, ZERO_ROW_LENGTH), zeros,
               out=b[:bulk].reshape(-1, ZERO_ROW_LENGTH))
    if bulk < a.size:
        xp.maximum(a[bulk:], zeros[:a.size - bulk], out=b[bulk:])


class ElementwiseLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)


def relu_forward(x, y, slope, xp, keep_mask=False):
    """y = x for x > 0, slope·x otherwise (y may be x). Returns the mask x > 0 when keep_mask
    (an in-place ReLU with a negative slope: its output's sign no longer tells the input's)."""
    positive = x > 0 if keep_mask else None
    if slope == 0.0:
        split_rows(lambda a, b: relu_into(a, b, xp), (x, y), xp)
    elif 0.0 < slope <= 1.0:
        xp.maximum(x, x * x.dtype.type(slope), out=y)   # max(x, s·x) is leaky ReLU for 0 < s <= 1
    else:
        negative_part = xp.minimum(x, 0)                # Caffe: max(x, 0) + s·min(x, 0)
        negative_part *= x.dtype.type(slope)
        xp.maximum(x, 0, out=y)
        y += negative_part
    return positive


def relu_backward(dy, y, dx, slope, xp, positive=None):
    """dx = dy·((x > 0) + slope·(x <= 0)), with x > 0 read from the output y (true for any
    slope >= 0) unless `positive` (relu_forward's kept mask) is given. dx may be dy."""
    if slope == 0.0 and positive is None:
        # in place, y is the output, which is > 0 exactly where the input was
        split_rows(lambda d, a, out: xp.multiply(d, a > 0, out=out), (dy, y, dx), xp)
        return
    positive = y > 0 if positive is None else positive
    # arithmetic on masks, not `where` (slow on random signs)
    factor = xp.multiply(~positive, dy.dtype.type(slope), dtype=dy.dtype)
    factor += positive
    xp.multiply(dy, factor, out=dx)


@register("ReLU")
class ReLULayer(ElementwiseLayer):
    """y = x for x > 0, negative_slope·x otherwise; dy/dx = 1 for x > 0, negative_slope otherwise.

    An in-place ReLU right after a Convolution or InnerProduct is run by that layer (the Net hands
    it over: engine/layers/fusion.py): `absorbed` is then True and this layer does nothing."""

    absorbed = False

    def layer_setup(self, bottom, top):
        self.slope = float(self.param.relu_param.negative_slope)
        self._positive = None   # input > 0, kept only when run in place with a negative slope

    def forward(self, bottom, top):
        if self.absorbed:
            return
        keep = self.slope < 0.0 and top[0] is bottom[0]
        self._positive = relu_forward(bottom[0].data, top[0].data, self.slope, self.xp, keep)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0] or self.absorbed:
            return
        positive = self._positive if (self.slope < 0.0 and top[0] is bottom[0]) else None
        relu_backward(top[0].diff, bottom[0].data, bottom[0].diff, self.slope, self.xp,
                      positive)


@register("Sigmoid")
class SigmoidLayer(ElementwiseLayer):
    """y = 1 / (1 + exp(−x)), computed as 0.5·tanh(0.5·x) + 0.5 (no overflow); dy/dx = y·(1 − y)."""

    def forward(self, bottom, top):
        xp = self.xp
        y = top[0].data
        xp.multiply(bottom[0].data, 0.5, out=y)
        xp.tanh(y, out=y)
        y *= 0.5
        y += 0.5

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data
        d = 1 - y            # scratch
        d *= y
        self.xp.multiply(top[0].diff, d, out=bottom[0].diff)


@register("TanH")
class TanHLayer(ElementwiseLayer):
    """y = tanh(x); dy/dx = 1 − y²."""

    def forward(self, bottom, top):
        self.xp.tanh(bottom[0].data, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data
        d = y * y            # scratch
        xp = self.xp
        xp.subtract(1, d, out=d)
        xp.multiply(top[0].diff, d, out=bottom[0].diff)


@register("PReLU")
class PReLULayer(ElementwiseLayer):
    """y = x for x > 0, a_c·x otherwise, with a learned slope a per channel (axis 1), or one shared.

    blobs[0] is (C,), or a 0-axis scalar with channel_shared (Caffe's shapes); default filler constant
    0.25.
    """

    def layer_setup(self, bottom, top):
        p = self.param.prelu_param
        b = bottom[0]
        if b.ndim < 2:
            raise self.error(f"needs a bottom of at least 2 axes (N, C, ...), got shape "
                             f"{tuple(b.shape)}")
        self.channel_shared = bool(p.channel_shared)
        self.channels = b.shape[1]
        shape = () if self.channel_shared else (self.channels,)
        if p.HasField("filler"):
            self.add_param(shape, p.filler)
        else:
            self.add_param(shape, fill_value=0.25)
        self._input = None   # copy of the input when run in place

    def reshape(self, bottom, top):
        b = bottom[0]
        if b.ndim < 2 or b.shape[1] != self.channels:
            raise self.error(f"bottom shape {tuple(b.shape)} does not match the {self.channels} "
                             f"channels (axis 1) the slopes were set up for")
        top[0].reshape(b.shape)
        if top[0] is b and (self._input is None or self._input.shape != b.shape):
            self._input = self.xp.empty(b.shape, self.dtype)

    def _slope(self, ndim):
        a = self.blobs[0].data
        return a if self.channel_shared else a.reshape((1, -1) + (1,) * (ndim - 2))   # 1×C×1×…

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data
        if top[0] is bottom[0]:
            self._input[...] = x
            x = self._input
        negative_part = xp.minimum(x, 0)                        # Caffe: max(x, 0) + a·min(x, 0)
        negative_part *= self._slope(x.ndim)
        y = top[0].data
        xp.maximum(x, 0, out=y)
        y += negative_part

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        x = self._input if top[0] is bottom[0] else bottom[0].data
        dy = top[0].diff
        if self.param_propagate_down[0]:
            # d/da_c = Σ over every axis but the channel of dy·x where x <= 0 (before dx overwrites dy)
            t = xp.minimum(x, 0)
            t *= dy
            if self.channel_shared:
                self.blobs[0].diff += t.sum()
            else:
                self.blobs[0].diff += t.sum(axis=tuple(i for i in range(x.ndim) if i != 1))
        if propagate_down[0]:
            # dy·((x > 0) + a·(x <= 0)); arithmetic on masks, not `where` (slow on random signs)
            positive = x > 0
            factor = xp.multiply(~positive, self._slope(x.ndim), dtype=self.dtype)
            factor += positive
            xp.multiply(dy, factor, out=bottom[0].diff)
