"""The benchmark nets as TRAIN-phase NetParameters fed from Input layers (no I/O is measured), and
solvers around them built the way `poseidon train` builds them (engine.solvers.get_solver).

Each net is described by a `BenchNet`: its NetParameter (built from the prototxt/ architecture with
its Data layers replaced by Input layers of the same shapes), its batch size, and the solver
settings of its solver file. `fill_inputs` writes random data and labels into the Input blobs once;
every iteration then trains on the same in-memory batch.
"""
import os
from pathlib import Path

import numpy

from poseidon import prototxt as shipped_prototxt
from poseidon.engine import prototxt
from poseidon.engine.proto import caffe_pb2

PROTOTXT = shipped_prototxt.folder()


class BenchNet:
    def __init__(self, key, title, param, batch, solver, input_shapes, num_classes):
        self.key, self.title, self.param, self.batch = key, title, param, batch
        self.solver = solver                # dict: base_lr, momentum, weight_decay
        self.input_shapes = input_shapes    # {"data": shape, "label": shape}
        self.num_classes = num_classes

    def solver_param(self, max_iter=10 ** 9):
        sp = caffe_pb2.SolverParameter(lr_policy="fixed", max_iter=max_iter, display=0,
                                       random_seed=1, **self.solver)
        sp.net_param.CopyFrom(self.param)
        return sp


def _input_layer(net, name, shape):
    lp = net.layer.add(name=name, type="Input")
    lp.top.append(name)
    lp.input_param.shape.add().dim.extend([int(d) for d in shape])


def _train_layers(src, batch, data_shape):
    """src's TRAIN-phase layers with Data layers replaced by Input 'data' + 'label' and the
    Accuracy layers dropped."""
    state = caffe_pb2.NetState(phase=caffe_pb2.TRAIN)
    filtered = prototxt.filter_net(src, state)
    net = caffe_pb2.NetParameter(name=src.name)
    shapes = {}
    for lp in filtered.layer:
        if lp.type == "Data":
            shapes = {"data": (batch,) + tuple(data_shape), "label": (batch,)}
            _input_layer(net, "data", shapes["data"])
            _input_layer(net, "label", shapes["label"])
            continue
        if lp.type == "Accuracy":
            continue
        if lp.type == "Input":
            shapes[lp.top[0]] = tuple(lp.input_param.shape[0].dim)
        net.layer.add().CopyFrom(lp)
    return net, shapes


def _solver_settings(path):
    sp = prototxt.read_solver(str(path))
    return {"base_lr": sp.base_lr, "momentum": sp.momentum, "weight_decay": sp.weight_decay}


def cifar10_quick(batch=100):
    src = prototxt.read_net(str(PROTOTXT / "cifar10_quick" / "train_val.prototxt"))
    param, shapes = _train_layers(src, batch, (3, 32, 32))
    return BenchNet("cifar10_quick", f"cifar10_quick (batch {batch})", param, batch,
                    _solver_settings(PROTOTXT / "cifar10_quick" / "solver.prototxt"), shapes, 10)


def fc_heavy(batch=32):
    src = prototxt.read_net(str(PROTOTXT / "fc_heavy" / "train_val.prototxt"))
    param, shapes = _train_layers(src, batch, ())
    for lp in param.layer:   # the file's Input layers are batch 32: resize to the asked batch
        if lp.type == "Input":
            lp.input_param.shape[0].dim[0] = batch
            shapes[lp.top[0]] = tuple(lp.input_param.shape[0].dim)
    return BenchNet("fc_heavy", f"fc_heavy 9216-4096-4096-1000 (batch {batch})", param, batch,
                    _solver_settings(PROTOTXT / "fc_heavy" / "solver.prototxt"), shapes, 1000)


VGG_BLOCK = """
name: "vgg_block"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {n} dim: {c} dim: {s} dim: {s} }} }} }}
layer {{ name: "label" type: "Input" top: "label" input_param {{ shape {{ dim: {n} }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param {{ lr_mult: 1 decay_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}
  convolution_param {{ num_output: {c} pad: 1 kernel_size: 3
    weight_filler {{ type: "gaussian" std: 0.01 }} bias_filler {{ type: "constant" }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  param {{ lr_mult: 1 decay_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}
  convolution_param {{ num_output: {c} pad: 1 kernel_size: 3
    weight_filler {{ type: "gaussian" std: 0.01 }} bias_filler {{ type: "constant" }} }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }}
layer {{ name: "pool" type: "Pooling" bottom: "conv2" top: "pool"
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
  param {{ lr_mult: 1 decay_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}
  inner_product_param {{ num_output: 10
    weight_filler {{ type: "gaussian" std: 0.01 }} bias_filler {{ type: "constant" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }}
"""


def vgg_block(batch=16, channels=64, size=56):
    """VGG's conv3 block shape: 2x (conv 3x3 pad 1, C->C, ReLU) + MAX pool 2/2, then a small
    InnerProduct to 10 classes and SoftmaxWithLoss so there is a loss to back-propagate."""
    param = prototxt.parse_net_text(VGG_BLOCK.format(n=batch, c=channels, s=size))
    shapes = {"data": (batch, channels, size, size), "label": (batch,)}
    return BenchNet("vgg_block", f"VGG block 2x conv3x3 {channels}->{channels} + pool, "
                    f"{size}x{size} (batch {batch})", param, batch,
                    {"base_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0005}, shapes, 10)


def _conv(name, bottom, out):
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}"\n'
            f'  param {{ lr_mult: 1 decay_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}\n'
            f'  convolution_param {{ num_output: {out} pad: 1 kernel_size: 3\n'
            f'    weight_filler {{ type: "gaussian" std: 0.01 }} bias_filler {{ type: "constant" }} }} }}\n'
            f'layer {{ name: "relu_{name}" type: "ReLU" bottom: "{name}" top: "{name}" }}\n')


