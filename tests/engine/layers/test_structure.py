"""Concat, Slice, Split, Flatten, Reshape, Crop and Eltwise against plain references."""
import numpy
import pytest

from poseidon import engine
from poseidon.engine.blob import Blob
from tests.engine.harness import check_gradient, make_layer, run_forward

RS = numpy.random.RandomState(4321)
LayerError = engine.errors.LayerError


def rand(*shape):
    return RS.standard_normal(shape)


def f32(v):
    return float(numpy.float32(v))


# ----- Concat ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,shapes,axis", [
    ("", [(2, 3, 2), (2, 1, 2), (2, 2, 2)], 1),
    ("concat_param { axis: 0 }", [(1, 3, 2), (3, 3, 2)], 0),
    ("concat_param { axis: -1 }", [(2, 3, 1), (2, 3, 3)], 2),
    ("concat_param { concat_dim: 0 }", [(2, 2), (1, 2), (1, 2)], 0),
    ("concat_param { concat_dim: 1 }", [(2, 2), (2, 4)], 1),
])
def test_concat_forward_and_gradient(text, shapes, axis):
    arrays = [rand(*s) for s in shapes]
    layer = make_layer('type: "Concat" ' + text)
    _, top = run_forward(layer, arrays)
    numpy.testing.assert_array_equal(top[0].data, numpy.concatenate(arrays, axis=axis))
    check_gradient(layer, arrays)


def test_concat_single_bottom_passes_through():
    x = rand(2, 3)
    layer = make_layer('type: "Concat"')
    bottom, top = run_forward(layer, [x])
    numpy.testing.assert_array_equal(top[0].data, x)
    check_gradient(layer, [x])


def test_concat_errors():
    with pytest.raises(LayerError, match="all inputs must agree"):
        run_forward(make_layer('type: "Concat"'), [rand(2, 3, 4), rand(2, 3, 5)])
    with pytest.raises(LayerError, match="all inputs must agree"):
        run_forward(make_layer('type: "Concat"'), [rand(2, 3, 4), rand(2, 3)])
    with pytest.raises(LayerError, match="not both"):
        run_forward(make_layer('type: "Concat" concat_param { axis: 1 concat_dim: 1 }'),
                    [rand(2, 3), rand(2, 3)])
    with pytest.raises(LayerError, match="out of range"):
        run_forward(make_layer('type: "Concat" concat_param { concat_dim: 2 }'),
                    [rand(2, 3), rand(2, 3)])
    with pytest.raises(LayerError, match="out of range"):
        run_forward(make_layer('type: "Concat" concat_param { axis: -3 }'), [rand(2, 3), rand(2, 3)])


# ----- Slice -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,shape,n_tops,axis,points", [
    ("slice_param { slice_point: 1 slice_point: 3 }", (2, 5, 2), 3, 1, [1, 3]),
    ("slice_param { axis: 0 slice_point: 2 }", (5, 3), 2, 0, [2]),
    ("slice_param { axis: 0 }", (6, 2), 3, 0, [2, 4]),
    ("", (2, 4, 3), 2, 1, [2]),
    ("slice_param { axis: -1 slice_point: 1 }", (2, 2, 3), 2, 2, [1]),
    ("slice_param { slice_dim: 0 slice_point: 1 }", (3, 2), 2, 0, [1]),
])
def test_slice_forward_and_gradient(text, shape, n_tops, axis, points):
    x = rand(*shape)
    layer = make_layer('type: "Slice" ' + text)
    _, top = run_forward(layer, [x], n_tops)
    for t, ref in zip(top, numpy.split(x, points, axis=axis)):
        numpy.testing.assert_array_equal(t.data, ref)
    check_gradient(layer, [x], n_tops)


def test_slice_gradient_with_some_tops_unused():
    layer = make_layer('type: "Slice" slice_param { slice_point: 1 }')
    check_gradient(layer, [rand(2, 3)], 2, top_indices=[1])


def test_slice_single_top():
    x = rand(2, 3)
    layer = make_layer('type: "Slice"')
    _, top = run_forward(layer, [x], 1)
    numpy.testing.assert_array_equal(top[0].data, x)
    check_gradient(layer, [x], 1)


