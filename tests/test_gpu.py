"""CuPy runs of the engine, checked against numpy: every layer family, a whole net, and training.

Marked `gpu`: skipped with the reason on a machine without CuPy and a CUDA device. On a GPU machine
the rest of the suite runs unchanged (numpy), and these run the same layers on CuPy.
"""
import numpy as np
import pytest

from poseidon.engine import TRAIN, backend
from poseidon.engine.net import Net
from poseidon.engine.prototxt import parse_net_text

from .harness import check_gradient, make_layer, run_forward
from .test_reference_nets import CIFAR10_QUICK

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")]

CONFIGS = [
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 '
     'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }', [(2, 3, 7, 7)], 1),
    ('type: "Convolution" convolution_param { num_output: 4 kernel_h: 3 kernel_w: 2 group: 2 dilation: 2 '
     'weight_filler { type: "gaussian" std: 0.5 } }', [(2, 4, 8, 8)], 1),
    ('type: "Deconvolution" convolution_param { num_output: 3 kernel_size: 3 stride: 2 pad: 1 '
     'weight_filler { type: "gaussian" std: 0.5 } }', [(2, 2, 4, 4)], 1),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', [(2, 3, 7, 7)], 1),
    ('type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }', [(2, 3, 7, 7)], 1),
    ('type: "Pooling" pooling_param { pool: AVE global_pooling: true }', [(2, 3, 5, 5)], 1),
    ('type: "InnerProduct" inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 } '
     'bias_filler { type: "gaussian" std: 0.5 } }', [(3, 2, 2, 2)], 1),
    ('type: "InnerProduct" inner_product_param { num_output: 5 transpose: true '
     'weight_filler { type: "gaussian" std: 0.5 } }', [(3, 6)], 1),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', [(2, 3, 4)], 1),
    ('type: "Sigmoid"', [(2, 5)], 1),
    ('type: "TanH"', [(2, 5)], 1),
    ('type: "PReLU"', [(2, 3, 2, 2)], 1),
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 }', [(2, 5, 3, 3)], 1),
    ('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }', [(2, 2, 5, 5)], 1),
    ('type: "BatchNorm" batch_norm_param { use_global_stats: false }', [(4, 3, 2, 2)], 1),
    ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" std: 0.5 } '
     'bias_filler { type: "gaussian" std: 0.5 } }', [(2, 3, 2, 2)], 1),
    ('type: "Bias" bias_param { filler { type: "gaussian" std: 0.5 } }', [(2, 3, 2)], 1),
    ('type: "Softmax"', [(3, 4)], 1),
    ('type: "Concat"', [(2, 3, 2), (2, 1, 2)], 1),
    ('type: "Slice" slice_param { slice_point: 1 }', [(2, 3, 2)], 2),
    ('type: "Eltwise" eltwise_param { operation: SUM coeff: 0.5 coeff: -2 }', [(2, 3), (2, 3)], 1),
    ('type: "Eltwise" eltwise_param { operation: PROD }', [(2, 3), (2, 3)], 1),
    ('type: "Eltwise" eltwise_param { operation: MAX }', [(2, 3), (2, 3)], 1),
    ('type: "Flatten"', [(2, 3, 2)], 1),
    ('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } }', [(2, 3, 2)], 1),
    ('type: "Crop" crop_param { axis: 2 offset: 1 }', [(2, 2, 5, 5), (2, 2, 3, 3)], 1),
    ('type: "Split"', [(2, 3)], 2),
    ('type: "EuclideanLoss"', [(3, 4), (3, 4)], 1),
    ('type: "SoftmaxWithLoss"', [(4, 5), (4,)], 1),
    ('type: "SoftmaxWithLoss" loss_param { ignore_label: 2 normalization: BATCH_SIZE }',
     [(3, 4, 2, 2), (3, 1, 2, 2)], 1),
    # shapes large enough for the batch-wide blocks and several window rows a call
    ('type: "Convolution" convolution_param { num_output: 32 kernel_size: 5 pad: 2 '
     'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } }',
     [(4, 3, 32, 32)], 1),
    ('type: "Convolution" convolution_param { num_output: 16 kernel_size: 3 pad: 1 group: 2 '
     'weight_filler { type: "gaussian" std: 0.1 } }', [(3, 8, 12, 12)], 1),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', [(4, 8, 16, 16)], 1),
    ('type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 }', [(4, 8, 15, 15)], 1),
    ('type: "LRN" lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }', [(2, 16, 8, 8)], 1),
    ('type: "InnerProduct" inner_product_param { num_output: 64 '
     'weight_filler { type: "gaussian" std: 0.1 } }', [(8, 32, 4, 4)], 1),
]

