"""CuPy runs of the engine, checked against numpy: every layer family, a whole net, and training.

Marked `gpu`: skipped with the reason on a machine without CuPy and a CUDA device. On a GPU machine
the rest of the suite runs unchanged (numpy), and these run the same layers on CuPy.
"""
import numpy as np
import pytest

from poseidon.engine import TRAIN, backend
from poseidon.engine.net import Net
from poseidon.engine.prototxt import parse_net_text

from poseidon.testing.layer_cases import CONFIGS, labelled, run_case

from tests.engine.harness import check_gradient, make_layer, run_forward
from tests.engine.test_reference_nets import CIFAR10_QUICK

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")]

@pytest.mark.parametrize("text, shapes, n_tops", CONFIGS, ids=[c[0].split('"')[1] + str(i) for i, c in enumerate(CONFIGS)])
def test_layer_on_cupy_matches_numpy(text, shapes, n_tops):
    import cupy
    rs = np.random.RandomState(0)
    arrays = [rs.standard_normal(s) for s in shapes]
    if "Crop" in text:
        arrays = arrays[:1] + [np.zeros(shapes[1])]
    if labelled(text):
        classes = shapes[0][1]
        arrays[-1] = rs.randint(0, classes, size=shapes[-1]).astype(np.float64)
    tops, _, params, _ = run_case(text, arrays, n_tops, np)
    diffs = [rs.standard_normal(t.shape) for t in tops]
    ref = run_case(text, arrays, n_tops, np, params, diffs)
    got = run_case(text, arrays, n_tops, cupy, params, diffs)
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
    tops, _, params, _ = run_case(text, arrays, 1, np)
    diffs = [rs.standard_normal(t.shape) for t in tops]
    ref = run_case(text, arrays, 1, np, params, diffs)
    got = run_case(text, arrays, 1, cupy, params, diffs)
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
    root = Path(__file__).resolve().parents[2]
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