def test_slice_errors():
    with pytest.raises(LayerError, match="strictly increasing"):
        run_forward(make_layer('type: "Slice" slice_param { slice_point: 3 slice_point: 1 }'),
                    [rand(2, 5)], 3)
    with pytest.raises(LayerError, match="strictly increasing"):
        run_forward(make_layer('type: "Slice" slice_param { slice_point: 2 slice_point: 2 }'),
                    [rand(2, 5)], 3)
    with pytest.raises(LayerError, match="slice_point"):
        run_forward(make_layer('type: "Slice" slice_param { slice_point: 2 }'), [rand(2, 5)], 3)
    with pytest.raises(LayerError, match="outside axis"):
        run_forward(make_layer('type: "Slice" slice_param { slice_point: 5 }'), [rand(2, 5)], 2)
    with pytest.raises(LayerError, match="evenly divide"):
        run_forward(make_layer('type: "Slice"'), [rand(2, 5)], 2)
    with pytest.raises(LayerError, match="not both"):
        run_forward(make_layer('type: "Slice" slice_param { axis: 1 slice_dim: 1 }'), [rand(2, 4)], 2)


# ----- Split -------------------------------------------------------------------------------------
def test_split_shares_data_and_sums_diffs():
    x = rand(2, 3)
    layer = make_layer('type: "Split"')
    bottom, top = run_forward(layer, [x], 3)
    for t in top:
        numpy.testing.assert_array_equal(t.data, x)
    bottom[0].data[0, 0] = 42.0  # shared, not copied
    assert all(t.data[0, 0] == 42.0 for t in top)
    diffs = [rand(2, 3) for _ in top]
    for t, d in zip(top, diffs):
        t.diff[...] = d
    layer.backward(top, [True], bottom)
    numpy.testing.assert_allclose(bottom[0].diff, sum(diffs), rtol=1e-14)
    for t, d in zip(top, diffs):  # the tops' diffs are their own
        numpy.testing.assert_array_equal(t.diff, d)


@pytest.mark.parametrize("n_tops", [1, 2, 3])
def test_split_gradient(n_tops):
    check_gradient(make_layer('type: "Split"'), [rand(3, 2)], n_tops)


# ----- Flatten -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,shape,expect", [
    ("", (2, 3, 4, 5), (2, 60)),
    ("flatten_param { axis: 0 }", (2, 3, 4), (24,)),
    ("flatten_param { axis: 1 end_axis: 2 }", (2, 3, 4, 5), (2, 12, 5)),
    ("flatten_param { axis: -2 }", (2, 3, 4, 5), (2, 3, 20)),
    ("flatten_param { axis: 2 end_axis: 2 }", (2, 3, 4), (2, 3, 4)),
])
def test_flatten_forward_and_gradient(text, shape, expect):
    x = rand(*shape)
    layer = make_layer('type: "Flatten" ' + text)
    _, top = run_forward(layer, [x])
    assert top[0].shape == expect
    numpy.testing.assert_array_equal(top[0].data, x.reshape(expect))
    check_gradient(layer, [x])


def test_flatten_errors():
    with pytest.raises(LayerError, match="comes before"):
        run_forward(make_layer('type: "Flatten" flatten_param { axis: 2 end_axis: 1 }'),
                    [rand(2, 3, 4)])
    with pytest.raises(LayerError, match="out of range"):
        run_forward(make_layer('type: "Flatten" flatten_param { axis: 3 }'), [rand(2, 3, 4)])


# ----- Reshape -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,shape,expect", [
    ("shape { dim: 0 dim: -1 }", (2, 3, 4, 5), (2, 60)),
    ("shape { dim: 0 dim: 2 dim: -1 dim: 0 }", (2, 3, 4, 5), (2, 2, 6, 5)),
    ("shape { dim: 4 dim: 6 }", (2, 3, 4), (4, 6)),
    ("shape { dim: -1 } axis: 1 num_axes: 2", (2, 3, 4, 5), (2, 12, 5)),
    ("shape { dim: 1 } axis: -1 num_axes: 0", (2, 3, 4), (2, 3, 4, 1)),
    ("shape { dim: 1 } axis: 0 num_axes: 0", (2, 3), (1, 2, 3)),
    ("shape { dim: 0 dim: -1 } axis: 1", (2, 3, 4, 5), (2, 3, 20)),
    # Caffe: a negative axis counts so that -1 is *after* the last axis
    ("shape { dim: 2 dim: 2 } axis: -2 num_axes: 1", (3, 5, 4), (3, 5, 2, 2)),
    ("shape { }", (1, 1), ()),
    ("shape { } axis: 1 num_axes: 1", (3, 1, 2), (3, 2)),
])
def test_reshape_forward_and_gradient(text, shape, expect):
    x = rand(*shape)
    layer = make_layer(f'type: "Reshape" reshape_param {{ {text} }}')
    _, top = run_forward(layer, [x])
    assert top[0].shape == expect
    numpy.testing.assert_array_equal(top[0].data, x.reshape(expect))
    check_gradient(layer, [x])


