"""Convolution and Deconvolution (Caffe's BaseConvolutionLayer family): 2-D, groups, dilation.

The layers read Caffe's parameters and hand the arithmetic to a core: im2col (columns.py), which
both layers share (Deconvolution is the transpose of Convolution, so its forward is the
convolution's input gradient and its input gradient is the convolution's forward, exactly as
Caffe's deconv_layer.cpp does it), or for a Convolution the frequency domain (fourier.py) or
Winograd's F(2x2, 3x3) (winograd.py), all with the same interface. The route is picked per layer
and input size (routes.py): at reshape, or at the first forward where it is measured.
"""
from ...backend import device_name
from ...layer import TRAIN, Layer
from ...registry import register
from ...parallel import parallel
from ...proto import caffe_pb2
from ..activation import relu_backward, relu_forward
from ..im2col import Geometry
from . import routes
from .bias import bias_gradient_sum
from .columns import Im2colConvCore
from .fourier import FourierConvCore
from .winograd import WinogradConvCore

CORES = {"im2col": Im2colConvCore, "fourier": FourierConvCore, "winograd": WinogradConvCore}


def _pair(layer, cp, name, h_name, w_name, default):
    """Caffe's rules for one per-dimension setting: `name` repeated once or once per spatial
    dimension, or the _h/_w pair (2-D only, not mixed with the repeated form)."""
    values = list(getattr(cp, name))
    if h_name is not None and (cp.HasField(h_name) or cp.HasField(w_name)):
        if values:
            raise layer.error(f"gives both {name} and {h_name}/{w_name}: use one form")
        return int(getattr(cp, h_name)), int(getattr(cp, w_name))
    if not values:
        if default is None:
            raise layer.error("gives no kernel size: set kernel_size (once, or once per spatial "
                              "dimension) or kernel_h and kernel_w")
        return default, default
    if len(values) == 1:
        return int(values[0]), int(values[0])
    if len(values) == 2:
        return int(values[0]), int(values[1])
    raise layer.error(f"gives {name} {len(values)} times: give it once, or once per spatial "
                      f"dimension (this engine does 2-D convolution: 2)")


