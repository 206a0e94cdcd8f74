"""PyTorch's version of a deploy net, built from the same NetParameter as the engine's (so the two
cannot drift apart) and written the way a PyTorch user writes it: a BatchNorm followed by the
Scale that scales its output is one affine `BatchNorm2d`, and a ReLU runs in place where the Caffe
layer does (as torchvision's networks do). One builder per layer type; model_ref.py times it beside
the engine, the device probe on CUDA. torch is imported only inside the functions.
"""
import numpy

from poseidon.engine.proto import caffe_pb2


def _hw(param, field, default):
    """(h, w) of a convolution or pooling field, given repeated, as a scalar or as its _h/_w twins
    (kernel_size's twins are kernel_h/kernel_w)."""
    base = "kernel" if field == "kernel_size" else field
    if f"{base}_h" in param.DESCRIPTOR.fields_by_name and param.HasField(f"{base}_h"):
        return getattr(param, f"{base}_h"), getattr(param, f"{base}_w")
    value = getattr(param, field)
    if isinstance(value, int):
        return (value, value) if param.HasField(field) else (default, default)
    values = list(value) or [default]
    return values[0], values[-1]


class _Build:
    """What the layer builders share while torch_graph walks the net: torch, the layers and blob
    shapes, the modules that hold parameters (in creation order, as the optimizer sees them; by
    engine layer name for copy_weights) and the layers folded into the one before them."""

    def __init__(self, torch, layers, shapes):
        self.torch, self.nn = torch, torch.nn
        self.layers, self.shapes = layers, shapes
        self.modules = torch.nn.ModuleList()
        self.by_layer = {}
        self.folded = set()

    def hold(self, module, name=None):
        """Keep a module with parameters; `name`: the engine layer whose blobs it holds."""
        self.modules.append(module)
        if name is not None:
            self.by_layer[name] = module
        return module


def _convolution(b, i, lp, channels):
    cp = lp.convolution_param
    return b.hold(b.nn.Conv2d(channels, cp.num_output, _hw(cp, "kernel_size", 1),
                              stride=_hw(cp, "stride", 1), padding=_hw(cp, "pad", 0),
                              dilation=_hw(cp, "dilation", 1), groups=cp.group or 1,
                              bias=cp.bias_term), lp.name)


def _pooling(b, i, lp, channels):
    pp = lp.pooling_param
    if pp.global_pooling:
        kernel, stride, pad = tuple(b.shapes[lp.bottom[0]][2:]), 1, 0
    else:
        kernel, stride, pad = (_hw(pp, "kernel_size", 1), _hw(pp, "stride", 1),
                               _hw(pp, "pad", 0))
    ceil = pp.round_mode == caffe_pb2.PoolingParameter.CEIL
    if pp.pool == caffe_pb2.PoolingParameter.MAX:
        return b.nn.MaxPool2d(kernel, stride, pad, ceil_mode=ceil)
    return b.nn.AvgPool2d(kernel, stride, pad, ceil_mode=ceil, count_include_pad=True)


def _relu(b, i, lp, channels):
    slope, inplace = lp.relu_param.negative_slope, lp.top[0] == lp.bottom[0]
    return b.nn.LeakyReLU(slope, inplace) if slope else b.nn.ReLU(inplace)


def _batch_norm(b, i, lp, channels):
    """A BatchNorm whose output only a Scale takes is one affine BatchNorm2d with it, as a
    PyTorch user writes it; the Scale is folded in (and its weights are the module's)."""
    nxt = b.layers[i + 1] if i + 1 < len(b.layers) else None
    affine = (nxt is not None and nxt.type == "Scale" and len(nxt.bottom) == 1
              and nxt.bottom[0] == lp.top[0])
    bn = b.hold(b.nn.BatchNorm2d(channels, eps=lp.batch_norm_param.eps, affine=affine))
    if affine:
        b.by_layer[nxt.name] = bn
        b.folded.add(i + 1)
        if not nxt.scale_param.bias_term:
            bn.bias.requires_grad_(False)
    return bn


def _scale(b, i, lp, channels):
    scale = b.nn.Parameter(b.torch.ones(channels))
    shift = b.nn.Parameter(b.torch.zeros(channels)) if lp.scale_param.bias_term else None
    b.hold(b.nn.ParameterList([p for p in (scale, shift) if p is not None]), lp.name)

    def fn(x, scale=scale, shift=shift):
        y = x * scale.view(1, -1, 1, 1)
        return y if shift is None else y + shift.view(1, -1, 1, 1)
    return fn


