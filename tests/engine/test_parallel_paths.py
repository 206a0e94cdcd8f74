"""The speed paths that split work over threads and blocks give the same numbers as the plain ones:
InnerProduct's column-split GEMMs and the solver rules' blocked updates."""
import numpy
import pytest

from poseidon.engine import parallel
from poseidon.engine.layers import inner_product
from poseidon.engine.proto import caffe_pb2
from poseidon.engine.solvers import rules
from tests.engine.harness import make_layer, run_forward


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
        monkeypatch.setattr(parallel.parallel(), "workers", workers)
        numpy.random.seed(0)
        from poseidon.engine import rng
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
        monkeypatch.setattr(parallel.parallel(), "workers", workers)
        value = value0.copy()
        state = rule.init_state(shape, numpy, numpy.float32)
        for it, g in enumerate(grads):
            rule.update(value, g.copy(), state, it, lr_mult=2.0, decay_mult=0.5, grad_scale=0.5)
        out.append((value, [s.copy() for s in state]))
    for value, state in out[1:]:
        assert numpy.array_equal(value, out[0][0])
        for a, b in zip(state, out[0][1]):
            assert numpy.array_equal(a, b)


# (layer text, bottom shapes, in place): the layers that split elementwise work and per-channel
# reductions over the cores (parallel.split_rows / split_range)
SPLIT_LAYERS = [
    ('type: "BatchNorm"', [(5, 7, 3, 2)], False),
    ('type: "BatchNorm"', [(5, 7, 3, 2)], True),
    ('type: "BatchNorm" batch_norm_param { use_global_stats: true }', [(5, 7, 3, 2)], False),
    ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
     'bias_filler { type: "gaussian" } }', [(5, 7, 3, 2)], False),
    ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
     'bias_filler { type: "gaussian" } }', [(5, 7, 3, 2)], True),
    ('type: "Scale" scale_param { axis: 0 }', [(5, 7, 3, 2), (5, 7)], False),
    ('type: "Eltwise" eltwise_param { operation: SUM coeff: 1 coeff: -2 coeff: 0.5 }',
     [(5, 7, 3, 2)] * 3, False),
    ('type: "Eltwise" eltwise_param { operation: PROD }', [(5, 7, 3, 2)] * 3, False),
    ('type: "Eltwise" eltwise_param { operation: MAX }', [(5, 7, 3, 2)] * 3, False),
    ('type: "ReLU"', [(5, 7, 3, 2)], False),
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 }', [(5, 7, 3, 2)], False),
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }',
     [(5, 3, 4, 5)], False),
]


def _run_split_layer(text, shapes, in_place):
    from poseidon.engine.blob import Blob
    from tests.engine.harness import blobs_from
    from poseidon.engine import rng
    rs = numpy.random.RandomState(4)
    rng.seed(3)                                       # the fillers
    layer = make_layer(text)
    bottom = blobs_from([rs.standard_normal(s) for s in shapes])
    top = [bottom[0]] if in_place else [Blob((), numpy.float64)]
    layer.setup(bottom, top)
    out = []
    for _ in range(2):                                # twice: running statistics, accumulation
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        out.append(top[0].data.copy())
        top[0].diff[...] = rs.standard_normal(top[0].shape)
        layer.backward(top, [True] * len(bottom), bottom)
        out += [b.diff.copy() for b in bottom]
    return out + [b.data.copy() for b in layer.blobs] + [b.diff.copy() for b in layer.blobs]


@pytest.mark.parametrize("text,shapes,in_place", SPLIT_LAYERS,
                         ids=[f"{t.split()[1]}-{i}" for i, (t, _, _) in enumerate(SPLIT_LAYERS)])
def test_split_layers_give_the_one_call_numbers(text, shapes, in_place, monkeypatch):
    """Split over 2 or 3 threads (the size threshold lowered to 0), and taken one sample or
    channel a call within each thread's range (normalization.RUN_BYTES, for the layers that
    make several passes), each channel or sample is computed exactly as in one call: the results
    are bitwise those of one call."""
    from poseidon.engine.layers import normalization
    results = []
    for threshold, workers, run_bytes in ((1 << 40, 1, 1 << 40), (0, 2, 1 << 40), (0, 3, 1 << 40),
                                          (0, 2, 1)):
        monkeypatch.setattr(parallel, "SPLIT_MIN_ELEMENTS", threshold)
        monkeypatch.setattr(parallel.parallel(), "workers", workers)
        monkeypatch.setattr(normalization, "RUN_BYTES", run_bytes)
        results.append(_run_split_layer(text, shapes, in_place))
    for other in results[1:]:
        assert len(other) == len(results[0])
        for a, b in zip(results[0], other):
            numpy.testing.assert_array_equal(a, b)


def test_split_backward_gives_the_one_call_numbers(monkeypatch):
    """Split's backward (the sum of its tops' gradients) over the cores."""
    from poseidon.engine.blob import Blob
    from tests.engine.harness import blobs_from
    results = []
    for threshold, workers in ((1 << 40, 1), (0, 2), (0, 3)):
        monkeypatch.setattr(parallel, "SPLIT_MIN_ELEMENTS", threshold)
        monkeypatch.setattr(parallel.parallel(), "workers", workers)
        rs = numpy.random.RandomState(5)
        layer = make_layer('type: "Split"')
        bottom = blobs_from([rs.standard_normal((5, 4, 3))])
        top = [Blob((), numpy.float64) for _ in range(3)]
        layer.setup(bottom, top)
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        for t in top:
            t.diff[...] = rs.standard_normal(t.shape)
        layer.backward(top, [True], bottom)
        numpy.testing.assert_allclose(bottom[0].diff, sum(t.diff for t in top), rtol=1e-15)
        results.append(bottom[0].diff.copy())
    for other in results[1:]:
        numpy.testing.assert_array_equal(results[0], other)
