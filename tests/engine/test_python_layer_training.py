"""Training with layers written in Python (tests/engine/layers/test_python_layer.py covers their set-up,
forward, gradients and errors one layer at a time; here whole nets train through the solver).

A module is written to a temporary folder put on sys.path, as a user's own module would be:
* `type: "Python"` (pycaffe's route): a learnable per-channel scale (`self.blobs.add_blob`) and a
  custom Euclidean loss, trained by engine.solvers.get_solver;
* `@engine.register("...")` (the engine's route): the same scale as a new layer type.
"""
import importlib
import sys

import numpy
import pytest
from google.protobuf import text_format

from poseidon.engine.proto import caffe_pb2
from poseidon.engine.solvers import get_solver

MODULE = "poseidon_test_trainable_pylayers"
REGISTERED = "PoseidonTestChannelScale"

SOURCE = f'''
from poseidon import engine


class ChannelScale(engine.Layer):
    """pycaffe style: y[n, c, ...] = s[c] * x[n, c, ...] with a learnable s (starts at param_str)."""

    def setup(self, bottom, top):
        if len(bottom) != 1 or len(top) != 1:
            raise Exception("ChannelScale takes one bottom and one top")
        self.blobs.add_blob(bottom[0].shape[1])
        self.blobs[0].data[...] = float(self.param_str or 1)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def _scale_shape(self, x):
        return (1, x.shape[1]) + (1,) * (x.ndim - 2)

    def forward(self, bottom, top):
        x = bottom[0].data
        top[0].data[...] = x * self.blobs[0].data.reshape(self._scale_shape(x))

    def backward(self, top, propagate_down, bottom):
        x, dy = bottom[0].data, top[0].diff
        axes = (0,) + tuple(range(2, x.ndim))
        self.blobs[0].diff[...] += (dy * x).sum(axis=axes)
        if propagate_down[0]:
            bottom[0].diff[...] = dy * self.blobs[0].data.reshape(self._scale_shape(x))


class EuclideanLoss(engine.Layer):
    """pycaffe's example loss layer (examples/pycaffe/layers/pyloss.py)."""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("Need two inputs to compute distance.")

    def reshape(self, bottom, top):
        if bottom[0].count != bottom[1].count:
            raise Exception("Inputs must have the same dimension.")
        self.diff = self.xp.zeros_like(bottom[0].data)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = (self.diff ** 2).sum() / bottom[0].num / 2.

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if not propagate_down[i]:
                continue
            sign = 1 if i == 0 else -1
            bottom[i].diff[...] = sign * self.diff * top[0].diff[0] / bottom[i].num


@engine.register("{REGISTERED}")
class RegisteredChannelScale(engine.Layer):
    """The engine's route: a new layer type with the engine's contract (layer_setup, add_param)."""
    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        self.add_param((bottom[0].shape[1],), fill_value=1.0)

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        s = self.blobs[0].data.reshape((1, -1) + (1,) * (bottom[0].data.ndim - 2))
        top[0].data[...] = bottom[0].data * s

    def backward(self, top, propagate_down, bottom):
        x, dy = bottom[0].data, top[0].diff
        s = self.blobs[0].data.reshape((1, -1) + (1,) * (x.ndim - 2))
        self.blobs[0].diff[...] += (dy * x).sum(axis=(0,) + tuple(range(2, x.ndim)))
        if propagate_down[0]:
            bottom[0].diff[...] = dy * s
'''

TRUE_SCALE = numpy.array([0.5, -1.0, 2.0])


@pytest.fixture(scope="module", autouse=True)
def layer_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trainable_pylayers")
    (folder / f"{MODULE}.py").write_text(SOURCE)
    sys.path.insert(0, str(folder))
    yield importlib.import_module(MODULE)      # importing it registers RegisteredChannelScale
    sys.path.remove(str(folder))
    sys.modules.pop(MODULE, None)


def net_text(scale_layer, loss_layer):
    return f'''
name: "python_layers"
layer {{ name: "data" type: "Input" top: "data" top: "target"
  input_param {{ shape {{ dim: 8 dim: 3 dim: 2 dim: 2 }} shape {{ dim: 8 dim: 3 dim: 2 dim: 2 }} }} }}
layer {{ name: "scale" bottom: "data" top: "scaled" {scale_layer} }}
layer {{ name: "loss" bottom: "scaled" bottom: "target" top: "loss" loss_weight: 1 {loss_layer} }}
'''


PY_SCALE = f'type: "Python" python_param {{ module: "{MODULE}" layer: "ChannelScale" param_str: "1" }}'
PY_LOSS = f'type: "Python" python_param {{ module: "{MODULE}" layer: "EuclideanLoss" }}'


def solver_for(text, **fields):
    param = caffe_pb2.SolverParameter(base_lr=0.1, lr_policy="fixed", momentum=0.9, max_iter=200,
                                      display=0, random_seed=3, snapshot_after_train=False,
                                      **fields)
    text_format.Parse(text, param.net_param)
    solver = get_solver(param)
    x = numpy.random.default_rng(0).standard_normal((8, 3, 2, 2))
    solver.net.blobs["data"].data[...] = x
    solver.net.blobs["target"].data[...] = x * TRUE_SCALE.reshape(1, 3, 1, 1)
    return solver


@pytest.mark.parametrize("scale, loss", [(PY_SCALE, PY_LOSS),
                                         (PY_SCALE, 'type: "EuclideanLoss"'),
                                         (f'type: "{REGISTERED}"', PY_LOSS)],
                         ids=["python-scale+python-loss", "python-scale+builtin-loss",
                              "registered-scale+python-loss"])
def test_net_with_python_layers_trains(scale, loss):
    solver = solver_for(net_text(scale, loss))
    net = solver.net
    assert type(net.layer_dict["scale"]).__module__ == MODULE
    assert len(net.learnable_params) == 1 and net.learnable_params[0].shape == (3,)
    first = net.Forward()
    losses = []
    for _ in range(8):
        solver.step(25)
        losses.append(net.Forward())
    assert first > 1 and losses[-1] < 1e-5 * first
    assert all(b <= a * 1.5 for a, b in zip(losses, losses[1:]))   # decreasing (momentum wiggles)
    numpy.testing.assert_allclose(net.learnable_params[0].data, TRUE_SCALE, atol=1e-2)


def test_python_loss_behind_builtin_layers_trains():
    """A custom Python loss under an InnerProduct net learns a linear map."""
    text = '''
name: "regress"
layer { name: "data" type: "Input" top: "data" top: "target"
  input_param { shape { dim: 16 dim: 4 } shape { dim: 16 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" bottom: "ip" bottom: "target" top: "loss" loss_weight: 1 %s }
''' % PY_LOSS
    param = caffe_pb2.SolverParameter(base_lr=0.05, lr_policy="fixed", momentum=0.9, max_iter=200,
                                      display=0, random_seed=1, snapshot_after_train=False)
    text_format.Parse(text, param.net_param)
    solver = get_solver(param)
    r = numpy.random.default_rng(1)
    x = r.standard_normal((16, 4))
    w = r.standard_normal((2, 4))
    solver.net.blobs["data"].data[...] = x
    solver.net.blobs["target"].data[...] = x @ w.T + 0.5
    first = solver.net.Forward()
    solver.solve()
    assert solver.iter == 200
    assert solver.net.Forward() < 1e-3 * first
    numpy.testing.assert_allclose(solver.net.params["ip"][0].data, w, atol=1e-2)
    numpy.testing.assert_allclose(solver.net.params["ip"][1].data, [0.5, 0.5], atol=1e-2)
