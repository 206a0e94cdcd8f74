"""ReLU, Sigmoid, TanH, PReLU and Dropout: references, gradient checks, in-place runs, errors."""
import numpy
import pytest

from poseidon.engine import rng
from poseidon.engine.blob import Blob
from poseidon.engine.errors import LayerError
from poseidon.engine.layer import TEST, TRAIN
from poseidon.engine.layers.activation import ZERO_ROW_LENGTH, relu_into
from tests.engine.harness import check_gradient, make_layer, run_forward

SHAPE = (2, 3, 2, 2)


def away_from_zero(shape=SHAPE, seed=0):
    """Inputs with |x| in [0.1, 1.1): finite differences never straddle the kink at 0."""
    rs = numpy.random.RandomState(seed)
    return numpy.where(rs.rand(*shape) < 0.5, -1, 1) * (0.1 + rs.rand(*shape))


def run_in_place(layer, x, dy, phase_seed=None):
    """Set up and run with top[0] is bottom[0]; returns (output, bottom diff) copies."""
    b = Blob(x.shape, numpy.float64)
    b.data[...] = x
    layer.setup([b], [b])
    layer.reshape([b], [b])
    if phase_seed is not None:
        rng.seed(phase_seed)
    layer.forward([b], [b])
    y = b.data.copy()
    b.diff[...] = dy
    layer.backward([b], [True], [b])
    return y, b.diff.copy()


def run_apart(layer, x, dy, phase_seed=None):
    b, t = Blob(x.shape, numpy.float64), Blob((), numpy.float64)
    b.data[...] = x
    layer.setup([b], [t])
    layer.reshape([b], [t])
    if phase_seed is not None:
        rng.seed(phase_seed)
    layer.forward([b], [t])
    t.diff[...] = dy
    layer.backward([t], [True], [b])
    numpy.testing.assert_array_equal(b.data, x)     # the input is left alone
    return t.data.copy(), b.diff.copy()


def assert_in_place_same(text, x, seed=None):
    dy = numpy.random.RandomState(9).standard_normal(x.shape)
    rng.seed(3)
    apart_layer = make_layer(text)
    y1, dx1 = run_apart(apart_layer, x, dy, seed)
    rng.seed(3)
    in_place_layer = make_layer(text)
    y2, dx2 = run_in_place(in_place_layer, x, dy, seed)
    numpy.testing.assert_array_equal(y1, y2)
    numpy.testing.assert_array_equal(dx1, dx2)
    return apart_layer, in_place_layer


# ----- ReLU ------------------------------------------------------------------------------------
SLOPES = [0.0, 0.1, 1.0, 2.5, -0.5]


def relu_text(slope):
    return f'type: "ReLU" relu_param {{ negative_slope: {slope} }}'


@pytest.mark.parametrize("slope", SLOPES)
def test_relu_forward(slope):
    x = away_from_zero()
    x.reshape(-1)[:3] = 0.0
    _, top = run_forward(make_layer(relu_text(slope)), [x])
    slope = float(numpy.float32(slope))   # proto floats are float32, as in Caffe
    ref = numpy.array([max(v, 0.0) + slope * min(v, 0.0) for v in x.reshape(-1)]).reshape(x.shape)
    numpy.testing.assert_array_equal(top[0].data, ref)


@pytest.mark.parametrize("slope", SLOPES)
def test_relu_gradient(slope):
    check_gradient(make_layer(relu_text(slope)), [away_from_zero()])


@pytest.mark.parametrize("slope", SLOPES)
def test_relu_in_place(slope):
    assert_in_place_same(relu_text(slope), away_from_zero())


def test_relu_backward_at_zero_uses_the_negative_side():
    layer = make_layer(relu_text(0.25))
    bottom, top = run_forward(layer, [numpy.array([0.0, 1.0, -1.0])])
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    numpy.testing.assert_array_equal(bottom[0].diff, [0.25, 1.0, 0.25])


def test_relu_float32():
    layer = make_layer(relu_text(0.1), dtype=numpy.float32)
    x = away_from_zero().astype(numpy.float32)
    bottom, top = run_forward(layer, [x], dtype=numpy.float32)
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert top[0].data.dtype == bottom[0].diff.dtype == numpy.float32
    numpy.testing.assert_array_equal(top[0].data, numpy.where(x > 0, x, x * numpy.float32(0.1)))


