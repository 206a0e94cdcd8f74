"""LRN, BatchNorm, Scale and Bias against plain references written from caffe-facts.md."""
import numpy
import pytest

from poseidon import engine
from poseidon.engine.blob import Blob
from poseidon.engine.layer import TEST, TRAIN
from tests.engine.harness import check_gradient, make_layer, run_forward

RS = numpy.random.RandomState(1234)


def rand(*shape):
    return RS.standard_normal(shape)


def f32(v):
    """A float proto field's value as the layer sees it."""
    return float(numpy.float32(v))


# ----- LRN ---------------------------------------------------------------------------------------
def lrn_across_ref(x, n, alpha, beta, k):
    N, C, H, W = x.shape
    pre = (n - 1) // 2
    alpha, beta, k = f32(alpha), f32(beta), f32(k)
    y = numpy.empty_like(x)
    for c in range(C):
        lo, hi = max(0, c - pre), min(C, c + pre + 1)
        s = k + alpha / n * (x[:, lo:hi] ** 2).sum(axis=1)
        y[:, c] = x[:, c] * s ** -beta
    return y


def lrn_within_ref(x, n, alpha, beta):
    N, C, H, W = x.shape
    pre = (n - 1) // 2
    alpha, beta = f32(alpha), f32(beta)
    y = numpy.empty_like(x)
    for h in range(H):
        for w in range(W):
            win = x[:, :, max(0, h - pre):h + pre + 1, max(0, w - pre):w + pre + 1]
            s = 1 + alpha / (n * n) * (win ** 2).sum(axis=(2, 3))
            y[:, :, h, w] = x[:, :, h, w] * s ** -beta
    return y


LRN_CASES = [
    ("", dict(n=5, alpha=1.0, beta=0.75, k=1.0)),
    ("lrn_param { local_size: 3 alpha: 0.5 beta: 0.6 k: 2 }", dict(n=3, alpha=0.5, beta=0.6, k=2.0)),
    ("lrn_param { local_size: 1 alpha: 2 beta: 1.5 k: 0.5 }", dict(n=1, alpha=2.0, beta=1.5, k=0.5)),
]


@pytest.mark.parametrize("text,cfg", LRN_CASES)
def test_lrn_across_channels_forward(text, cfg):
    x = rand(2, 7, 3, 2) * 2
    _, top = run_forward(make_layer('type: "LRN" ' + text), [x])
    numpy.testing.assert_allclose(top[0].data, lrn_across_ref(x, **cfg), rtol=1e-12)


@pytest.mark.parametrize("n,alpha,beta,k", [(3, 1.0, 0.75, 5.0), (5, 0.3, 1.2, 1.0), (1, 2.0, 0.5, 3.0)])
def test_lrn_within_channel_forward_ignores_k(n, alpha, beta, k):
    x = rand(2, 2, 6, 5) * 2
    layer = make_layer(f'type: "LRN" lrn_param {{ norm_region: WITHIN_CHANNEL local_size: {n} '
                       f'alpha: {alpha} beta: {beta} k: {k} }}')
    _, top = run_forward(layer, [x])
    numpy.testing.assert_allclose(top[0].data, lrn_within_ref(x, n, alpha, beta), rtol=1e-12)


def test_lrn_float32():
    x = rand(2, 6, 3, 3).astype(numpy.float32)
    layer = make_layer('type: "LRN" lrn_param { local_size: 3 alpha: 0.1 }', dtype=numpy.float32)
    _, top = run_forward(layer, [x], dtype=numpy.float32)
    assert top[0].data.dtype == numpy.float32
    numpy.testing.assert_allclose(top[0].data, lrn_across_ref(x.astype(float), 3, 0.1, 0.75, 1.0),
                                  rtol=1e-5)


