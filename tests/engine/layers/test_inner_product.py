"""InnerProduct: forward against a plain reference, float64 gradient checks, sufficient factors, errors."""
import numpy
import pytest

from poseidon.engine import rng
from poseidon.engine.blob import Blob
from poseidon.engine.errors import LayerError
from tests.engine.harness import check_gradient, make_layer, run_forward


def ip(num_output=3, extra="", filler='weight_filler { type: "gaussian" std: 1 } '
                                      'bias_filler { type: "gaussian" std: 1 }', dtype=numpy.float64):
    rng.seed(7)
    return make_layer(f'type: "InnerProduct" inner_product_param {{ num_output: {num_output} '
                      f'{filler} {extra} }}', dtype=dtype)


def reference(x, w, b, axis, transpose):
    """Loops: y[m, o] = Σ_k x[m, k]·W[o, k] + b[o] (W[k, o] when transposed)."""
    lead = x.shape[:axis]
    xm = x.reshape(int(numpy.prod(lead)) if lead else 1, -1)
    n_out = w.shape[1] if transpose else w.shape[0]
    y = numpy.zeros((xm.shape[0], n_out))
    for m in range(xm.shape[0]):
        for o in range(n_out):
            acc = 0.0
            for k in range(xm.shape[1]):
                acc += xm[m, k] * (w[k, o] if transpose else w[o, k])
            y[m, o] = acc + (b[o] if b is not None else 0.0)
    return y.reshape(lead + (n_out,))


CONFIGS = [  # (bottom shape, extra param text, axis)
    ((2, 3, 2, 2), "", 1),
    ((2, 3, 2, 2), "axis: 2", 2),
    ((2, 3, 4), "axis: -1", 2),
    ((2, 3, 2, 2), "transpose: true", 1),
    ((2, 3, 2, 2), "bias_term: false", 1),
    ((2, 3, 2, 2), "axis: 2 transpose: true bias_term: false", 2),
]


