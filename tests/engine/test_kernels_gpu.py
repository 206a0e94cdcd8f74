"""The fused kernels on a GPU: the layers' CuPy branch against their numpy branch on the edge
cases of the host checks (tests/engine/test_kernels_host.py), the module built for both element types,
and the dropout mask equal to counter_rng's. Marked `gpu`: skipped with the reason elsewhere."""
import numpy
import pytest

from poseidon.engine import backend, kernels, rng
from poseidon.engine.kernels import counter_rng
from poseidon.engine.layer import TRAIN
from tests.engine.harness import make_layer, run_forward
from tests.engine.test_kernels_host import LOSSES, POOLS, loss_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.gpu_available(),
                                                 reason="needs CuPy and a CUDA device")]


def both_modules(text, arrays, n_tops=1, propagate=None, dtype=numpy.float32):
    """(tops, bottom diffs) of the layer on numpy and on CuPy, the same top diffs on both."""
    import cupy
    results = []
    diffs = None
    for xp in (numpy, cupy):
        layer = make_layer(text, TRAIN, dtype, xp)
        bottom, top = run_forward(layer, arrays, n_tops, dtype, xp)
        if diffs is None:
            rs = numpy.random.RandomState(1)
            diffs = [rs.standard_normal(t.shape) for t in top]
        for t, d in zip(top, diffs):
            t.diff[...] = xp.asarray(d)
        layer.backward(top, propagate or [True] * len(bottom), bottom)
        results.append([backend.to_numpy(b.data) for b in top] +
                       [backend.to_numpy(b.diff) for b, p in
                        zip(bottom, propagate or [True] * len(bottom)) if p])
    return results


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
def test_the_module_builds_for_each_element_type(dtype):
    import cupy
    run = kernels.runner_for(cupy.zeros(1, dtype))
    assert isinstance(run, kernels.CupyRunner)
    for name in kernels.kernel_names():
        run.module.get_function(name)


@pytest.mark.parametrize("shape,extra", POOLS)
@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_pooling_on_cupy(shape, extra, method):
    rs = numpy.random.RandomState(0)
    x = rs.randint(0, 3, shape) if method == "MAX" else rs.standard_normal(shape)
    want, got = both_modules(f'type: "Pooling" pooling_param {{ pool: {method} {extra} }}',
                             [x], n_tops=2 if method == "MAX" else 1)
    for a, b in zip(got, want):
        numpy.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scores_shape,label_shape,classes,extra,ignore", LOSSES)
def test_softmax_loss_on_cupy(scores_shape, label_shape, classes, extra, ignore):
    want, got = both_modules(f'type: "SoftmaxWithLoss" {extra}',
                             list(loss_case(scores_shape, label_shape, classes, ignore)),
                             propagate=[True, False])
    for a, b in zip(got, want):
        numpy.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["SUM coeff: 1 coeff: -2 coeff: 0.5 coeff: 3 coeff: 1 coeff: 2",
                                "PROD", "MAX"])
def test_eltwise_of_six_bottoms_on_cupy(op):
    rs = numpy.random.RandomState(2)
    xs = [rs.randint(0, 3, (2, 3, 4)) if op == "MAX" else rs.standard_normal((2, 3, 4))
          for _ in range(6)]
    want, got = both_modules(f'type: "Eltwise" eltwise_param {{ operation: {op} }}', xs)
    for a, b in zip(got, want):
        numpy.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_dropout_mask_on_cupy_is_the_counter_generator():
    import cupy
    x = numpy.random.RandomState(3).standard_normal((64, 33)).astype(numpy.float32)
    rng.seed(5)
    seed = int(numpy.random.default_rng(5).integers(1 << 63))
    _, top = run_forward(make_layer('type: "Dropout"', TRAIN, numpy.float32, cupy), [x], 1,
                         numpy.float32, cupy)
    keep = counter_rng.keep_mask(x.size, seed, 0, 0.5).reshape(x.shape)
    numpy.testing.assert_array_equal(backend.to_numpy(top[0].data),
                                     numpy.where(keep, x * numpy.float32(2), 0))