@pytest.mark.parametrize("text", [
    'lrn_param { local_size: 3 alpha: 0.8 beta: 0.75 k: 1.5 }',
    'lrn_param { local_size: 5 alpha: 2 beta: 0.6 }',
    'lrn_param { norm_region: WITHIN_CHANNEL local_size: 3 alpha: 2 beta: 0.75 }',
    'lrn_param { norm_region: WITHIN_CHANNEL local_size: 5 alpha: 1.5 beta: 1.1 k: 4 }',
])
def test_lrn_gradient(text):
    check_gradient(make_layer('type: "LRN" ' + text), [rand(2, 5, 4, 3)])


@pytest.mark.parametrize("text", [
    'lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }',
    'lrn_param { local_size: 3 alpha: 0.8 beta: 0.6 k: 1.5 }',
    'lrn_param { norm_region: WITHIN_CHANNEL local_size: 3 alpha: 2 beta: 0.75 }',
])
def test_lrn_runs_of_samples_are_bitwise_the_whole_batch(text, monkeypatch):
    """The passes taken one sample at a time (normalization.RUN_BYTES) give the very numbers of
    the whole range at once, forward and backward, in float32, twice (scratch reused)."""
    from poseidon.engine.layers import normalization
    rs = numpy.random.RandomState(9)
    xs = [rs.standard_normal((5, 6, 4, 3)).astype(numpy.float32) * 3 for _ in range(2)]
    dys = [rs.standard_normal((5, 6, 4, 3)).astype(numpy.float32) for _ in range(2)]
    got = {}
    for run_bytes in (1 << 40, 1):
        monkeypatch.setattr(normalization, "RUN_BYTES", run_bytes)
        layer = make_layer('type: "LRN" ' + text, dtype=numpy.float32)
        bottom, top = run_forward(layer, [xs[0]], dtype=numpy.float32)
        for x, dy in zip(xs, dys):
            bottom[0].data[...] = x
            layer.forward(bottom, top)
            top[0].diff[...] = dy
            layer.backward(top, [True], bottom)
            got.setdefault(run_bytes, []).append((top[0].data.copy(), bottom[0].diff.copy()))
    for (y_all, dx_all), (y_one, dx_one) in zip(got[1 << 40], got[1]):
        numpy.testing.assert_array_equal(y_one, y_all)
        numpy.testing.assert_array_equal(dx_one, dx_all)


def test_lrn_errors():
    with pytest.raises(engine.errors.LayerError, match="odd"):
        run_forward(make_layer('type: "LRN" lrn_param { local_size: 4 }'), [rand(1, 5, 2, 2)])
    with pytest.raises(engine.errors.LayerError, match="4-axis"):
        run_forward(make_layer('type: "LRN"'), [rand(2, 5)])


# ----- BatchNorm ---------------------------------------------------------------------------------
def bn_ref(x, mean, var, eps=1e-5):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / numpy.sqrt(var.reshape(shape) + eps)


def batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    return x.mean(axis=axes), x.var(axis=axes)


@pytest.mark.parametrize("shape", [(4, 3, 2, 5), (6, 4), (3, 2, 7)])
def test_batchnorm_train_uses_batch_statistics(shape):
    x = rand(*shape) * 3 + 1
    layer = make_layer('type: "BatchNorm"')
    _, top = run_forward(layer, [x])
    mean, var = batch_stats(x)
    numpy.testing.assert_allclose(top[0].data, bn_ref(x, mean, var), rtol=1e-10, atol=1e-12)
    assert [b.shape for b in layer.blobs] == [(shape[1],), (shape[1],), (1,)]
    assert layer.param_propagate_down == [False, False, False] and layer.stores_statistics
    assert [p.lr_mult for p in layer.param.param] == [0, 0, 0]