@pytest.mark.parametrize("shape,extra,axis", CONFIGS)
def test_forward_matches_reference(shape, extra, axis):
    x = numpy.random.RandomState(0).standard_normal(shape)
    layer = ip(extra=extra)
    _, top = run_forward(layer, [x])
    transpose = "transpose" in extra
    bias = layer.blobs[1].data if "bias_term: false" not in extra else None
    assert len(layer.blobs) == (1 if bias is None else 2)
    n_in = int(numpy.prod(shape[axis:]))
    assert layer.blobs[0].shape == ((n_in, 3) if transpose else (3, n_in))
    assert top[0].shape == shape[:axis] + (3,)
    numpy.testing.assert_allclose(top[0].data, reference(x, layer.blobs[0].data, bias, axis,
                                                         transpose), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,extra,axis", CONFIGS)
def test_gradient(shape, extra, axis):
    x = numpy.random.RandomState(1).standard_normal(shape)
    check_gradient(ip(extra=extra), [x])


def test_fillers_and_defaults():
    layer = ip(4, filler='weight_filler { type: "constant" value: 0.5 } '
                         'bias_filler { type: "constant" value: -2 }')
    run_forward(layer, [numpy.ones((2, 5))])
    assert (layer.blobs[0].data == 0.5).all() and (layer.blobs[1].data == -2).all()
    layer = ip(4, filler="")                    # unset fillers: constant 0, as in Caffe
    _, top = run_forward(layer, [numpy.ones((2, 5))])
    assert not layer.blobs[0].data.any() and not layer.blobs[1].data.any()
    assert not top[0].data.any()
    layer = ip(4, filler='weight_filler { type: "xavier" }')
    run_forward(layer, [numpy.ones((2, 6))])
    bound = numpy.sqrt(3.0 / 6)                 # fan_in = 6 for a (4, 6) weight
    assert numpy.abs(layer.blobs[0].data).max() <= bound and layer.blobs[0].data.std() > 0


def test_float32_stays_float32():
    layer = ip(5, dtype=numpy.float32)
    x = numpy.random.RandomState(2).standard_normal((4, 3, 2)).astype(numpy.float32)
    bottom, top = run_forward(layer, [x], dtype=numpy.float32)
    assert top[0].data.dtype == numpy.float32 and layer.blobs[0].data.dtype == numpy.float32
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert bottom[0].diff.dtype == numpy.float32 and layer.blobs[0].diff.dtype == numpy.float32
    ref = x.reshape(4, 6).astype(numpy.float64) @ layer.blobs[0].data.T.astype(numpy.float64)
    numpy.testing.assert_allclose(top[0].data, ref + layer.blobs[1].data, rtol=1e-5, atol=1e-5)


def _backward(layer, x, g):
    bottom, top = run_forward(layer, [x])
    for p in layer.blobs:
        p.diff[...] = 0
    top[0].diff[...] = g
    layer.backward(top, [True], bottom)
    return bottom, top


@pytest.mark.parametrize("extra", ["", "transpose: true", "axis: 2", "axis: 2 transpose: true"])
def test_sufficient_factors_give_the_weight_gradient_exactly(extra):
    rs = numpy.random.RandomState(3)
    x = rs.standard_normal((2, 3, 2, 2))
    layer = ip(4, extra=extra)
    assert layer.has_sufficient_factors is True
    out_shape = (2, 4) if "axis: 2" not in extra else (2, 3, 4)
    bottom, top = _backward(layer, x, rs.standard_normal(out_shape))
    G, X = layer.sufficient_factors(bottom, top)
    k = 2 if "axis: 2" not in extra else 6
    assert G.shape == (k, 4) and X.shape == (k, 24 // k)
    assert numpy.shares_memory(G, top[0].diff) and numpy.shares_memory(X, bottom[0].data)
    dw = layer.weight_grad_from_factors(G, X)
    assert dw.shape == layer.blobs[0].shape
    numpy.testing.assert_array_equal(layer.blobs[0].diff, dw)
    numpy.testing.assert_array_equal(layer.blobs[1].diff, G.sum(0))
    expected = X.T @ G if "transpose" in extra else G.T @ X
    numpy.testing.assert_allclose(dw, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("extra", ["", "transpose: true"])
def test_stacked_factors_sum_the_gradients_of_several_batches(extra):
    rs = numpy.random.RandomState(4)
    layer = ip(3, extra=extra)
    grads, factors = [], []
    for _ in range(3):   # three "workers", each with its own batch
        bottom, top = _backward(layer, rs.standard_normal((2, 5)), rs.standard_normal((2, 3)))
        grads.append(layer.blobs[0].diff.copy())
        factors.append(tuple(f.copy() for f in layer.sufficient_factors(bottom, top)))
    G = numpy.concatenate([f[0] for f in factors])
    X = numpy.concatenate([f[1] for f in factors])
    numpy.testing.assert_allclose(layer.weight_grad_from_factors(G, X), sum(grads), rtol=1e-12,
                                  atol=1e-12)


def test_param_gradients_accumulate():
    rs = numpy.random.RandomState(5)
    layer = ip(3)
    bottom, top = _backward(layer, rs.standard_normal((2, 4)), rs.standard_normal((2, 3)))
    once = [p.diff.copy() for p in layer.blobs]
    layer.backward(top, [False], bottom)
    for p, g in zip(layer.blobs, once):
        numpy.testing.assert_allclose(p.diff, 2 * g, rtol=1e-12)


def test_param_propagate_down_respected():
    rs = numpy.random.RandomState(6)
    layer = ip(3)
    bottom, top = run_forward(layer, [rs.standard_normal((2, 4))])
    layer.param_propagate_down = [False, False]
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert not layer.blobs[0].diff.any() and not layer.blobs[1].diff.any()
    assert bottom[0].diff.any()


def test_errors():
    with pytest.raises(LayerError, match="num_output"):
        run_forward(make_layer('type: "InnerProduct" inner_product_param { }'), [numpy.ones((2, 3))])
    with pytest.raises(LayerError, match="axis 3 is out of range"):
        run_forward(ip(extra="axis: 3"), [numpy.ones((2, 3))])
    layer = ip()
    bottom, top = run_forward(layer, [numpy.ones((2, 3, 2))])
    bigger = Blob((2, 4, 2), numpy.float64)
    with pytest.raises(LayerError, match=r"\(2, 4, 2\).*8 inputs.*set up for 6"):
        layer.reshape([bigger], top)
    layer.reshape([Blob((5, 3, 2), numpy.float64)], top)   # a new batch size is fine
    assert top[0].shape == (5, 3)


@pytest.mark.parametrize("extra", ["", "transpose: true", "bias_term: false"])
def test_deferred_weight_gradient_leaves_the_weight_diff_alone(extra):
    """backward(weight_grad=False) (a weight made from factors: the solver's or SFB's): it makes
    the bias gradient and the bottom diff as usual and does not touch the weight's diff."""
    rs = numpy.random.RandomState(8)
    x, g = rs.standard_normal((3, 5)), rs.standard_normal((3, 4))
    full = ip(4, extra=extra)
    bottom_full, _ = _backward(full, x, g)
    deferred = ip(4, extra=extra)
    bottom, top = run_forward(deferred, [x])
    deferred.blobs[0].diff[...] = 7.0                     # must survive untouched
    top[0].diff[...] = g
    deferred.backward(top, [True], bottom, weight_grad=False)
    numpy.testing.assert_array_equal(deferred.blobs[0].diff, 7.0)
    numpy.testing.assert_array_equal(bottom[0].diff, bottom_full[0].diff)
    if "bias_term: false" not in extra:
        numpy.testing.assert_array_equal(deferred.blobs[1].diff, full.blobs[1].diff)
    G, X = deferred.sufficient_factors(bottom, top)
    numpy.testing.assert_array_equal(deferred.weight_grad_from_factors(G, X), full.blobs[0].diff)


@pytest.mark.parametrize("extra", ["", "transpose: true"])
@pytest.mark.parametrize("workers", [1, 3])
def test_weight_gradient_rows_from_factors_into_a_given_buffer(extra, workers, monkeypatch):
    """rows=(lo, hi) gives those rows of the weight-layout gradient; out= is written and returned;
    blocks put together equal the whole gradient, also with the columns split over 3 threads."""
    from poseidon.engine import parallel
    from poseidon.engine.layers import inner_product
    monkeypatch.setattr(inner_product, "PARALLEL_MIN_WEIGHTS", 1 if workers > 1 else 1 << 40)
    monkeypatch.setattr(parallel.parallel(), "workers", workers)
    rs = numpy.random.RandomState(9)
    layer = ip(5, extra=extra)
    run_forward(layer, [rs.standard_normal((6, 7))])
    G, X = rs.standard_normal((6, 5)), rs.standard_normal((6, 7))
    whole = layer.weight_grad_from_factors(G, X)
    rows = whole.shape[0]
    blocks = []
    for lo in range(0, rows, 2):
        hi = min(lo + 2, rows)
        out = numpy.empty((hi - lo, whole.shape[1]))
        got = layer.weight_grad_from_factors(G, X, out=out, rows=(lo, hi))
        assert got is out
        blocks.append(got)
    numpy.testing.assert_allclose(numpy.concatenate(blocks), whole, rtol=1e-13, atol=1e-13)
    expected = X.T @ G if "transpose" in extra else G.T @ X
    numpy.testing.assert_allclose(whole, expected, rtol=1e-13, atol=1e-13)
    with pytest.raises(LayerError, match="out has shape"):
        layer.weight_grad_from_factors(G, X, out=numpy.empty((3, 3)), rows=(0, 2))


@pytest.mark.parametrize("workers", [1, 3])
def test_large_weight_gradient_in_blocks_of_padded_rows(workers, monkeypatch):
    """A large weight's gradient is made block by block of rows in scratch whose rows are an odd
    number of cache lines apart (engine/gemm.padded_row_length), then copied into the diff, or
    added to it when the diff already holds a gradient; blocks of 2 rows over 1 or 3 threads."""
    from poseidon.engine import parallel
    from poseidon.engine.layers import inner_product
    monkeypatch.setattr(inner_product, "PARALLEL_MIN_WEIGHTS", 1)
    monkeypatch.setattr(parallel, "MIN_BLOCK_ROWS", 1)
    monkeypatch.setattr(parallel, "WEIGHT_BLOCK_BYTES", 2 * 64 * 8)
    monkeypatch.setattr(parallel, "ROWS_PER_FACTOR_ROW", 0)
    monkeypatch.setattr(parallel.parallel(), "workers", workers)
    rs = numpy.random.RandomState(10)
    x, g = rs.standard_normal((6, 64)), rs.standard_normal((6, 7))   # rows of 512 bytes: 8 lines
    layer = ip(7)
    bottom, top = _backward(layer, x, g)                 # adds to the zeros it put in the diff
    numpy.testing.assert_allclose(layer.blobs[0].diff, g.T @ x, rtol=1e-13, atol=1e-13)
    numpy.testing.assert_allclose(bottom[0].diff, g @ layer.blobs[0].data, rtol=1e-13)
    scratch = [a for cache in layer.thread_buffers.values() for a in cache._arrays.values()]
    assert scratch and all(a.strides[0] == 9 * 64 for a in scratch)     # 9 lines: odd
    layer.backward(top, [False], bottom)
    numpy.testing.assert_allclose(layer.blobs[0].diff, 2 * (g.T @ x), rtol=1e-13, atol=1e-13)
    layer.blobs[0].diff[...] = 7.0                       # "fresh": written over, not added to
    layer.blobs[0].diff_fresh = True
    layer.backward(top, [False], bottom)
    numpy.testing.assert_allclose(layer.blobs[0].diff, g.T @ x, rtol=1e-13, atol=1e-13)
    check_gradient(ip(7), [x])


def test_weight_blocks_grow_with_the_rows_of_factors():
    """A block holds at least 2 weight rows per row of factors (OpenBLAS packs the factor again
    for every block), and never more rows than the weight has."""
    from poseidon.engine.parallel import WEIGHT_BLOCK_BYTES, block_rows
    row_len = 9216
    plain = block_rows(4096, row_len, 4)
    assert plain == max(16, WEIGHT_BLOCK_BYTES // (row_len * 4))
    assert block_rows(4096, row_len, 4, factor_rows=8) == plain
    assert block_rows(4096, row_len, 4, factor_rows=512) == 1024
    assert block_rows(100, row_len, 4, factor_rows=512) == 100


@pytest.mark.parametrize("batch", [4, 9])
@pytest.mark.parametrize("workers", [1, 3])
def test_large_weight_forward_in_blocks_of_rows(batch, workers, monkeypatch):
    """A large weight's forward (Yᵀ = W·Xᵀ) runs as GEMMs over blocks of FORWARD_ROWS weight
    rows, the last block short, for batches up to FORWARD_ROWS_MAX_BATCH (here 8: the batch of
    9 takes unblocked GEMMs over its whole range); either way Y = X·Wᵀ + b, and backward is
    unchanged."""
    from poseidon.engine import parallel
    from poseidon.engine.layers import inner_product
    monkeypatch.setattr(inner_product, "PARALLEL_MIN_WEIGHTS", 1)
    monkeypatch.setattr(inner_product, "FORWARD_ROWS", 3)
    monkeypatch.setattr(inner_product, "FORWARD_ROWS_MAX_BATCH", 8)
    monkeypatch.setattr(parallel.parallel(), "workers", workers)
    calls = []
    real = inner_product.matmul
    monkeypatch.setattr(inner_product, "matmul",
                        lambda xp, a, b, out=None: calls.append(a.shape[0]) or real(xp, a, b, out))
    rs = numpy.random.RandomState(11)
    x = rs.standard_normal((batch, 6))
    layer = ip(11)
    _, top = run_forward(layer, [x])
    w, b = layer.blobs[0].data, layer.blobs[1].data
    numpy.testing.assert_allclose(top[0].data, x @ w.T + b, rtol=1e-13, atol=1e-13)
    if batch <= 8:
        assert max(calls) <= 3 and sum(calls) == 11
    else:
        assert max(calls) > 3 and sum(calls) == 11
    check_gradient(ip(11), [x])