# layers whose label input takes no gradient; its values are class indices
LABELLED = ("SoftmaxWithLoss",)


def _labelled(text):
    return any(t in text for t in LABELLED)


def _run(text, arrays, n_tops, xp, params=None, top_diffs=None):
    propagate = [True] * len(arrays)
    if _labelled(text):
        propagate[-1] = False
    from poseidon.engine import rng
    rng.seed(7)
    layer = make_layer(text, TRAIN, np.float64, xp)
    bottom, top = run_forward(layer, arrays, n_tops, np.float64, xp)
    if params is not None:
        for blob, value in zip(layer.blobs, params):
            blob.data[...] = xp.asarray(value)
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
    for t, d in zip(top, top_diffs or []):
        t.diff[...] = xp.asarray(d)
    for p in layer.blobs:
        p.diff[...] = 0
    layer.backward(top, propagate, bottom)
    as_np = backend.to_numpy
    return ([as_np(t.data) for t in top],
            [as_np(b.diff) for b, down in zip(bottom, propagate) if down],
            [as_np(p.data) for p in layer.blobs], [as_np(p.diff) for p in layer.blobs])


@pytest.mark.parametrize("text, shapes, n_tops", CONFIGS, ids=[c[0].split('"')[1] + str(i) for i, c in enumerate(CONFIGS)])
def test_layer_on_cupy_matches_numpy(text, shapes, n_tops):
    import cupy
    rs = np.random.RandomState(0)
    arrays = [rs.standard_normal(s) for s in shapes]
    if "Crop" in text:
        arrays = arrays[:1] + [np.zeros(shapes[1])]
    if _labelled(text):
        classes = shapes[0][1]
        arrays[-1] = rs.randint(0, classes, size=shapes[-1]).astype(np.float64)
    tops, _, params, _ = _run(text, arrays, n_tops, np)
    diffs = [rs.standard_normal(t.shape) for t in tops]
    ref = _run(text, arrays, n_tops, np, params, diffs)
    got = _run(text, arrays, n_tops, cupy, params, diffs)
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("route,extra", [("fourier", "kernel_size: 5 pad: 2"),
                                         ("fourier", "kernel_h: 3 kernel_w: 2 pad_h: 2"),
                                         ("winograd", "kernel_size: 3 pad: 1"),
                                         ("winograd", "kernel_size: 3 pad: 2")])
def test_convolution_routes_on_cupy_match_numpy(route, extra, monkeypatch):
    """The frequency route and Winograd (POSEIDON_CONV=fourier|winograd) against numpy."""
    import cupy
    monkeypatch.setenv("POSEIDON_CONV", route)
    text = (f'type: "Convolution" convolution_param {{ num_output: 5 {extra} '
            f'weight_filler {{ type: "gaussian" std: 1 }} bias_filler {{ type: "gaussian" std: 1 }} }}')
    rs = np.random.RandomState(3)
    arrays = [rs.standard_normal((3, 4, 7, 6))]
    tops, _, params, _ = _run(text, arrays, 1, np)
    diffs = [rs.standard_normal(t.shape) for t in tops]
    ref = _run(text, arrays, 1, np, params, diffs)
    got = _run(text, arrays, 1, cupy, params, diffs)
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-10)


def test_accuracy_on_cupy_matches_numpy():
    import cupy
    rs = np.random.RandomState(2)
    scores, labels = rs.standard_normal((50, 6)), rs.randint(0, 6, 50).astype(np.float64)
    text = 'type: "Accuracy" accuracy_param { top_k: 2 }'
    got = {}
    for name, xp in (("numpy", np), ("cupy", cupy)):
        _, top = run_forward(make_layer(text, TRAIN, np.float64, xp), [scores, labels], 1,
                             np.float64, xp)
        got[name] = float(backend.to_numpy(top[0].data).ravel()[0])
    top2 = np.argsort(-scores, axis=1)[:, :2]
    assert got["numpy"] == got["cupy"] == np.mean((top2 == labels[:, None]).any(axis=1))


