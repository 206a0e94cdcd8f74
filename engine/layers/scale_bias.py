"""Scale and Bias (Caffe's scale_layer.cpp, bias_layer.cpp): y = x * scale (+ bias), the second
operand spanning bottom[0]'s axes axis .. axis+num_axes-1 (num_axes -1: to the end, 0: a scalar)
and broadcast over the others; it is a learned blob (one bottom) or bottom[1] (two bottoms, whose
shape defines the axes). The work is cut into ranges of the operand's axis on the cores."""
import numpy

from ..layer import Layer
from ..parallel import split_range
from ..registry import register
from .normalization import dot_per_dim, reuse_buffer, sum_per_dim


def _operand_axis(layer, bottom0, operand_ndim, axis_param):
    """Caffe: the operand starts at `axis`, or at 0 when it is a scalar (the axis is then moot)."""
    try:
        axis = 0 if operand_ndim == 0 else bottom0.canonical_axis(axis_param)
    except ValueError as e:
        raise layer.error(str(e)) from None
    return axis


def _check_operand(layer, bottom0, operand_shape, axis, what):
    shape = bottom0.shape
    if axis + len(operand_shape) > len(shape):
        raise layer.error(f"the {what} of shape {tuple(operand_shape)} extends past bottom[0]'s shape "
                          f"{shape} when applied from axis {axis}")
    if tuple(shape[axis:axis + len(operand_shape)]) != tuple(operand_shape):
        raise layer.error(f"the {what} of shape {tuple(operand_shape)} does not match bottom[0]'s "
                          f"axes {axis}..{axis + len(operand_shape) - 1} of shape {shape}")
    outer = int(numpy.prod(shape[:axis])) if axis else 1
    dim = int(numpy.prod(operand_shape)) if len(operand_shape) else 1
    inner = int(numpy.prod(shape[axis + len(operand_shape):]))
    return outer, dim, inner


def _learned_shape(layer, bottom0, axis_param, num_axes):
    try:
        axis = bottom0.canonical_axis(axis_param)
    except ValueError as e:
        raise layer.error(str(e)) from None
    if num_axes < -1:
        raise layer.error(f"num_axes must be >= 0, or -1 to extend to the end of bottom[0]; "
                          f"got {num_axes}")
    if num_axes >= 0 and axis + num_axes > bottom0.ndim:
        raise layer.error(f"axis {axis_param} with num_axes {num_axes} extends past bottom[0]'s "
                          f"shape {bottom0.shape}")
    end = bottom0.ndim if num_axes == -1 else axis + num_axes
    return tuple(bottom0.shape[axis:end])


@register("Bias")
class BiasLayer(Layer):
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.bias_param
        self.axis_param = int(p.axis)
        if len(bottom) == 1 and not self.blobs:
            shape = _learned_shape(self, bottom[0], p.axis, p.num_axes)
            # default filler: constant 0 (an empty FillerParameter is exactly that)
            self.add_param(shape, p.filler)

    def reshape(self, bottom, top):
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        self._axis = _operand_axis(self, bottom[0], bias.ndim, self.axis_param)
        self._layout = _check_operand(self, bottom[0], bias.shape, self._axis, "bias")
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        outer, dim, inner = self._layout
        x3 = bottom[0].data.reshape(outer, dim, inner)
        self.xp.add(x3, bias.data.reshape(1, dim, 1), out=top[0].data.reshape(x3.shape))

    def backward(self, top, propagate_down, bottom):
        outer, dim, inner = self._layout
        dy = top[0].diff
        if len(bottom) == 1:
            if self.param_propagate_down[0]:
                self.blobs[0].diff += sum_per_dim(dy.reshape(outer, dim, inner)).reshape(
                    self.blobs[0].shape)
        elif propagate_down[1]:
            bottom[1].diff[...] = sum_per_dim(dy.reshape(outer, dim, inner)).reshape(bottom[1].shape)
        if propagate_down[0] and top[0] is not bottom[0]:
            bottom[0].diff[...] = dy


