"""The speed paths that split work over threads and blocks give the same numbers as the plain ones:
InnerProduct's column-split GEMMs and the solver rules' blocked updates."""
import numpy
import pytest

from engine.layers import im2col
from engine.layers import inner_product
from engine.proto import caffe_pb2
from engine.solvers import rules
from tests.harness import make_layer, run_forward


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("transpose", [False, True])
def test_inner_product_split_matches_one_call(transpose, bias, monkeypatch):
    """Large weights (here: any, by the threshold) take other paths: columns split over threads,
    and without transpose the forward as Yᵀ = W·Xᵀ. They give the plain path's numbers."""
    rs = numpy.random.RandomState(0)
    x = rs.standard_normal((5, 3, 4, 2))
    text = ('type: "InnerProduct" inner_product_param { num_output: 7 '
            f'transpose: {str(transpose).lower()} bias_term: {str(bias).lower()} '
            'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } }')
    results = []
    for threshold, workers in ((1 << 40, 1), (1, 2), (1, 3)):
        monkeypatch.setattr(inner_product, "PARALLEL_MIN_WEIGHTS", threshold)
        monkeypatch.setattr(im2col.parallel(), "workers", workers)
        numpy.random.seed(0)
        from engine import rng
        rng.seed(3)
        layer = make_layer(text)
        bottom, top = run_forward(layer, [x])
        top[0].diff[...] = numpy.random.RandomState(1).standard_normal(top[0].shape)
        layer.backward(top, [True], bottom)
        layer.backward(top, [True], bottom)   # parameter gradients accumulate
        results.append([top[0].data.copy(), bottom[0].diff.copy()] +
                       [b.diff.copy() for b in layer.blobs])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            numpy.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", rules.rule_types())
def test_blocked_update_is_bitwise_the_whole_array_update(kind, monkeypatch):
    sp = caffe_pb2.SolverParameter(type=kind, base_lr=0.01, weight_decay=0.004, lr_policy="fixed",
                                   delta=1e-8)
    if kind in ("SGD", "Nesterov", "Adam", "AdaDelta"):
        sp.momentum = 0.9
    if kind == "RMSProp":
        sp.rms_decay = 0.98
    rule = rules.make_rule(sp)
    rs = numpy.random.RandomState(2)
    shape = (37, 29)
    value0 = rs.standard_normal(shape).astype(numpy.float32)
    grads = [rs.standard_normal(shape).astype(numpy.float32) for _ in range(3)]
    out = []
    for blocked_min, block, workers in ((1 << 40, 1 << 17, 1), (1, 64, 1), (1, 100, 2)):
        monkeypatch.setattr(rules, "BLOCKED_MIN", blocked_min)
        monkeypatch.setattr(rules, "BLOCK", block)
        monkeypatch.setattr(im2col.parallel(), "workers", workers)
        value = value0.copy()
        state = rule.init_state(shape, numpy, numpy.float32)
        for it, g in enumerate(grads):
            rule.update(value, g.copy(), state, it, lr_mult=2.0, decay_mult=0.5, grad_scale=0.5)
        out.append((value, [s.copy() for s in state]))
    for value, state in out[1:]:
        assert numpy.array_equal(value, out[0][0])
        for a, b in zip(state, out[0][1]):
            assert numpy.array_equal(a, b)