def test_batchnorm_running_statistics_two_forwards():
    maf, eps = 0.9, 1e-3
    x1, x2 = rand(3, 2, 2, 2) + 1, rand(5, 2, 2, 2) * 2 - 1
    layer = make_layer(f'type: "BatchNorm" batch_norm_param {{ moving_average_fraction: {maf} '
                       f'eps: {eps} }}')
    bottom, top = run_forward(layer, [x1])
    bottom[0].reshape(x2.shape)
    bottom[0].data[...] = x2
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    mean1, var1 = batch_stats(x1)
    mean2, var2 = batch_stats(x2)
    m1, m2 = 3 * 4, 5 * 4
    maf = f32(maf)  # the proto field is a float
    exp0 = maf * mean1 + mean2
    exp1 = maf * var1 * m1 / (m1 - 1) + var2 * m2 / (m2 - 1)
    exp2 = maf * 1 + 1
    numpy.testing.assert_allclose(layer.blobs[0].data, exp0, rtol=1e-12)
    numpy.testing.assert_allclose(layer.blobs[1].data, exp1, rtol=1e-12)
    numpy.testing.assert_allclose(layer.blobs[2].data, [exp2], rtol=1e-12)
    numpy.testing.assert_allclose(top[0].data, bn_ref(x2, mean2, var2, f32(eps)),
                                  rtol=1e-10)

    # A TEST-phase layer (use_global_stats by default) with these blobs uses sum / normalizer.
    test_layer = make_layer(f'type: "BatchNorm" batch_norm_param {{ eps: {eps} }}', phase=TEST)
    x3 = rand(2, 2, 2, 2)
    b3 = [Blob(x3.shape, numpy.float64)]
    b3[0].data[...] = x3
    t3 = [Blob((), numpy.float64)]
    test_layer.setup(b3, t3)
    for dst, src in zip(test_layer.blobs, layer.blobs):
        dst.data[...] = src.data
    test_layer.reshape(b3, t3)
    test_layer.forward(b3, t3)
    numpy.testing.assert_allclose(
        t3[0].data, bn_ref(x3, exp0 / exp2, exp1 / exp2, f32(eps)), rtol=1e-10)
    numpy.testing.assert_allclose(test_layer.blobs[2].data, [exp2])  # not updated in TEST


def test_batchnorm_global_stats_with_zero_normalizer_uses_zero():
    x = rand(2, 3, 2)
    _, top = run_forward(make_layer('type: "BatchNorm"', phase=TEST), [x])
    numpy.testing.assert_allclose(top[0].data, x / numpy.sqrt(f32(1e-5)),
                                  rtol=1e-10)


def test_batchnorm_use_global_stats_overrides_phase():
    x = rand(4, 3, 2, 2)
    layer = make_layer('type: "BatchNorm" batch_norm_param { use_global_stats: false }', phase=TEST)
    _, top = run_forward(layer, [x])
    numpy.testing.assert_allclose(top[0].data, bn_ref(x, *batch_stats(x)), rtol=1e-10)
    assert layer.blobs[2].data[0] == 1
    layer = make_layer('type: "BatchNorm" batch_norm_param { use_global_stats: true }', phase=TRAIN)
    run_forward(layer, [x])
    assert layer.blobs[2].data[0] == 0


@pytest.mark.parametrize("shape", [(4, 3, 2, 2), (5, 3)])
def test_batchnorm_gradient_batch_statistics(shape):
    check_gradient(make_layer('type: "BatchNorm"'), [rand(*shape) * 2 + 0.5], check_params=False)


def _set_stats(layer, x):
    """Run set-up once, then give the layer non-trivial stored statistics."""
    run_forward(layer, [x])
    c = x.shape[1]
    layer.blobs[0].data[...] = RS.standard_normal(c) * 2.0
    layer.blobs[1].data[...] = RS.uniform(0.5, 2.0, c) * 2.0
    layer.blobs[2].data[...] = 2.0