def test_reshape_follows_new_input_shapes():
    layer = make_layer('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } }')
    bottom, top = run_forward(layer, [rand(2, 3, 4)])
    bottom[0].reshape(5, 2, 2)
    bottom[0].data[...] = rand(5, 2, 2)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    numpy.testing.assert_array_equal(top[0].data, bottom[0].data.reshape(5, 4))


def test_reshape_errors():
    with pytest.raises(LayerError, match="at most one"):
        run_forward(make_layer('type: "Reshape" reshape_param { shape { dim: -1 dim: -1 } }'),
                    [rand(2, 3)])
    with pytest.raises(LayerError, match="cannot infer"):
        run_forward(make_layer('type: "Reshape" reshape_param { shape { dim: 4 dim: -1 } }'),
                    [rand(2, 3)])
    with pytest.raises(LayerError, match="holds"):
        run_forward(make_layer('type: "Reshape" reshape_param { shape { dim: 4 dim: 2 } }'),
                    [rand(2, 3)])
    with pytest.raises(LayerError, match="no axis"):
        run_forward(make_layer('type: "Reshape" reshape_param { shape { dim: 0 dim: 0 dim: 0 } }'),
                    [rand(6, 1)])
    with pytest.raises(LayerError, match="dimensions must be"):
        run_forward(make_layer('type: "Reshape" reshape_param { shape { dim: -2 } }'), [rand(2)])
    with pytest.raises(LayerError, match="goes past"):
        run_forward(make_layer('type: "Reshape" reshape_param { shape { dim: -1 } axis: 1 '
                               'num_axes: 3 }'), [rand(2, 3)])


# ----- Crop --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,ashape,bshape,slices", [
    ("", (2, 3, 6, 7), (1, 1, 4, 3), (slice(None), slice(None), slice(0, 4), slice(0, 3))),
    ("crop_param { offset: 1 }", (2, 3, 6, 7), (5, 5, 4, 3),
     (slice(None), slice(None), slice(1, 5), slice(1, 4))),
    ("crop_param { axis: 1 offset: 2 offset: 1 offset: 3 }", (2, 5, 4, 6), (2, 3, 3, 2),
     (slice(None), slice(2, 5), slice(1, 4), slice(3, 5))),
    ("crop_param { axis: 0 offset: 1 }", (4, 5), (2, 3), (slice(1, 3), slice(1, 4))),
    ("crop_param { axis: -1 offset: 2 }", (2, 3, 6), (9, 9, 3), (slice(None), slice(None),
                                                                 slice(2, 5))),
])
def test_crop_forward_and_gradient(text, ashape, bshape, slices):
    a, b = rand(*ashape), rand(*bshape)
    layer = make_layer('type: "Crop" ' + text)
    _, top = run_forward(layer, [a, b])
    numpy.testing.assert_array_equal(top[0].data, a[slices])
    check_gradient(layer, [a, b], check_bottoms=[0])
    # the gradient reaches the cropped window only
    bottom, top = run_forward(layer, [a, b])
    top[0].diff[...] = 1.0
    layer.backward(top, [True, False], bottom)
    expect = numpy.zeros(ashape)
    expect[slices] = 1.0
    numpy.testing.assert_array_equal(bottom[0].diff, expect)


def test_crop_errors():
    with pytest.raises(LayerError, match="does not fit"):
        run_forward(make_layer('type: "Crop" crop_param { offset: 3 }'),
                    [rand(1, 1, 5, 5), rand(1, 1, 3, 3)])
    with pytest.raises(LayerError, match="one per cropped axis"):
        run_forward(make_layer('type: "Crop" crop_param { offset: 1 offset: 1 offset: 1 }'),
                    [rand(1, 1, 5, 5), rand(1, 1, 3, 3)])
    with pytest.raises(LayerError, match="fewer axes"):
        run_forward(make_layer('type: "Crop" crop_param { axis: 0 }'), [rand(1, 5, 5), rand(3, 3)])


# ----- Eltwise -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,coeffs", [
    ("", [1, 1, 1]),
    ("eltwise_param { operation: SUM coeff: 1 coeff: -1 coeff: 0.5 }", [1, -1, 0.5]),
    ("eltwise_param { coeff: 2.5 coeff: 1 coeff: -0.3 }", [2.5, 1, -0.3]),
])
def test_eltwise_sum(text, coeffs):
    arrays = [rand(2, 3, 2) for _ in range(3)]
    layer = make_layer('type: "Eltwise" ' + text)
    _, top = run_forward(layer, arrays)
    expect = sum(f32(c) * a for c, a in zip(coeffs, arrays))
    numpy.testing.assert_allclose(top[0].data, expect, rtol=1e-12)
    check_gradient(layer, arrays)