def _pool(name, bottom):
    return (f'layer {{ name: "{name}" type: "Pooling" bottom: "{bottom}" top: "{name}"\n'
            f'  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}\n')


def _fc(name, bottom, out, relu=True):
    text = (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{name}"\n'
            f'  param {{ lr_mult: 1 decay_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}\n'
            f'  inner_product_param {{ num_output: {out}\n'
            f'    weight_filler {{ type: "gaussian" std: 0.005 }} bias_filler {{ type: "constant" }} }} }}\n')
    return text + (f'layer {{ name: "relu_{name}" type: "ReLU" bottom: "{name}" top: "{name}" }}\n'
                   if relu else "")


def vgg_mini(batch=8, size=32):
    """VGG-16's layout at CIFAR's size: three blocks of two 3x3 convolutions (64, 128, then 256
    channels) each ending in a 2x2 max pool, then VGG's classifier (fc6 and fc7 4096 wide, fc8 to
    1000 classes). As in VGG, most parameters are in the classifier (37.7 M of 39.1 M) and the
    convolutions hold a few MB: the VGG-style net of the distributed parts."""
    side = size // 8
    text = ('name: "vgg_mini"\n'
            f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {batch} '
            f'dim: 3 dim: {size} dim: {size} }} }} }}\n'
            f'layer {{ name: "label" type: "Input" top: "label" input_param {{ shape {{ dim: {batch} '
            f'}} }} }}\n'
            + _conv("conv1_1", "data", 64) + _conv("conv1_2", "conv1_1", 64) + _pool("pool1", "conv1_2")
            + _conv("conv2_1", "pool1", 128) + _conv("conv2_2", "conv2_1", 128)
            + _pool("pool2", "conv2_2")
            + _conv("conv3_1", "pool2", 256) + _conv("conv3_2", "conv3_1", 256)
            + _pool("pool3", "conv3_2")
            + _fc("fc6", "pool3", 4096) + _fc("fc7", "fc6", 4096) + _fc("fc8", "fc7", 1000, relu=False)
            + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc8" bottom: "label" top: "loss" }\n')
    param = prototxt.parse_net_text(text)
    shapes = {"data": (batch, 3, size, size), "label": (batch,)}
    return BenchNet("vgg_mini", f"VGG-style: 6 conv 3x3 (64, 128, 256) + 3 pools + fc {256 * side * side}"
                    f"-4096-4096-1000, {size}x{size} (batch {batch})", param, batch,
                    {"base_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0005}, shapes, 1000)


def all_nets(quick=False):
    if quick:   # same architectures, smaller batches: a smoke run, not a measurement
        return [cifar10_quick(20), fc_heavy(8), vgg_block(2)]
    return [cifar10_quick(), fc_heavy(), vgg_block()]


def synthetic_batch(bench_net, seed=0):
    """Random data (standard normal) and labels, as float32 host arrays."""
    rs = numpy.random.default_rng(seed)
    data = rs.standard_normal(bench_net.input_shapes["data"]).astype(numpy.float32)
    label = rs.integers(0, bench_net.num_classes, bench_net.input_shapes["label"])
    return data, label.astype(numpy.float32)


def fill_inputs(net, data, label):
    from poseidon.engine import backend
    net.blobs["data"].data[...] = backend.to_xp(data, net.xp)
    net.blobs["label"].data[...] = backend.to_xp(label, net.xp)


def make_solver(bench_net, xp=None):
    """An engine solver (engine.solvers.get_solver) on the bench net, inputs filled."""
    import logging
    from poseidon.engine.solvers import get_solver
    from poseidon.engine.solvers import log_to_stderr
    log = logging.getLogger("poseidon")
    level = log.level
    log_to_stderr(logging.WARNING)  # no "Creating training net" lines inside the bench output
    try:
        solver = get_solver(bench_net.solver_param(), xp=xp)
    finally:
        log.setLevel(level or logging.INFO)
    data, label = synthetic_batch(bench_net)
    fill_inputs(solver.net, data, label)
    return solver


def write_solver_files(bench_net, folder, max_iter):
    """A solver file + net file for `poseidon train` (the distributed parts): Input layers, no
    test net, no snapshots. Returns the solver path."""
    from google.protobuf import text_format
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    net_path = folder / f"{bench_net.key}_net.prototxt"
    net_path.write_text(text_format.MessageToString(bench_net.param))
    sp = caffe_pb2.SolverParameter(lr_policy="fixed", max_iter=max_iter, display=0,
                                   snapshot_after_train=False, random_seed=1, **bench_net.solver)
    sp.net = os.fspath(net_path)
    solver_path = folder / f"{bench_net.key}_solver.prototxt"
    solver_path.write_text(text_format.MessageToString(sp))
    return solver_path