@pytest.mark.parametrize("text,phase", [
    ('type: "BatchNorm" batch_norm_param { use_global_stats: true }', TRAIN),
    ('type: "BatchNorm"', TEST),
])
def test_batchnorm_gradient_global_stats(text, phase):
    x = rand(3, 4, 2, 2)
    layer = make_layer(text, phase=phase)
    _set_stats(layer, x)
    stats = [numpy.array(b.data) for b in layer.blobs]
    check_gradient(layer, [x], check_params=False)
    for b, s in zip(layer.blobs, stats):  # set-up again kept the stored statistics
        numpy.testing.assert_array_equal(b.data, s)
    _, top = run_forward(layer, [x])
    numpy.testing.assert_allclose(top[0].data, bn_ref(x, stats[0] / 2, stats[1] / 2), rtol=1e-10)


def run_in_place(layer, arrays, top_diff, extra_bottoms=()):
    """Set up and run layer with top[0] is bottom[0]; returns (output, bottom diffs, param diffs)."""
    bottom = []
    for a in [arrays[0]] + list(extra_bottoms):
        b = Blob(a.shape, numpy.float64)
        b.data[...] = a
        bottom.append(b)
    top = [bottom[0]]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    out = numpy.array(top[0].data)
    for p in layer.blobs:
        p.diff[...] = 0
    top[0].diff[...] = top_diff
    layer.backward(top, [True] * len(bottom), bottom)
    return out, [numpy.array(b.diff) for b in bottom], [numpy.array(p.diff) for p in layer.blobs]


def run_separate(layer, arrays, top_diff):
    bottom, top = run_forward(layer, arrays)
    for p in layer.blobs:
        p.diff[...] = 0
    top[0].diff[...] = top_diff
    layer.backward(top, [True] * len(bottom), bottom)
    return (numpy.array(top[0].data), [numpy.array(b.diff) for b in bottom],
            [numpy.array(p.diff) for p in layer.blobs])


def assert_same_runs(a, b):
    numpy.testing.assert_allclose(a[0], b[0], rtol=1e-12, atol=1e-14)
    for u, v in zip(a[1], b[1]):
        numpy.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-14)
    for u, v in zip(a[2], b[2]):
        numpy.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("text,phase", [
    ('type: "BatchNorm"', TRAIN),
    ('type: "BatchNorm"', TEST),
])
def test_batchnorm_in_place_matches(text, phase):
    x = rand(3, 4, 2, 3)
    dy = rand(*x.shape)
    sep = make_layer(text, phase=phase)
    inp = make_layer(text, phase=phase)
    if phase == TEST:
        _set_stats(sep, x)
        run_forward(inp, [x])
        for a, b in zip(inp.blobs, sep.blobs):
            a.data[...] = b.data
    a = run_separate(sep, [x], dy)
    b = run_in_place(inp, [x], dy)
    assert_same_runs(a, b)
    for u, v in zip(sep.blobs, inp.blobs):
        numpy.testing.assert_allclose(u.data, v.data, rtol=1e-12)


def test_batchnorm_refuses_learning_rate():
    layer = make_layer('type: "BatchNorm" param { lr_mult: 1 }')
    with pytest.raises(engine.errors.LayerError, match="lr_mult"):
        run_forward(layer, [rand(2, 3)])
    # three ParamSpecs are what old files carry: Caffe's upgrade clears them
    layer = make_layer('type: "BatchNorm" param { lr_mult: 1 } param { lr_mult: 1 } '
                       'param { lr_mult: 1 }')
    run_forward(layer, [rand(2, 3)])
    assert [p.lr_mult for p in layer.param.param] == [0, 0, 0]


# ----- Scale / Bias ------------------------------------------------------------------------------
def bcast(operand, x_ndim, axis):
    """Reshape operand (spanning axes axis..) to broadcast against an x of x_ndim axes."""
    return operand.reshape((1,) * axis + operand.shape + (1,) * (x_ndim - axis - operand.ndim))