# ----- Sigmoid / TanH --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
@pytest.mark.parametrize("size", [5, ZERO_ROW_LENGTH, 3 * ZERO_ROW_LENGTH, 3 * ZERO_ROW_LENGTH + 7])
def test_relu_into_matches_maximum(size, dtype):
    """The rows-against-zeros ReLU (relu_into) equals numpy.maximum(x, 0) on every element, the
    rows' bulk and the tail alike, into another array and in place; NaN stays NaN."""
    x = numpy.random.RandomState(size).standard_normal(size).astype(dtype)
    x[size // 2] = numpy.nan
    expected = numpy.maximum(x, 0)
    out = numpy.full_like(x, 7)
    relu_into(x, out, numpy)
    numpy.testing.assert_array_equal(out, expected)
    relu_into(x, x, numpy)
    numpy.testing.assert_array_equal(x, expected)


def test_relu_layer_on_a_large_blob_forward_and_backward():
    """A ReLU large enough for the rows path, on several threads: forward is max(x, 0), the
    backward passes the gradient where the output is positive."""
    x = numpy.random.RandomState(3).standard_normal((4, 3, 40, 50)).astype(numpy.float32)
    layer = make_layer('type: "ReLU"', dtype=numpy.float32)
    bottom, top = run_forward(layer, [x], dtype=numpy.float32)
    numpy.testing.assert_array_equal(top[0].data, numpy.maximum(x, 0))
    dy = numpy.random.RandomState(4).standard_normal(x.shape).astype(numpy.float32)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    numpy.testing.assert_array_equal(bottom[0].diff, dy * (x > 0))


def test_sigmoid_forward():
    x = numpy.random.RandomState(1).standard_normal(SHAPE) * 3
    x.reshape(-1)[:2] = [-800.0, 800.0]   # no overflow
    _, top = run_forward(make_layer('type: "Sigmoid"'), [x])
    ref = numpy.array([1.0 / (1.0 + numpy.exp(-v)) if v > -700 else 0.0 for v in x.reshape(-1)])
    numpy.testing.assert_allclose(top[0].data.reshape(-1), ref, rtol=1e-12, atol=1e-15)


def test_tanh_forward():
    x = numpy.random.RandomState(2).standard_normal(SHAPE) * 2
    _, top = run_forward(make_layer('type: "TanH"'), [x])
    ref = numpy.array([numpy.tanh(v) for v in x.reshape(-1)]).reshape(x.shape)
    numpy.testing.assert_allclose(top[0].data, ref, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", ["Sigmoid", "TanH"])
def test_sigmoid_tanh_gradient_and_in_place(kind):
    x = numpy.random.RandomState(3).standard_normal(SHAPE)
    check_gradient(make_layer(f'type: "{kind}"'), [x])
    assert_in_place_same(f'type: "{kind}"', x)


# ----- PReLU -----------------------------------------------------------------------------------
def prelu_ref(x, a, shared):
    y = numpy.empty_like(x)
    for idx in numpy.ndindex(x.shape):
        slope = float(a) if shared else a[idx[1]]
        y[idx] = max(x[idx], 0.0) + slope * min(x[idx], 0.0)
    return y


PRELU = {
    "default": 'type: "PReLU"',
    "filler": 'type: "PReLU" prelu_param { filler { type: "uniform" min: -0.5 max: 1.5 } }',
    "shared": 'type: "PReLU" prelu_param { channel_shared: true '
              'filler { type: "constant" value: 0.3 } }',
}


def test_prelu_default_filler_and_shapes():
    layer = make_layer(PRELU["default"])
    run_forward(layer, [away_from_zero()])
    assert layer.blobs[0].shape == (3,) and (layer.blobs[0].data == 0.25).all()
    layer = make_layer(PRELU["shared"])
    run_forward(layer, [away_from_zero()])
    assert layer.blobs[0].shape == () and float(layer.blobs[0].data) == pytest.approx(0.3)


@pytest.mark.parametrize("config", list(PRELU))
@pytest.mark.parametrize("shape", [SHAPE, (3, 4), (2, 3, 5)])
def test_prelu_forward(config, shape):
    rng.seed(11)
    layer = make_layer(PRELU[config])
    x = away_from_zero(shape)
    _, top = run_forward(layer, [x])
    numpy.testing.assert_allclose(top[0].data, prelu_ref(x, layer.blobs[0].data,
                                                         config == "shared"), rtol=1e-15)


@pytest.mark.parametrize("config", list(PRELU))
def test_prelu_gradient(config):
    rng.seed(12)
    check_gradient(make_layer(PRELU[config]), [away_from_zero((2, 3, 3))])


@pytest.mark.parametrize("config", list(PRELU))
def test_prelu_in_place_keeps_its_input(config):
    apart, in_place = assert_in_place_same(PRELU[config], away_from_zero())
    numpy.testing.assert_array_equal(apart.blobs[0].diff, in_place.blobs[0].diff)
    assert apart.blobs[0].diff.any()


def test_prelu_errors():
    with pytest.raises(LayerError, match="at least 2 axes"):
        run_forward(make_layer(PRELU["default"]), [numpy.ones(4)])
    layer = make_layer(PRELU["default"])
    bottom, top = run_forward(layer, [numpy.ones((2, 3))])
    with pytest.raises(LayerError, match=r"\(2, 4\).*3 channels"):
        layer.reshape([Blob((2, 4), numpy.float64)], top)


# ----- Dropout ---------------------------------------------------------------------------------
def dropout_text(ratio=0.5):
    return f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}'


@pytest.mark.parametrize("ratio", [0.5, 0.2, 0.0])
def test_dropout_train_forward(ratio):
    x = numpy.random.RandomState(4).standard_normal((50, 40)) + 3.0
    rng.seed(21)
    layer = make_layer(dropout_text(ratio))
    _, top = run_forward(layer, [x])
    ratio = float(numpy.float32(ratio))   # proto floats are float32, as in Caffe
    scale = 1.0 / (1.0 - ratio)
    kept = top[0].data != 0
    numpy.testing.assert_allclose(top[0].data[kept], x[kept] * scale, rtol=1e-15)
    assert abs(kept.mean() - (1 - ratio)) < 0.05
    numpy.testing.assert_array_equal(layer.mask, kept * scale)
    # the mask is the stream's: U[0,1) >= ratio with the same seed
    rng.seed(21)
    u = rng.uniform(x.shape, numpy, numpy.float64)
    numpy.testing.assert_array_equal(kept, u >= ratio)


def test_dropout_masks_differ_between_forwards_and_repeat_with_the_seed():
    x = numpy.ones((20, 20))
    layer = make_layer(dropout_text())
    rng.seed(1)
    bottom, top = run_forward(layer, [x])
    first = top[0].data.copy()
    layer.forward(bottom, top)
    assert (top[0].data != first).any()
    rng.seed(1)
    layer.forward(bottom, top)
    numpy.testing.assert_array_equal(top[0].data, first)


def test_dropout_backward_uses_the_forward_mask():
    x = numpy.random.RandomState(5).standard_normal((6, 7))
    dy = numpy.random.RandomState(6).standard_normal((6, 7))
    rng.seed(2)
    layer = make_layer(dropout_text(0.3))
    bottom, top = run_forward(layer, [x])
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    numpy.testing.assert_allclose(bottom[0].diff, dy * layer.mask, rtol=1e-15)
    numpy.testing.assert_allclose(top[0].data, x * layer.mask, rtol=1e-15)


def test_dropout_gradient_within_one_mask():
    layer = make_layer(dropout_text(0.4))
    forward = layer.forward

    def forward_same_mask(bottom, top):
        rng.seed(77)                   # every forward of the check draws the same mask
        forward(bottom, top)

    layer.forward = forward_same_mask
    check_gradient(layer, [numpy.random.RandomState(7).standard_normal((3, 4, 2))])


def test_dropout_in_place():
    x = numpy.random.RandomState(8).standard_normal(SHAPE)
    apart, in_place = assert_in_place_same(dropout_text(0.5), x, seed=5)
    numpy.testing.assert_array_equal(apart.mask, in_place.mask)


def test_dropout_test_phase_is_identity():
    x = numpy.random.RandomState(9).standard_normal(SHAPE)
    layer = make_layer(dropout_text(), phase=TEST)
    bottom, top = run_forward(layer, [x])
    numpy.testing.assert_array_equal(top[0].data, x)
    top[0].diff[...] = 2.0
    layer.backward(top, [True], bottom)
    assert (bottom[0].diff == 2.0).all()
    b = Blob(x.shape, numpy.float64)
    b.data[...] = x
    layer = make_layer(dropout_text(), phase=TEST)
    layer.setup([b], [b])
    layer.forward([b], [b])
    numpy.testing.assert_array_equal(b.data, x)
    check_gradient(make_layer(dropout_text(), phase=TEST), [x])


def test_dropout_float32_and_ratio_errors():
    layer = make_layer(dropout_text(), phase=TRAIN, dtype=numpy.float32)
    _, top = run_forward(layer, [numpy.ones((4, 4), numpy.float32)], dtype=numpy.float32)
    assert top[0].data.dtype == numpy.float32 and layer.mask.dtype == numpy.float32
    assert set(numpy.unique(top[0].data)) <= {0.0, 2.0}
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(LayerError, match="dropout_ratio"):
            run_forward(make_layer(dropout_text(bad)), [numpy.ones(3)])