@register("Convolution")
class ConvolutionLayer(Layer):
    """Caffe's Convolution: cross-correlation, zero padding, groups, dilation, 2-D spatial axes.

    Bottoms and tops pair up (bottom i -> top i, same weights). Weight (num_output, C/g, kh, kw),
    bias (num_output,).
    """

    min_bottoms = 1
    min_tops = 1
    equal_bottoms_tops = True
    reverse = False   # Deconvolution swaps the roles of input and output
    fused_relu = None   # the slope of a following ReLU this layer runs (take_relu)

    def layer_setup(self, bottom, top):
        cp = self.param.convolution_param
        x = bottom[0]
        try:
            axis = x.canonical_axis(cp.axis)
        except ValueError:
            raise self.error(f"axis {cp.axis} is out of range for a bottom of shape {x.shape}") \
                from None
        if axis != 1:
            raise self.error(f"axis {cp.axis}: only axis 1 (N x C x H x W, channels second) is "
                             f"supported")
        if x.ndim != 4:
            raise self.error(f"needs a 4-axis bottom (N x C x H x W), got shape {x.shape}: only "
                             f"2-D convolution is supported (no N-d)")
        for b, t in zip(bottom, top):
            if b is t:
                raise self.error("cannot run in place: give the top its own name")
        kh, kw = _pair(self, cp, "kernel_size", "kernel_h", "kernel_w", None)
        if kh < 1 or kw < 1:
            raise self.error(f"kernel size {kh}x{kw}: both kernel dimensions must be positive "
                             f"(with kernel_h/kernel_w give both)")
        sh, sw = _pair(self, cp, "stride", "stride_h", "stride_w", 1)
        if sh < 1 or sw < 1:
            raise self.error(f"stride {sh}x{sw}: strides must be positive")
        ph, pw = _pair(self, cp, "pad", "pad_h", "pad_w", 0)
        dh, dw = _pair(self, cp, "dilation", None, None, 1)
        if dh < 1 or dw < 1:
            raise self.error(f"dilation {dh}x{dw}: dilations must be positive")
        self.geom = Geometry(kh, kw, sh, sw, ph, pw, dh, dw)

        self.channels = x.shape[1]
        self.num_output = int(cp.num_output)
        if self.num_output < 1:
            raise self.error("num_output must be set to a positive number")
        self.group = int(cp.group)
        if self.group < 1:
            raise self.error(f"group {self.group} must be at least 1")
        if self.channels % self.group:
            raise self.error(f"the bottom's {self.channels} channels are not divisible by "
                             f"group {self.group}")
        if self.num_output % self.group:
            raise self.error(f"num_output {self.num_output} is not divisible by group {self.group}")
        if self.reverse:   # conv in = this layer's output, conv out = this layer's input
            conv_out, conv_in = self.channels, self.num_output
        else:
            conv_out, conv_in = self.num_output, self.channels
        self._cores = {}            # route -> this layer's core for it, made on first use
        self._current = self._core("im2col")
        self._shape = None          # routes.LayerShape of the last reshape
        self._pending = False       # the route for _shape waits for a measurement (first forward)
        self._pinned = None         # a route set by pin_route, which then never measures
        train = self.phase == TRAIN
        self._gradients = (train, train)   # (weight, input) gradients; the net says (plan_backward)
        self.bias_term = bool(cp.bias_term)
        self.add_param((conv_out, conv_in // self.group, kh, kw), cp.weight_filler)
        if self.bias_term:
            self.add_param((self.num_output,), cp.bias_filler)

    def _out_size(self, h, w):
        return self.geom.conv_out(h, w)

    def reshape(self, bottom, top):
        x = bottom[0]
        if x.ndim != 4:
            raise self.error(f"bottom changed to shape {x.shape}: it must stay 4-axis "
                             f"(N x C x H x W)")
        if x.shape[1] != self.channels:
            raise self.error(f"bottom now has {x.shape[1]} channels but the layer was set up for "
                             f"{self.channels}: the channel count may not change after setup")
        for b in bottom[1:]:
            if b.shape != x.shape:
                raise self.error(f"all bottoms must have one shape: {b.shape} vs {x.shape}")
        n, _, h, w = x.shape
        out_h, out_w = self._out_size(h, w)
        if out_h < 1 or out_w < 1:
            g = self.geom
            raise self.error(f"output would be {out_h}x{out_w} for a {h}x{w} input (kernel "
                             f"{g.kh}x{g.kw}, pad {g.ph}x{g.pw}, stride {g.sh}x{g.sw}, dilation "
                             f"{g.dh}x{g.dw}): use a larger input or a smaller kernel/more pad")
        for t in top:
            t.reshape(n, self.num_output, out_h, out_w)
        self._shape = routes.LayerShape(n, self.channels, h, w, self.num_output, self.geom,
                                        self.group, self.dtype.name, self._device(),
                                        *self._gradients)
        self._settle(measure=False)

    @property
    def core(self):
        """The core of this layer's route for the current input size: chosen at reshape, or at
        the first forward where it must be measured (routes.choose)."""
        if self._pending:
            self._settle(measure=True)
        return self._current

    @property
    def algorithm(self):
        """'im2col', 'fourier' or 'winograd': the route this layer runs at its current input
        size (measured now if it has not been yet)."""
        return self.core.algorithm

    def pin_route(self, route):
        """Run `route` from now on ('im2col', 'fourier' or 'winograd'; where it does not apply to
        the input, im2col), whatever POSEIDON_CONV says, and never measure: how a rank takes
        another's choice, or a resumed run its snapshot's (Net.set_conv_routes)."""
        if route not in routes.ROUTES:
            raise self.error(f"route {route!r} is not a convolution route: use one of "
                             f"{', '.join(routes.ROUTES)}")
        self._pinned = route
        if self._shape is not None:
            self._settle(measure=False)

    def plan_backward(self, weight_grad, input_grad):
        """The net's word on which gradients backward will make: the routes are timed on what
        will run (a net's first layer makes no input gradient; a TEST net no backward)."""
        gradients = (bool(weight_grad), bool(input_grad))
        if gradients != self._gradients:
            self._gradients = gradients
            if self._shape is not None:
                self._shape = self._shape._replace(weight_grad=gradients[0],
                                                   input_grad=gradients[1])
                self._settle(measure=False)

    def _device(self):
        """The device part of a layer shape's key: the CPU threads, or the GPU's name."""
        name = device_name(self.xp)
        return f"cpu, {parallel().workers} threads" if name == "cpu" else f"gpu {name}"

    def _settle(self, measure):
        """Take the route routes.choose gives for the current shape; without `measure`, leave it
        pending when it would have to be timed."""
        cp = self.param.convolution_param
        if self.reverse or cp.engine == caffe_pb2.ConvolutionParameter.CAFFE:
            route = "im2col"
        else:
            make_core = (lambda r: CORES[r](self.geom, self.group)) if measure else None
            try:
                route = routes.choose(self._shape, self.xp, self._pinned, make_core, self.name)
            except ValueError as e:
                raise self.error(str(e)) from None
        self._pending = route is None
        if route is not None:
            self._current = self._core(route)

    def _core(self, route):
        """This layer's core for `route`, made on first use and kept (with its buffers)."""
        core = self._cores.get(route)
        if core is None:
            core = self._cores[route] = CORES[route](self.geom, self.group)
        return core

    def take_relu(self, slope):
        """Run the in-place ReLU (negative slope `slope`) that follows this layer
        (engine/layers/fusion.py); a Deconvolution declines."""
        if self.reverse:
            return False
        self.fused_relu = slope
        return True

    def forward(self, bottom, top):
        weight = self.blobs[0].data
        bias = self.blobs[1].data if self.bias_term else None
        core, relu = self.core, self.fused_relu
        for k, (b, t) in enumerate(zip(bottom, top)):
            if relu is not None and getattr(core, "takes_relu", False):
                core.forward(b.data, weight, t.data, bias, key=k, relu=relu)
                continue
            core.forward(b.data, weight, t.data, bias, key=k)
            if relu is not None:
                relu_forward(t.data, t.data, relu, self.xp)

    def backward(self, top, propagate_down, bottom):
        weight = self.blobs[0]
        bias = self.blobs[1] if self.bias_term and self.param_propagate_down[1] else None
        core, slope = self.core, self.fused_relu
        for k, (t, b) in enumerate(zip(top, bottom)):
            extra = {}
            if getattr(core, "takes_relu", False):   # first top: diffs may hold only zeros
                extra["fresh"] = (k == 0 and weight.diff_fresh,
                                  k == 0 and bias is not None and bias.diff_fresh)
                extra["relu"] = None if slope is None else (t.data, slope)
            elif slope is not None:
                relu_backward(t.diff, t.data, t.diff, slope, self.xp)
            core.backward(
                t.diff, weight.data,
                weight_diff=weight.diff if self.param_propagate_down[0] else None,
                bias_diff=None if bias is None else bias.diff,
                dx=b.diff if propagate_down[k] else None, key=k, **extra)


@register("Deconvolution")
class DeconvolutionLayer(ConvolutionLayer):
    """Caffe's Deconvolution: the transpose of Convolution (its forward is Convolution's backward).

    Weight (C_in, num_output/g, kh, kw); output size s(in-1) + d(k-1) + 1 - 2p per dimension.
    """

    reverse = True

    def _out_size(self, h, w):
        return self.geom.deconv_out(h, w)

    def forward(self, bottom, top):
        weight = self.blobs[0].data
        for b, t in zip(bottom, top):
            self.core.backward_data(b.data, weight, t.data)
            if self.bias_term:
                t.data += self.blobs[1].data.reshape(1, -1, 1, 1)

    def backward(self, top, propagate_down, bottom):
        weight = self.blobs[0]
        for k, (t, b) in enumerate(zip(top, bottom)):
            if self.bias_term and self.param_propagate_down[1]:
                self.blobs[1].diff += bias_gradient_sum(t.diff)
            if not (self.param_propagate_down[0] or propagate_down[k]):
                continue
            # the top gradient plays the convolution's input: bottom diff = its convolution
            if propagate_down[k]:
                self.core.forward(t.diff, weight.data, b.diff, key=k)
            else:
                self.core.prepare(t.diff, key=k)
            if self.param_propagate_down[0]:
                # dW = x (as a "top gradient" of the convolution) against the columns of dtop
                self.core.backward(b.data, weight.data, weight_diff=weight.diff, key=k)