SCALE_ONE_BOTTOM = [
    # (param text, x shape, operand shape, axis used for broadcasting)
    ("", (2, 3, 4), (3,), 1),
    ("axis: 0 num_axes: 2", (2, 3, 4), (2, 3), 0),
    ("axis: -1", (2, 3, 4), (4,), 2),
    ("axis: 1 num_axes: -1", (2, 3, 2, 2), (3, 2, 2), 1),
    ("num_axes: 0", (2, 3, 4), (), 0),
    ("axis: 2 num_axes: 2", (2, 3, 4, 2), (4, 2), 2),
]


@pytest.mark.parametrize("text,xshape,sshape,axis", SCALE_ONE_BOTTOM)
@pytest.mark.parametrize("bias", [False, True])
def test_scale_one_bottom_forward_and_gradient(text, xshape, sshape, axis, bias):
    x = rand(*xshape)
    extra = ' bias_term: true bias_filler { type: "gaussian" }' if bias else ""
    layer = make_layer(f'type: "Scale" scale_param {{ {text} filler {{ type: "gaussian" }}{extra} }}')
    _, top = run_forward(layer, [x])
    assert layer.blobs[0].shape == sshape
    s = numpy.array(layer.blobs[0].data)
    expect = x * bcast(s, x.ndim, axis)
    if bias:
        assert len(layer.blobs) == 2 and layer.blobs[1].shape == sshape
        expect = expect + bcast(numpy.array(layer.blobs[1].data), x.ndim, axis)
    numpy.testing.assert_allclose(top[0].data, expect, rtol=1e-12)
    check_gradient(layer, [x])


def test_scale_default_fillers_are_one_and_zero():
    layer = make_layer('type: "Scale" scale_param { bias_term: true }')
    x = rand(2, 3, 2)
    _, top = run_forward(layer, [x])
    numpy.testing.assert_array_equal(layer.blobs[0].data, numpy.ones(3))
    numpy.testing.assert_array_equal(layer.blobs[1].data, numpy.zeros(3))
    numpy.testing.assert_allclose(top[0].data, x)


SCALE_TWO_BOTTOMS = [
    ("", (2, 3, 4), (3,), 1),
    ("axis: 0", (2, 3, 4), (2, 3), 0),
    ("axis: 1", (2, 3, 4, 2), (3, 4), 1),
    ("axis: -2", (2, 3, 4), (3, 4), 1),
    ("", (2, 3, 4), (), 0),
]


@pytest.mark.parametrize("text,xshape,sshape,axis", SCALE_TWO_BOTTOMS)
@pytest.mark.parametrize("bias", [False, True])
def test_scale_two_bottoms_forward_and_gradient(text, xshape, sshape, axis, bias):
    x, s = rand(*xshape), rand(*sshape)
    extra = ' bias_term: true bias_filler { type: "gaussian" }' if bias else ""
    layer = make_layer(f'type: "Scale" scale_param {{ {text}{extra} }}')
    _, top = run_forward(layer, [x, s])
    expect = x * bcast(s, x.ndim, axis)
    if bias:
        assert len(layer.blobs) == 1 and layer.blobs[0].shape == sshape
        expect = expect + bcast(numpy.array(layer.blobs[0].data), x.ndim, axis)
    else:
        assert layer.blobs == []
    numpy.testing.assert_allclose(top[0].data, expect, rtol=1e-12)
    check_gradient(layer, [x, s])