def test_auto_on_cupy_takes_the_gpu_rule(monkeypatch):
    """On CuPy `auto` asks fourier_pays_on_gpu: a 64 -> 64 3x3 layer on 56x56 planes at batch 32
    takes the frequency route (and still matches numpy's im2col), a 3-channel one keeps im2col."""
    import cupy
    monkeypatch.delenv("POSEIDON_CONV", raising=False)
    text = ('type: "Convolution" convolution_param { num_output: 64 kernel_size: 3 pad: 1 '
            'weight_filler { type: "gaussian" std: 0.1 } }')
    rs = np.random.RandomState(4)
    x = rs.standard_normal((32, 64, 56, 56))
    wide = make_layer(text, TRAIN, np.float64, cupy)
    _, top = run_forward(wide, [x], 1, np.float64, cupy)
    assert wide.algorithm == "fourier"
    ref = make_layer(text, TRAIN, np.float64, np)
    bottom, want = run_forward(ref, [x], 1, np.float64, np)
    ref.blobs[0].data[...] = backend.to_numpy(wide.blobs[0].data)
    ref.blobs[1].data[...] = backend.to_numpy(wide.blobs[1].data)
    ref.forward(bottom, want)
    assert ref.algorithm == "im2col"
    np.testing.assert_allclose(backend.to_numpy(top[0].data), want[0].data, rtol=1e-9, atol=1e-10)
    narrow = make_layer(text, TRAIN, np.float64, cupy)
    run_forward(narrow, [rs.standard_normal((32, 3, 56, 56))], 1, np.float64, cupy)
    assert narrow.algorithm == "im2col"


def test_gradient_check_on_cupy():
    import cupy
    rs = np.random.RandomState(1)
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 pad: 1 '
                       'weight_filler { type: "gaussian" std: 0.5 } }', TRAIN, np.float64, cupy)
    check_gradient(layer, [rs.standard_normal((1, 2, 4, 4))])


def test_whole_net_on_cupy_matches_numpy():
    import cupy
    nets = {}
    for name, xp in (("numpy", np), ("cupy", cupy)):
        from poseidon.engine import rng
        rng.seed(3)
        net = Net(parse_net_text(CIFAR10_QUICK), TRAIN, dtype=np.float64, xp=xp)
        rs = np.random.RandomState(1)
        net.blobs["data"].data[...] = xp.asarray(rs.standard_normal((2, 3, 32, 32)))
        net.blobs["label"].data[...] = xp.asarray(np.array([3, 7]))
        net.ClearParamDiffs()
        nets[name] = (net.Forward(), net)
        net.Backward()
    (l0, a), (l1, b) = nets["numpy"], nets["cupy"]
    assert abs(l0 - l1) < 1e-9 * abs(l0)
    for name in a.params:
        for x, y in zip(a.params[name], b.params[name]):
            np.testing.assert_allclose(backend.to_numpy(y.diff), x.diff, rtol=1e-7, atol=1e-12)


def test_training_on_cupy_matches_numpy_and_resumes_bitwise(tmp_path, monkeypatch):
    """Six float32 iterations of the digits net on CuPy against numpy, both through im2col.

    On CPU `auto` sends the digits net's conv2 and conv3 to the frequency route, whose rounding
    turns the exact zeros of the images' background into +-1e-12; the ReLUs then pass gradient
    where im2col's exact zeros pass none, and the biases part by tens of percent within six
    iterations (measured on numpy alone, auto vs im2col). On CuPy `auto` keeps im2col for the
    digits net's small planes; both sides are held to it."""
    import cupy
    monkeypatch.setenv("POSEIDON_CONV", "im2col")
    from poseidon.engine.io.datasets import make_digits_lmdb
    from poseidon.engine.solvers import get_solver
    from poseidon.engine.proto import caffe_pb2
    from poseidon.engine import prototxt
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    make_digits_lmdb(str(tmp_path / "data" / "digits"))
    param = prototxt.read_solver(str(root / "prototxt" / "digits_quick" / "solver.prototxt"))
    param.net = str(root / "prototxt" / "digits_quick" / "train_val.prototxt")
    param.max_iter, param.test_interval, param.display = 6, 1000, 0
    param.test_initialization = False
    param.snapshot = 3
    param.snapshot_prefix = str(tmp_path / "snap")
    import os
    os.chdir(tmp_path)
    results = {}
    for name, xp in (("numpy", np), ("cupy", cupy)):
        solver = get_solver(caffe_pb2.SolverParameter.FromString(param.SerializeToString()), xp=xp)
        solver.solve()
        results[name] = [backend.to_numpy(b.data) for b in solver.net.learnable_params]
        solver.net.shutdown()
    for x, y in zip(results["numpy"], results["cupy"]):
        np.testing.assert_allclose(y, x, rtol=1e-3, atol=1e-5)
    resumed = get_solver(caffe_pb2.SolverParameter.FromString(param.SerializeToString()), xp=cupy)
    resumed.solve(resume_file=str(tmp_path / "snap_iter_3.solverstate"))
    for x, y in zip(results["cupy"], resumed.net.learnable_params):
        assert np.array_equal(x, backend.to_numpy(y.data))