@register("Scale")
class ScaleLayer(Layer):
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    # A copy of the input, which a forward run in place overwrites and backward needs; made by
    # the first such forward at a shape (apply's keep_input)
    _temp = None

    def layer_setup(self, bottom, top):
        p = self.param.scale_param
        self.axis_param = int(p.axis)
        self.bias_term = bool(p.bias_term)
        n_expected = (1 if len(bottom) == 1 else 0) + (1 if self.bias_term else 0)
        if len(self.blobs) == n_expected and n_expected > 0:
            return  # parameters already present (loaded or set up before): keep them
        self.blobs = []
        if len(bottom) == 1:
            shape = _learned_shape(self, bottom[0], p.axis, p.num_axes)
            if p.HasField("filler"):
                self.add_param(shape, p.filler)
            else:
                self.add_param(shape, fill_value=1.0)  # identity by default
        if self.bias_term:
            # Caffe builds an internal Bias layer with axis = scale axis and num_axes = bottom[1]'s
            # axis count (two bottoms) or scale num_axes (one bottom); default filler constant 0.
            num_axes = bottom[1].ndim if len(bottom) > 1 else p.num_axes
            shape = _learned_shape(self, bottom[0], p.axis, num_axes)
            self.add_param(shape, p.bias_filler)

    def reshape(self, bottom, top):
        scale = bottom[1] if len(bottom) > 1 else self.blobs[0]
        self._axis = _operand_axis(self, bottom[0], scale.ndim, self.axis_param)
        # (outer, dim, inner): bottom[0] seen as the axes before, under and after the scale
        self.layout = _check_operand(self, bottom[0], scale.shape, self._axis, "scale")
        if self.bias_term:
            bias = self.blobs[-1]
            baxis = _operand_axis(self, bottom[0], bias.ndim, self.axis_param)
            self._bias_layout = _check_operand(self, bottom[0], bias.shape, baxis, "bias")
        # the bias over the same axes as the scale (always, unless loaded blobs say otherwise):
        # both can be cut into the same ranges
        self.same_axes = not self.bias_term or self._bias_layout == self.layout
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def _split(self, fn):
        """fn(lo, hi) over ranges of the scale's axis on the cores (split_range); one call when
        the bias spans other axes than the scale."""
        outer, dim, inner = self.layout
        if not self.same_axes:
            fn(0, dim)
            return
        split_range(fn, dim, outer * dim * inner, self.xp)

    def forward(self, bottom, top):
        keep = None
        if top[0] is bottom[0]:          # in place: the output overwrites what backward needs
            keep = reuse_buffer(self, "_temp", bottom[0].shape, bottom[0].dtype, self.xp)
        self.apply(bottom, top, keep)

    def apply(self, bottom, top, keep_input=None):
        """top = bottom[0] * scale (+ bias), over ranges of the scale's axis on the cores;
        keep_input (an array of bottom[0]'s shape), when given, gets a copy of the input in the
        same pass, before an in-place output overwrites it."""
        xp = self.xp
        scale = bottom[1] if len(bottom) > 1 else self.blobs[0]
        outer, dim, inner = self.layout
        x3 = bottom[0].data.reshape(outer, dim, inner)
        y3 = top[0].data.reshape(outer, dim, inner)
        s1 = scale.data.reshape(1, dim, 1)
        t3 = None if keep_input is None else keep_input.reshape(outer, dim, inner)
        same_axes = self.same_axes
        if self.bias_term:
            bo, bd, bi = self._bias_layout
            b1 = self.blobs[-1].data.reshape(1, bd, 1)

        def part(lo, hi):
            if t3 is not None:
                t3[:, lo:hi] = x3[:, lo:hi]              # backward needs the input
            xp.multiply(x3[:, lo:hi], s1[:, lo:hi], out=y3[:, lo:hi])
            if self.bias_term and same_axes:
                y3[:, lo:hi] += b1[:, lo:hi]
            elif self.bias_term:                         # one call (_split): the whole array
                y3.reshape(bo, bd, bi)[...] += b1

        self._split(part)

    def backward(self, top, propagate_down, bottom):
        x = self._temp if top[0] is bottom[0] else bottom[0].data
        self.gradients(top, propagate_down, bottom, x)

    def gradients(self, top, propagate_down, bottom, x):
        """Backward, the input forward saw being x (bottom[0]'s shape): the kept copy after a
        forward in place, or another holder of the same numbers."""
        xp = self.xp
        outer, dim, inner = self.layout
        dy = top[0].diff
        one = len(bottom) == 1
        scale = self.blobs[0] if one else bottom[1]
        want_bias = self.bias_term and self.param_propagate_down[-1]
        want_scale = (one and self.param_propagate_down[0]) or (not one and propagate_down[1])
        same_axes = self.same_axes
        d3 = dy.reshape(outer, dim, inner)
        x3 = x.reshape(outer, dim, inner)
        s1 = scale.data.reshape(1, dim, 1)
        dx3 = bottom[0].diff.reshape(outer, dim, inner)
        scale_diff = scale.diff.reshape(-1)
        if want_bias:
            bias = self.blobs[-1]
            bo, bd, bi = self._bias_layout

        def part(lo, hi):
            if want_bias and same_axes:
                bias.diff.reshape(-1)[lo:hi] += sum_per_dim(d3[:, lo:hi])
            elif want_bias:                              # one call (_split): the whole array
                bias.diff += sum_per_dim(dy.reshape(bo, bd, bi)).reshape(bias.shape)
            if want_scale:
                grad = dot_per_dim(xp, d3[:, lo:hi], x3[:, lo:hi])
                if one:
                    scale_diff[lo:hi] += grad
                else:
                    scale_diff[lo:hi] = grad
            if propagate_down[0]:
                xp.multiply(d3[:, lo:hi], s1[:, lo:hi], out=dx3[:, lo:hi])

        self._split(part)