@pytest.mark.parametrize("two", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_scale_in_place_matches(two, bias):
    x, s = rand(2, 3, 4), rand(3)
    dy = rand(2, 3, 4)
    text = ('type: "Scale" scale_param { filler { type: "gaussian" } bias_filler { type: "gaussian" }'
            + (' bias_term: true' if bias else '') + ' }')
    sep, inp = make_layer(text), make_layer(text)
    arrays = [x, s] if two else [x]
    a = run_separate(sep, arrays, dy)
    # give the in-place layer the same parameters
    run_forward(inp, arrays)
    for u, v in zip(inp.blobs, sep.blobs):
        u.data[...] = v.data
    b = run_in_place(inp, [x], dy, extra_bottoms=[s] if two else [])
    assert_same_runs(a, b)


def test_scale_float32():
    x = rand(2, 3, 4).astype(numpy.float32)
    layer = make_layer('type: "Scale" scale_param { filler { type: "constant" value: 2 } '
                       'bias_term: true }', dtype=numpy.float32)
    _, top = run_forward(layer, [x], dtype=numpy.float32)
    assert top[0].data.dtype == numpy.float32
    numpy.testing.assert_allclose(top[0].data, 2 * x, rtol=1e-6)


def test_scale_errors():
    with pytest.raises(engine.errors.LayerError, match="does not match"):
        run_forward(make_layer('type: "Scale"'), [rand(2, 3, 4), rand(4)])
    with pytest.raises(engine.errors.LayerError, match="extends past"):
        run_forward(make_layer('type: "Scale" scale_param { axis: 2 num_axes: 2 }'), [rand(2, 3, 4)])
    with pytest.raises(engine.errors.LayerError, match="extends past"):
        run_forward(make_layer('type: "Scale" scale_param { axis: 2 }'), [rand(2, 3, 4), rand(4, 2)])
    with pytest.raises(engine.errors.LayerError, match="out of range"):
        run_forward(make_layer('type: "Scale" scale_param { axis: 3 }'), [rand(2, 3, 4)])


@pytest.mark.parametrize("text,xshape,bshape,axis", SCALE_ONE_BOTTOM)
def test_bias_one_bottom_forward_and_gradient(text, xshape, bshape, axis):
    x = rand(*xshape)
    layer = make_layer(f'type: "Bias" bias_param {{ {text} filler {{ type: "gaussian" }} }}')
    _, top = run_forward(layer, [x])
    assert layer.blobs[0].shape == bshape
    b = numpy.array(layer.blobs[0].data)
    numpy.testing.assert_allclose(top[0].data, x + bcast(b, x.ndim, axis), rtol=1e-12)
    check_gradient(layer, [x])


def test_bias_default_filler_is_zero():
    layer = make_layer('type: "Bias"')
    run_forward(layer, [rand(2, 3)])
    numpy.testing.assert_array_equal(layer.blobs[0].data, numpy.zeros(3))


@pytest.mark.parametrize("text,xshape,bshape,axis", SCALE_TWO_BOTTOMS)
def test_bias_two_bottoms_forward_and_gradient(text, xshape, bshape, axis):
    x, b = rand(*xshape), rand(*bshape)
    layer = make_layer(f'type: "Bias" bias_param {{ {text} }}')
    _, top = run_forward(layer, [x, b])
    assert layer.blobs == []
    numpy.testing.assert_allclose(top[0].data, x + bcast(b, x.ndim, axis), rtol=1e-12)
    check_gradient(layer, [x, b])


def test_bias_in_place_matches():
    x, dy = rand(2, 3, 4), rand(2, 3, 4)
    text = 'type: "Bias" bias_param { filler { type: "gaussian" } }'
    sep, inp = make_layer(text), make_layer(text)
    a = run_separate(sep, [x], dy)
    run_forward(inp, [x])
    inp.blobs[0].data[...] = sep.blobs[0].data
    assert_same_runs(a, run_in_place(inp, [x], dy))


def test_param_diffs_accumulate():
    layer = make_layer('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } }')
    x = rand(2, 3)
    bottom, top = run_forward(layer, [x])
    top[0].diff[...] = 1.0
    for p in layer.blobs:
        p.diff[...] = 0
    layer.backward(top, [False], bottom)
    first = [numpy.array(p.diff) for p in layer.blobs]
    layer.backward(top, [False], bottom)
    for p, f in zip(layer.blobs, first):
        numpy.testing.assert_allclose(p.diff, 2 * f)