def _eltwise(b, i, lp, channels):
    ep, torch = lp.eltwise_param, b.torch
    if ep.operation == caffe_pb2.EltwiseParameter.PROD:
        def fn(*xs):
            y = xs[0]
            for x in xs[1:]:
                y = y * x
            return y
    elif ep.operation == caffe_pb2.EltwiseParameter.MAX:
        def fn(*xs):
            y = xs[0]
            for x in xs[1:]:
                y = torch.maximum(y, x)
            return y
    else:
        coeffs = list(ep.coeff) or [1.0] * len(lp.bottom)

        def fn(*xs, coeffs=coeffs):
            y = xs[0] if coeffs[0] == 1 else xs[0] * coeffs[0]
            for c, x in zip(coeffs[1:], xs[1:]):
                y = y + x if c == 1 else y + c * x
            return y
    return fn


def _concat(b, i, lp, channels):
    axis, torch = lp.concat_param.axis, b.torch

    def fn(*xs, axis=axis):
        return torch.cat(xs, axis)
    return fn


def _split(b, i, lp, channels):
    def fn(x, n=len(lp.top)):
        return (x,) * n
    return fn


def _inner_product(b, i, lp, channels):
    ip = lp.inner_product_param
    inputs = int(numpy.prod(b.shapes[lp.bottom[0]][1:]))
    linear = b.hold(b.nn.Linear(inputs, ip.num_output, bias=ip.bias_term), lp.name)

    def fn(x, linear=linear):
        return linear(x.flatten(1))
    return fn


def _lrn(b, i, lp, channels):
    lrn = lp.lrn_param
    if lrn.norm_region != caffe_pb2.LRNParameter.ACROSS_CHANNELS:
        raise SystemExit(f"model_ref: layer '{lp.name}': the PyTorch side has no "
                         f"WITHIN_CHANNEL LRN")
    return b.nn.LocalResponseNorm(lrn.local_size, lrn.alpha, lrn.beta, lrn.k)


def _dropout(b, i, lp, channels):
    return b.nn.Dropout(lp.dropout_param.dropout_ratio)


def _softmax(b, i, lp, channels):
    import torch.nn.functional as F

    def fn(x):
        return F.softmax(x, 1)
    return fn


# layer type -> builder(build, index, layer, input channels): the step's callable
_BUILDERS = {"Convolution": _convolution, "Pooling": _pooling, "ReLU": _relu,
             "BatchNorm": _batch_norm, "Scale": _scale, "Eltwise": _eltwise, "Concat": _concat,
             "Split": _split, "InnerProduct": _inner_product, "LRN": _lrn, "Dropout": _dropout,
             "Softmax": _softmax}


def torch_graph(param, shapes, threads):
    """A torch module computing param's graph (see the module docstring); shapes: {blob: shape}
    from the engine's net (the channels each layer takes)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    b = _Build(torch, list(param.layer), shapes)
    steps = []                 # (bottoms, tops, callable)
    for i, lp in enumerate(b.layers):
        if i in b.folded or lp.type in ("Input", "Silence"):
            continue
        channels = shapes[lp.bottom[0]][1] if lp.bottom else None
        builder = _BUILDERS.get(lp.type)
        if builder is None:
            raise SystemExit(f"model_ref: layer '{lp.name}' of type {lp.type} has no PyTorch "
                             f"counterpart here")
        fn = builder(b, i, lp, channels)
        out = b.layers[i + 1] if i + 1 in b.folded else lp     # a folded layer's top is the pair's
        steps.append((list(lp.bottom), list(out.top), fn))
    return _graph_module(torch.nn, b.modules, b.by_layer, steps)


def _graph_module(nn, modules, by_layer, steps):
    """The steps as one nn.Module in training mode: each step's tops from its bottoms, in order;
    it returns the last step's output."""
    class Graph(nn.Module):
        def __init__(self):
            super().__init__()
            self.held = modules
            self.by_layer = by_layer

        def forward(self, blobs):
            for bottoms, tops, step in steps:
                out = step(*(blobs[b] for b in bottoms))
                outs = out if isinstance(out, tuple) else (out,)
                blobs.update(zip(tops, outs))
            return out

    return Graph().train()
