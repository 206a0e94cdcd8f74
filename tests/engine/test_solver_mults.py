"""The whole Solver honours lr_mult and decay_mult, against an update written out here.

tests/engine/test_solver_rules.py checks each rule given (lr_mult, decay_mult); this checks that the
Solver passes each parameter's own values to it, on both of its paths for an InnerProduct weight
(made from the layer's sufficient factors, and from the whole gradient when clip_gradients is
set), for L2 and L1 weight decay. The reference is Caffe's SGD with momentum, written from the
formulas (rules.py's docstring):
    g = dE/dw + weight_decay * decay_mult * (w, or sign(w) for L1)
    v = momentum * v + base_lr * lr_mult * g ;  w -= v
with dE/dw of a Euclidean loss over one InnerProduct y = x W^T + b worked out by hand.
"""
import numpy
import pytest

from poseidon.engine.prototxt import parse_net_text
from poseidon.engine.proto import caffe_pb2
from poseidon.engine.solvers import get_solver

# weight: lr_mult 2, decay_mult 3; bias: lr_mult 0.5, decay_mult 0.25 (Caffe's usual bias setting
# is decay_mult 0, which would leave the bias's decay untested)
MULTS = {"weight": (2.0, 3.0), "bias": (0.5, 0.25)}
NET = """
name: "mults"
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        param { lr_mult: 2 decay_mult: 3 } param { lr_mult: 0.5 decay_mult: 0.25 }
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""
# exact in float32, the type of these fields in caffe.proto, so the reference uses the same numbers
BASE_LR, MOMENTUM, WEIGHT_DECAY, STEPS = 0.0625, 0.875, 0.125, 4


def solver(regularization, whole_gradient):
    param = caffe_pb2.SolverParameter(base_lr=BASE_LR, momentum=MOMENTUM, lr_policy="fixed",
                                      weight_decay=WEIGHT_DECAY, max_iter=STEPS, random_seed=3,
                                      regularization_type=regularization, display=0,
                                      snapshot_after_train=False)
    if whole_gradient:
        param.clip_gradients = 1e9       # needs the whole gradient; never scales it here
    param.net_param.CopyFrom(parse_net_text(NET))
    return get_solver(param, dtype=numpy.float64)


def reference_steps(w, b, x, t, regularization):
    """STEPS iterations of SGD with momentum on E = |x W^T + b - t|^2 / (2 N)."""
    velocity = {"weight": numpy.zeros_like(w), "bias": numpy.zeros_like(b)}
    values = {"weight": w.copy(), "bias": b.copy()}
    for _ in range(STEPS):
        residual = (x @ values["weight"].T + values["bias"] - t) / len(x)   # dE/dy  (N, 2)
        grads = {"weight": residual.T @ x, "bias": residual.sum(axis=0)}
        for name, value in values.items():
            lr_mult, decay_mult = MULTS[name]
            decay = value if regularization == "L2" else numpy.sign(value)
            g = grads[name] + WEIGHT_DECAY * decay_mult * decay
            velocity[name] = MOMENTUM * velocity[name] + BASE_LR * lr_mult * g
            value -= velocity[name]
    return values["weight"], values["bias"]


@pytest.mark.parametrize("whole_gradient", [False, True], ids=["factored", "whole-gradient"])
@pytest.mark.parametrize("regularization", ["L2", "L1"])
def test_solver_applies_each_parameters_lr_mult_and_decay_mult(regularization, whole_gradient):
    s = solver(regularization, whole_gradient)
    factored = [pid for pid, _, _ in s.factored.active(s.param)]
    assert factored == ([] if whole_gradient else [0])      # the path this case is about
    rs = numpy.random.RandomState(5)
    x, t = rs.standard_normal((4, 3)), rs.standard_normal((4, 2))
    s.net.blobs["data"].data[...] = x
    s.net.blobs["target"].data[...] = t
    weight, bias = (blob.data.copy() for blob in s.net.params["ip"])
    want_w, want_b = reference_steps(weight, bias, x, t, regularization)
    s.step(STEPS)
    got_w, got_b = (blob.data for blob in s.net.params["ip"])
    numpy.testing.assert_allclose(got_w, want_w, rtol=1e-12, atol=1e-14)
    numpy.testing.assert_allclose(got_b, want_b, rtol=1e-12, atol=1e-14)
    # the multipliers matter: with decay_mult 1 the same steps end elsewhere
    plain = dict(MULTS)
    try:
        MULTS.update(weight=(2.0, 1.0), bias=(0.5, 1.0))
        other_w, _ = reference_steps(weight, bias, x, t, regularization)
    finally:
        MULTS.clear()
        MULTS.update(plain)
    assert not numpy.allclose(other_w, want_w, rtol=1e-6)
