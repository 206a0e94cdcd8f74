"""Softmax, SoftmaxWithLoss, EuclideanLoss, Accuracy: loop references, gradient checks, errors."""
import math

import numpy
import pytest

from poseidon.engine.blob import Blob
from poseidon.engine.errors import LayerError
from tests.engine.harness import check_gradient, make_layer, run_forward

FLT_MIN = float(numpy.finfo(numpy.float32).tiny)


def split3(shape, axis):
    axis = axis % len(shape)
    return (int(numpy.prod(shape[:axis])), shape[axis], int(numpy.prod(shape[axis + 1:])))


def softmax_ref(x, axis):
    outer, c, inner = split3(x.shape, axis)
    x3 = x.reshape(outer, c, inner)
    y = numpy.empty_like(x3)
    for o in range(outer):
        for i in range(inner):
            col = [x3[o, k, i] for k in range(c)]
            m = max(col)
            e = [math.exp(v - m) for v in col]
            for k in range(c):
                y[o, k, i] = e[k] / sum(e)
    return y.reshape(x.shape)


def labels_for(shape, axis, seed=0, ignore=None, n_ignored=0):
    outer, c, inner = split3(shape, axis)
    lab = numpy.random.RandomState(seed).randint(0, c, outer * inner).astype(float)
    if ignore is not None:
        lab[:n_ignored] = ignore
    axis = axis % len(shape)
    return lab.reshape(shape[:axis] + shape[axis + 1:])   # same first dimension as the scores


# ----- Softmax ---------------------------------------------------------------------------------
SOFTMAX_CASES = [((2, 3, 2, 2), ""), ((2, 3, 4), "softmax_param { axis: 2 }"),
                 ((3, 2, 4), "softmax_param { axis: -1 }"), ((4, 3), "softmax_param { axis: 0 }")]


@pytest.mark.parametrize("shape,extra", SOFTMAX_CASES)
def test_softmax_forward_and_gradient(shape, extra):
    axis = int(extra.split("axis:")[1].split()[0]) if "axis" in extra else 1
    x = numpy.random.RandomState(1).standard_normal(shape) * 3
    x.reshape(-1)[0] = 700.0   # stable: the max is subtracted
    _, top = run_forward(make_layer(f'type: "Softmax" {extra}'), [x])
    numpy.testing.assert_allclose(top[0].data, softmax_ref(x, axis), rtol=1e-12, atol=1e-300)
    check_gradient(make_layer(f'type: "Softmax" {extra}'), [x / 3 if x.size else x])


def test_softmax_in_place():
    x = numpy.random.RandomState(2).standard_normal((2, 4, 3))
    dy = numpy.random.RandomState(3).standard_normal(x.shape)
    ref_layer = make_layer('type: "Softmax"')
    bottom, top = run_forward(ref_layer, [x])
    top[0].diff[...] = dy
    ref_layer.backward(top, [True], bottom)
    b = Blob(x.shape, numpy.float64)
    b.data[...] = x
    layer = make_layer('type: "Softmax"')
    layer.setup([b], [b])
    layer.forward([b], [b])
    numpy.testing.assert_array_equal(b.data, top[0].data)
    b.diff[...] = dy
    layer.backward([b], [True], [b])
    numpy.testing.assert_allclose(b.diff, bottom[0].diff, rtol=1e-12, atol=1e-15)


def test_softmax_axis_error():
    with pytest.raises(LayerError, match=r"axis 3 is out of range.*\(2, 3\)"):
        run_forward(make_layer('type: "Softmax" softmax_param { axis: 3 }'), [numpy.ones((2, 3))])


# ----- SoftmaxWithLoss -------------------------------------------------------------------------
def swl_text(loss_param="", axis=None):
    text = 'type: "SoftmaxWithLoss"'
    if loss_param:
        text += f" loss_param {{ {loss_param} }}"
    if axis is not None:
        text += f" softmax_param {{ axis: {axis} }}"
    return text