@pytest.mark.parametrize("n", [2, 3])
def test_eltwise_prod(n):
    arrays = [rand(2, 3, 2) for _ in range(n)]
    layer = make_layer('type: "Eltwise" eltwise_param { operation: PROD }')
    _, top = run_forward(layer, arrays)
    numpy.testing.assert_allclose(top[0].data, numpy.prod(arrays, axis=0), rtol=1e-12)
    check_gradient(layer, arrays)


def test_eltwise_prod_gradient_with_zeros():
    arrays = [rand(2, 4) for _ in range(3)]
    arrays[0][0, :2] = 0.0
    arrays[1][0, 1:3] = 0.0   # element (0, 1) is zero in two bottoms
    arrays[2][1, 3] = 0.0
    layer = make_layer('type: "Eltwise" eltwise_param { operation: PROD }')
    bottom, top = run_forward(layer, arrays)
    dy = rand(2, 4)
    top[0].diff[...] = dy
    layer.backward(top, [True] * 3, bottom)
    for i in range(3):
        others = numpy.prod([a for j, a in enumerate(arrays) if j != i], axis=0)
        numpy.testing.assert_allclose(bottom[i].diff, dy * others, rtol=1e-12)
        assert numpy.isfinite(bottom[i].diff).all()
    check_gradient(layer, arrays)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_eltwise_max(n):
    arrays = [rand(3, 2, 2) for _ in range(n)]   # continuous: no ties
    layer = make_layer('type: "Eltwise" eltwise_param { operation: MAX }')
    _, top = run_forward(layer, arrays)
    numpy.testing.assert_array_equal(top[0].data, numpy.max(arrays, axis=0))
    check_gradient(layer, arrays)


def test_eltwise_max_gradient_goes_to_the_winner_only():
    a = numpy.array([[1.0, 5.0, 2.0, 3.0]])
    b = numpy.array([[4.0, 0.0, 2.0, 3.0]])
    c = numpy.array([[4.0, 1.0, 1.0, 3.0]])
    layer = make_layer('type: "Eltwise" eltwise_param { operation: MAX }')
    bottom, top = run_forward(layer, [a, b, c])
    top[0].diff[...] = 1.0
    layer.backward(top, [True] * 3, bottom)
    # Caffe: bottom0 vs bottom1 picks 0 only when strictly greater (ties go to 1); later bottoms
    # win only when strictly greater than the running max.
    numpy.testing.assert_array_equal(bottom[0].diff, [[0, 1, 0, 0]])
    numpy.testing.assert_array_equal(bottom[1].diff, [[1, 0, 1, 1]])
    numpy.testing.assert_array_equal(bottom[2].diff, [[0, 0, 0, 0]])


def test_eltwise_float32():
    arrays = [rand(2, 3).astype(numpy.float32) for _ in range(2)]
    layer = make_layer('type: "Eltwise" eltwise_param { coeff: 0.5 coeff: 2 }', dtype=numpy.float32)
    _, top = run_forward(layer, arrays, dtype=numpy.float32)
    assert top[0].data.dtype == numpy.float32
    numpy.testing.assert_allclose(top[0].data, 0.5 * arrays[0] + 2 * arrays[1], rtol=1e-6)


def test_eltwise_errors():
    with pytest.raises(LayerError, match="same shape"):
        run_forward(make_layer('type: "Eltwise"'), [rand(2, 3), rand(3, 2)])
    with pytest.raises(LayerError, match="one per bottom"):
        run_forward(make_layer('type: "Eltwise" eltwise_param { coeff: 1 }'), [rand(2), rand(2)])
    with pytest.raises(LayerError, match="only for operation SUM"):
        run_forward(make_layer('type: "Eltwise" eltwise_param { operation: PROD coeff: 1 coeff: 2 }'),
                    [rand(2), rand(2)])
    with pytest.raises(LayerError, match="at least 2"):
        run_forward(make_layer('type: "Eltwise"'), [rand(2)])


def test_in_place_refused_where_it_cannot_work():
    x = Blob((2, 3), numpy.float64)
    for text in ['type: "Flatten"', 'type: "Reshape" reshape_param { shape { dim: -1 } }',
                 'type: "Split"']:
        with pytest.raises(LayerError, match="in place"):
            make_layer(text).setup([x], [x])