def swl_ref(x, labels, axis=1, mode="VALID", ignore=None):
    """Caffe's loops: −Σ log max(p_label, FLT_MIN) over non-ignored positions / normalizer."""
    p = softmax_ref(x, axis)
    outer, c, inner = split3(x.shape, axis)
    p3 = p.reshape(outer, c, inner)
    lab = labels.reshape(outer, inner)
    loss, count = 0.0, 0
    for o in range(outer):
        for i in range(inner):
            v = int(lab[o, i])
            if ignore is not None and v == ignore:
                continue
            loss -= math.log(max(p3[o, v, i], FLT_MIN))
            count += 1
    norm = {"FULL": outer * inner, "VALID": count, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return loss / max(norm, 1), p


MODES = ["FULL", "VALID", "BATCH_SIZE", "NONE"]
SWL_CASES = [  # (shape, axis or None, ignore)
    ((4, 5), None, None),
    ((2, 3, 2, 2), None, None),         # spatial: one label per (n, h, w)
    ((2, 3, 2, 2), None, 1),
    ((2, 4, 3), 2, None),               # classes on the last axis: labels (2, 4)
    ((3, 2, 4), -1, 0),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,axis,ignore", SWL_CASES)
def test_softmax_with_loss_forward(mode, shape, axis, ignore):
    x = numpy.random.RandomState(4).standard_normal(shape) * 2
    lab = labels_for(shape, 1 if axis is None else axis, ignore=ignore, n_ignored=3)
    lp = f"normalization: {mode}" + ("" if ignore is None else f" ignore_label: {ignore}")
    layer = make_layer(swl_text(lp, axis))
    _, top = run_forward(layer, [x, lab], n_tops=2)
    loss, p = swl_ref(x, lab, 1 if axis is None else axis, mode, ignore)
    assert top[0].shape == ()
    assert float(top[0].data) == pytest.approx(loss, rel=1e-12)
    numpy.testing.assert_allclose(top[1].data, p, rtol=1e-12)
    assert layer.loss_weights == [1.0, 0.0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,axis,ignore", SWL_CASES)
def test_softmax_with_loss_gradient(mode, shape, axis, ignore):
    x = numpy.random.RandomState(5).standard_normal(shape)
    lab = labels_for(shape, 1 if axis is None else axis, seed=1, ignore=ignore, n_ignored=3)
    lp = f"normalization: {mode}" + ("" if ignore is None else f" ignore_label: {ignore}")
    check_gradient(make_layer(swl_text(lp, axis)), [x, lab], check_bottoms=[0])


def test_softmax_with_loss_gradient_with_the_probability_top():
    x = numpy.random.RandomState(6).standard_normal((3, 4))
    check_gradient(make_layer(swl_text()), [x, labels_for((3, 4), 1)], n_tops=2,
                   check_bottoms=[0], top_indices=[0])


@pytest.mark.parametrize("legacy,mode", [("normalize: true", "VALID"),
                                         ("normalize: false", "BATCH_SIZE"),
                                         ("normalize: false normalization: FULL", "FULL"),
                                         ("", "VALID")])
def test_softmax_with_loss_legacy_normalize(legacy, mode):
    shape = (2, 3, 2, 2)
    x = numpy.random.RandomState(7).standard_normal(shape)
    lab = labels_for(shape, 1, ignore=2, n_ignored=3)
    _, top = run_forward(make_layer(swl_text(f"{legacy} ignore_label: 2")), [x, lab])
    assert float(top[0].data) == pytest.approx(swl_ref(x, lab, 1, mode, 2)[0], rel=1e-12)


def test_softmax_with_loss_normalizer_clamped_to_one():
    x = numpy.random.RandomState(8).standard_normal((2, 3))
    for mode in ("VALID", "FULL", "BATCH_SIZE"):
        layer = make_layer(swl_text(f"normalization: {mode} ignore_label: 0"))
        bottom, top = run_forward(layer, [x, [0.0, 0.0]])      # everything ignored
        assert float(top[0].data) == 0.0
        top[0].diff[...] = 1.0
        layer.backward(top, [True, False], bottom)
        assert not bottom[0].diff.any()
    # one valid position and VALID: normalizer 1, loss = −log p
    layer = make_layer(swl_text("ignore_label: 0"))
    _, top = run_forward(layer, [x, [0.0, 2.0]])
    assert float(top[0].data) == pytest.approx(-math.log(softmax_ref(x, 1)[1, 2]), rel=1e-12)


def test_softmax_with_loss_backward_scales_by_the_loss_weight():
    shape = (2, 3, 2)
    x = numpy.random.RandomState(9).standard_normal(shape)
    lab = numpy.array([[0.0, 2.0], [1.0, 255.0]])
    layer = make_layer(swl_text("ignore_label: 255"))
    bottom, top = run_forward(layer, [x, lab])
    top[0].diff[...] = 2.5
    layer.backward(top, [True, False], bottom)
    p = softmax_ref(x, 1)
    expected = p.copy()
    for o, i, v in [(0, 0, 0), (0, 1, 2), (1, 0, 1)]:
        expected[o, v, i] -= 1
    expected[1, :, 1] = 0          # ignored
    numpy.testing.assert_allclose(bottom[0].diff, expected * 2.5 / 3, rtol=1e-12, atol=1e-15)


def test_softmax_with_loss_clamps_tiny_probabilities():
    x = numpy.array([[0.0, -1000.0]])
    _, top = run_forward(make_layer(swl_text()), [x, [1.0]])
    assert float(top[0].data) == pytest.approx(-math.log(FLT_MIN))


def test_softmax_with_loss_float32():
    x = numpy.random.RandomState(10).standard_normal((8, 10)).astype(numpy.float32)
    layer = make_layer(swl_text(), dtype=numpy.float32)
    bottom, top = run_forward(layer, [x, labels_for((8, 10), 1)], dtype=numpy.float32)
    top[0].diff[...] = 1
    layer.backward(top, [True, False], bottom)
    assert top[0].data.dtype == bottom[0].diff.dtype == numpy.float32
    assert float(top[0].data) == pytest.approx(swl_ref(x.astype(float), labels_for((8, 10), 1))[0],
                                               rel=1e-5)


def test_softmax_with_loss_label_rules():
    layer = make_layer(swl_text())
    assert layer.is_loss and layer.allow_force_backward(0) and not layer.allow_force_backward(1)
    bottom, top = run_forward(layer, [numpy.ones((2, 3)), [0.0, 1.0]])
    top[0].diff[...] = 1
    with pytest.raises(LayerError, match="label"):
        layer.backward(top, [True, True], bottom)
    with pytest.raises(LayerError, match=r"\(2, 2\).*4 labels.*\(2, 3, 2\).*need 6"):
        run_forward(make_layer(swl_text(axis=2)), [numpy.ones((2, 3, 2)), numpy.ones((2, 2))])
    with pytest.raises(LayerError, match=r"\(2, 3, 2, 2\).*\(3,\).*first dimension"):
        run_forward(make_layer(swl_text()), [numpy.ones((2, 3, 2, 2)), numpy.ones(3)])
    with pytest.raises(LayerError, match="label 3 is not a class index in \\[0, 3\\)"):
        run_forward(make_layer(swl_text()), [numpy.ones((2, 3)), [0.0, 3.0]])
    with pytest.raises(LayerError, match="label -1 "):
        run_forward(make_layer(swl_text("ignore_label: 5")), [numpy.ones((2, 3)), [-1.0, 5.0]])
    with pytest.raises(LayerError, match="axis 2 is out of range"):
        run_forward(make_layer(swl_text(axis=2)), [numpy.ones((2, 3)), [0.0, 1.0]])


# ----- EuclideanLoss ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape_b", [(3, 2, 2), (3, 4)])
def test_euclidean_loss(shape_b):
    rs = numpy.random.RandomState(11)
    a, b = rs.standard_normal((3, 2, 2)), rs.standard_normal(shape_b)
    layer = make_layer('type: "EuclideanLoss"')
    assert layer.is_loss and layer.allow_force_backward(1)
    _, top = run_forward(layer, [a, b])
    fa, fb = a.reshape(-1), b.reshape(-1)
    ref = sum((fa[k] - fb[k]) ** 2 for k in range(fa.size)) / (2 * 3)
    assert top[0].shape == () and float(top[0].data) == pytest.approx(ref, rel=1e-12)
    check_gradient(make_layer('type: "EuclideanLoss"'), [a, b])


def test_euclidean_loss_weight_and_errors():
    a, b = numpy.ones((2, 3)), numpy.zeros((2, 3))
    layer = make_layer('type: "EuclideanLoss" loss_weight: 3')
    bottom, top = run_forward(layer, [a, b])
    top[0].diff[...] = 3.0
    layer.backward(top, [True, True], bottom)
    numpy.testing.assert_allclose(bottom[0].diff, 1.5)
    numpy.testing.assert_allclose(bottom[1].diff, -1.5)
    with pytest.raises(LayerError, match=r"\(2, 3\).*\(2, 4\)"):
        run_forward(make_layer('type: "EuclideanLoss"'), [a, numpy.ones((2, 4))])
    with pytest.raises(LayerError, match="first dimension"):
        run_forward(make_layer('type: "EuclideanLoss"'), [a, numpy.ones((3, 2))])


# ----- Accuracy --------------------------------------------------------------------------------
def accuracy_ref(x, labels, axis=1, top_k=1, ignore=None):
    """Caffe's loops: correct when fewer than top_k classes other than the truth score >= it."""
    outer, c, inner = split3(x.shape, axis)
    x3, lab = x.reshape(outer, c, inner), labels.reshape(outer, inner)
    hits, count = 0, 0
    per_hit, per_seen = numpy.zeros(c), numpy.zeros(c)
    for o in range(outer):
        for i in range(inner):
            v = int(lab[o, i])
            if ignore is not None and v == ignore:
                continue
            per_seen[v] += 1
            better = -1
            for k in range(c):
                better += x3[o, k, i] >= x3[o, v, i]
            if better < top_k:
                hits += 1
                per_hit[v] += 1
            count += 1
    per = numpy.array([h / s if s else 0.0 for h, s in zip(per_hit, per_seen)])
    return (hits / count if count else 0.0), per


def acc_text(extra=""):
    return f'type: "Accuracy" accuracy_param {{ {extra} }}'


ACC_CASES = [  # (shape, extra, axis, top_k, ignore)
    ((20, 5), "", 1, 1, None),
    ((20, 5), "top_k: 2", 1, 2, None),
    ((20, 5), "top_k: 5", 1, 5, None),
    ((4, 3, 2, 2), "ignore_label: 1", 1, 1, 1),
    ((4, 3, 5), "axis: 2 top_k: 2", 2, 2, None),
    ((4, 3, 5), "axis: -1 ignore_label: 0", 2, 1, 0),
]


@pytest.mark.parametrize("shape,extra,axis,top_k,ignore", ACC_CASES)
def test_accuracy(shape, extra, axis, top_k, ignore):
    rs = numpy.random.RandomState(12)
    x = rs.randint(0, 3, shape).astype(float)     # few values: many ties
    lab = labels_for(shape, axis, seed=3, ignore=ignore, n_ignored=4)
    layer = make_layer(acc_text(extra))
    _, top = run_forward(layer, [x, lab], n_tops=2)
    acc, per = accuracy_ref(x, lab, axis, top_k, ignore)
    assert top[0].shape == () and float(top[0].data) == pytest.approx(acc, rel=1e-12)
    numpy.testing.assert_allclose(top[1].data, per, rtol=1e-12)
    assert layer.loss_weights == [0.0, 0.0]


def test_accuracy_ties_count_against_the_true_class():
    x = numpy.array([[1.0, 1.0, 0.0], [2.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    lab = numpy.array([0.0, 0.0, 2.0])
    _, top = run_forward(make_layer(acc_text()), [x, lab])
    assert float(top[0].data) == pytest.approx(1 / 3)       # only row 1 is a clear win
    _, top = run_forward(make_layer(acc_text("top_k: 2")), [x, lab])
    assert float(top[0].data) == pytest.approx(2 / 3)       # row 2: three-way tie, still out


def test_accuracy_all_ignored_is_zero_and_float32():
    _, top = run_forward(make_layer(acc_text("ignore_label: 1")), [numpy.ones((2, 3)), [1.0, 1.0]],
                         n_tops=2)
    assert float(top[0].data) == 0.0 and not top[1].data.any()
    layer = make_layer(acc_text(), dtype=numpy.float32)
    _, top = run_forward(layer, [numpy.eye(3, dtype=numpy.float32), [0.0, 1.0, 0.0]],
                         dtype=numpy.float32)
    assert top[0].data.dtype == numpy.float32 and float(top[0].data) == pytest.approx(2 / 3)


def test_accuracy_errors():
    with pytest.raises(LayerError, match=r"top_k 4 .*3"):
        run_forward(make_layer(acc_text("top_k: 4")), [numpy.ones((2, 3)), [0.0, 1.0]])
    with pytest.raises(LayerError, match=r"\(3,\).*3 labels.*\(2, 3\).*need 2"):
        run_forward(make_layer(acc_text()), [numpy.ones((2, 3)), [0.0, 1.0, 0.0]])
    with pytest.raises(LayerError, match="label 7"):
        run_forward(make_layer(acc_text()), [numpy.ones((2, 3)), [0.0, 7.0]])
    layer = make_layer(acc_text())
    assert not layer.allow_force_backward(0) and not layer.allow_force_backward(1)
    bottom, top = run_forward(layer, [numpy.ones((2, 3)), [0.0, 1.0]])
    layer.backward(top, [False, False], bottom)                  # nothing asked: fine
    with pytest.raises(LayerError, match="no gradient"):
        layer.backward(top, [True, False], bottom)
