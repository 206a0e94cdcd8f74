"""A GPU training step on the CPU: the engine's CuPy code path run on the counting stand-in
(poseidon/testing/launches.py), which counts what CuPy would launch and every host read. The layers' fused
kernels run through the host build of their sources (tests/engine/kernel_host.py), one launch a call;
the solver's fused rule and NaN/Inf record through their numpy twins, one launch each.

One cifar10_quick step (batch 100, the bench's net, convolutions on the im2col route) launches 55
kernels and reads nothing back (docs/performance.md, "Launches of a step"):
- the solver: 1 fill clearing the flat diff buffer, 2 for the loss (a fill of its top's diff,
  the weight), 1 NaN/Inf record over the flat gradient and the loss, 1 fused update;
- forward, 20: a convolution 3 (im2col, GEMM, the bias epilogue with its ReLU fused), a pooling
  1, the ReLU after pool1 1 (the two after conv2 and conv3 run inside them), an InnerProduct 2
  (GEMM, bias epilogue), SoftmaxWithLoss 3 (the positions, their sum, the normalizer);
- backward, 30: SoftmaxWithLoss 1, an InnerProduct 3 (two GEMMs, the bias sum), a pooling 1,
  the ReLU after pool1 2, conv2 and conv3 7 (the top gradient into the GEMM's rows, with the
  ReLU's mask: 2; bias sum, im2col, two GEMMs, col2im), conv1 4 (no input gradient: the rows
  copy, bias sum, im2col, GEMM).
Before the fused kernels and flat buffers met it was 332 (339 while the step still read its loss,
labels and gradient norm back); the budget is today's figure, so a change that adds a launch
fails it.
"""
import logging

import numpy as np
import pytest

from poseidon.engine import backend
from poseidon.engine.errors import ModelError, PoseidonError
from poseidon.testing.launches import CountingModule
from poseidon.engine.prototxt import parse_net_text
from poseidon.engine.proto import caffe_pb2
from poseidon.engine.solvers import SolverHooks, get_solver
from tests.engine import kernel_host

BUDGET = 55             # launches of one cifar10_quick step today (the module docstring)
DESIGN = 60             # the design figure: fused kernels and flat solver buffers

# launches per layer type of the cifar10_quick step, (forward, backward), as the code reads
PER_LAYER = {"conv1": (3, 4), "conv2": (3, 7), "conv3": (3, 7), "pool1": (1, 1),
             "pool2": (1, 1), "pool3": (1, 1), "relu1": (1, 2), "relu2": (0, 0),
             "relu3": (0, 0), "ip1": (2, 3), "ip2": (2, 3), "loss": (3, 1), "data": (0, 0),
             "label": (0, 0)}

TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 6 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 8 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 }
                        bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


@pytest.fixture
def stand_in():
    xp = CountingModule()
    backend.set_array_module_for_tests(xp)
    try:
        yield xp
    finally:
        backend.set_array_module_for_tests(None)


def tiny_solver(xp, labels=(0, 1, 2, 0, 1, 2, 0, 1), hooks=None, test_iter=0, **settings):
    sp = caffe_pb2.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=0.01,
                                   lr_policy="fixed", max_iter=100, display=0, random_seed=5)
    for key, value in settings.items():
        setattr(sp, key, value)
    sp.net_param.CopyFrom(parse_net_text(TINY))
    if test_iter:                                         # a test net of the same net
        sp.test_iter.append(test_iter)
        sp.test_net_param.add().CopyFrom(sp.net_param)
    solver = get_solver(sp, xp=xp, hooks=hooks)
    data = np.random.RandomState(0).standard_normal((8, 6)).astype(np.float32)
    solver.net.blobs["data"].data[...] = backend.to_xp(data, solver.net.xp)
    solver.net.blobs["label"].data[...] = backend.to_xp(np.array(labels, np.float32),
                                                        solver.net.xp)
    return solver


def params(solver):
    return [backend.to_numpy(b.data).copy() for b in solver.net.learnable_params]


# ----- the counter itself ---------------------------------------------------------------------------
def test_the_counter_counts_launches_and_host_reads(stand_in):
    xp = stand_in
    a = xp.zeros((2, 3), np.float32)                      # fill
    b = xp.empty((3, 4), np.float32)                      # nothing
    assert (xp.by_kind["fill"], xp.launches) == (1, 1)
    a += 1                                                # elementwise
    c = xp.matmul(a, b.fill(2) or b)                      # fill, gemm
    s = c.sum(axis=1)                                     # reduction
    a.T.reshape(-1)[:2]                                   # a copy (the transpose is not contiguous)
    a.reshape(3, 2)[0]                                    # views: nothing
    d = a.astype(np.float64)                              # copy
    a[...] = 0                                            # fill
    a[...] = d                                            # copy
    a[[0, 1], 0]                                          # a gather: elementwise
    assert xp.by_kind == {"elementwise": 2, "reduction": 1, "gemm": 1, "copy": 3, "fill": 3,
                          "kernel": 0}
    assert xp.syncs == 0
    float(s[0]), bool(s[0] > 0), int(s[1]), s.item(0), xp.asnumpy(s), f"{s[0]:g}"
    a[a > 0]                                              # a mask's size is read back
    assert xp.syncs == 7
    assert set(xp.sync_reasons) == {"float", "bool", "int", "item", "asnumpy", "format",
                                    "mask index"}
    assert isinstance(s, xp.ndarray) and isinstance(c.sum(), xp.ndarray)   # 0-d, as CuPy
    kernel = xp.counted_kernel(lambda x, y: x * y + 1)
    assert float(kernel(s, s)[0]) == 24 * 24 + 1 and xp.by_kind["kernel"] == 1


def test_the_backend_runs_the_device_path_on_the_stand_in(stand_in):
    solver = tiny_solver(stand_in)
    data = solver.net.blobs["data"].data
    assert isinstance(data, stand_in.ndarray)
    assert backend.get_array_module(data) is stand_in and solver.on_device
    assert isinstance(backend.to_numpy(data), np.ndarray)
    backend.set_array_module_for_tests(None)
    assert backend.default_xp() is np and backend.get_array_module(np.zeros(1)) is np
    backend.set_mode_cpu()
    marker = object()                                     # what was in use comes back
    backend._state["xp"] = marker
    try:
        backend.set_array_module_for_tests(CountingModule())
        backend.set_array_module_for_tests(None)
        assert backend.default_xp() is marker
    finally:
        backend.set_mode_cpu()


# ----- cifar10_quick: the launch budget and the capture guard --------------------------------------
@pytest.fixture(scope="module")
def cifar_counts():
    """Per-step launches and syncs of cifar10_quick (batch 100) in steady state, from the
    difference of a 3-step and a 1-step call (so the reads at the end of step() cancel), and
    the launches of each part of one step."""
    mp = pytest.MonkeyPatch()
    mp.setenv("POSEIDON_CONV", "im2col")
    xp = CountingModule()
    xp.use_kernels(kernel_host.runner)                    # the layers' kernels: the host build
    backend.set_array_module_for_tests(xp)
    try:
        from poseidon.tools.bench import nets
        solver = nets.make_solver(nets.cifar10_quick(100), xp=xp)
        solver.step(1)                                    # warm-up: buffers allocated
        xp.reset()
        solver.step(1)
        one = (xp.launches, xp.syncs)
        xp.reset()
        solver.step(3)
        three = (xp.launches, xp.syncs)
        net, parts, per_layer = solver.net, {}, {}

        def part(name, run):
            xp.reset()
            run()
            parts[name] = (xp.launches, xp.syncs)
            return xp.launches
        solver._begin_iteration(solver.iter)          # the plan: no launch
        forward = [part("forward", lambda: net.ForwardLayer(li)) for li in range(len(net.layers))]
        part("clear", solver._clear_gradients)         # after the first forward, as the loop does
        loss = []
        part("loss", lambda: loss.append(net.loss_on_device()))
        backward = [part("backward", lambda: net.BackwardThrough(li))
                    for li in reversed(range(len(net.layers)))][::-1]
        part("check", lambda: solver.check_finite(loss[0]))
        part("update", solver.apply_update)
        parts["forward"], parts["backward"] = (sum(forward), 0), (sum(backward), 0)
        for layer, f, b in zip(net.layers, forward, backward):
            per_layer[layer.name] = (f, b)
        print("launches per layer (forward, backward):", per_layer, "solver:", parts)
        return {"step": ((three[0] - one[0]) // 2, (three[1] - one[1]) // 2),
                "boundary_syncs": one[1], "parts": parts, "per_layer": per_layer,
                "params": len(net.learnable_params)}
    finally:
        backend.set_array_module_for_tests(None)
        mp.undo()


def test_the_counter_finds_what_reading_the_code_predicts(cifar_counts):
    """Each part and each layer as the code reads (module docstring)."""
    parts = cifar_counts["parts"]
    assert cifar_counts["params"] == 10
    assert parts["clear"] == (1, 0)                       # one fill of the flat diff buffer
    assert parts["loss"] == (2, 0)
    assert parts["check"] == (1, 0)                       # one record over the flat gradient
    assert parts["update"] == (1, 0)                      # one fused rule over the flat buffers
    assert cifar_counts["per_layer"] == PER_LAYER
    assert parts["forward"][0] == 20 and parts["backward"][0] == 30
    assert cifar_counts["step"][0] == 20 + 30 + 1 + 2 + 1 + 1 == 55


def test_a_cifar10_quick_step_keeps_to_its_launch_budget(cifar_counts):
    assert cifar_counts["step"][0] <= BUDGET


def test_a_cifar10_quick_step_reaches_the_design_launch_count(cifar_counts):
    assert cifar_counts["step"][0] <= DESIGN


def test_a_steady_state_step_never_waits_for_the_device(cifar_counts):
    """The capture guard: no host read inside a step with no display, test or snapshot (a CUDA
    graph could capture it); step() reads its records once when it returns."""
    assert cifar_counts["step"][1] == 0
    assert all(syncs == 0 for _, syncs in cifar_counts["parts"].values())
    assert cifar_counts["boundary_syncs"] <= 2


def test_clipped_steps_read_nothing_back_and_match_numpy(stand_in):
    """clip_gradients' scale is computed on the device (no read of the norm), and the update is
    numpy's."""
    numpy_solver = tiny_solver(np, clip_gradients=0.05, iter_size=2)
    numpy_solver.step(4)
    solver = tiny_solver(stand_in, clip_gradients=0.05, iter_size=2)
    solver.step(1)
    stand_in.reset()
    solver.step(3)
    assert stand_in.syncs <= 2                            # the records read when step() returns
    for want, got in zip(params(numpy_solver), params(solver)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_the_displayed_loss_is_numpys(stand_in, caplog):
    def displayed(xp):
        solver = tiny_solver(xp, display=3, average_loss=4)
        with caplog.at_level(logging.INFO, logger="poseidon"):
            caplog.clear()
            solver.step(10)
        return [r.getMessage().split("loss = ")[1] for r in caplog.records
                if "iters), loss = " in r.getMessage()]
    want, got = displayed(np), displayed(stand_in)
    assert len(want) == len(got) == 4
    np.testing.assert_allclose([float(x) for x in got], [float(x) for x in want], rtol=1e-5)


class PoisonAt(SolverHooks):
    """Writes `value` into the first element of blob `name` before iteration `at`'s forward."""

    def __init__(self, at, name="data", value=float("nan")):
        self.at, self.name, self.value = at, name, value

    def before_forward(self, solver, it, layer):
        if it == self.at and layer == 0:
            solver.net.blobs[self.name].data.reshape(-1)[0] = self.value


def test_the_nan_stop_names_the_first_bad_iteration_and_layer(stand_in):
    """numpy stops at once; the device stops at the next display and names the same iteration
    and layer."""
    with pytest.raises(PoseidonError) as on_numpy:
        tiny_solver(np, hooks=PoisonAt(3), display=5).step(20)
    solver = tiny_solver(stand_in, hooks=PoisonAt(3), display=5)
    with pytest.raises(PoseidonError) as on_device:
        solver.step(20)
    assert "iteration 3: loss is nan" in str(on_numpy.value)
    assert "iteration 3: loss is not finite" in str(on_device.value)
    assert solver.iter == 5                               # read at the display of iteration 5
    for message in (str(on_numpy.value), str(on_device.value)):
        assert "layer 'ip2' (type InnerProduct)" in message


def test_the_nan_stop_comes_before_a_snapshot(stand_in, tmp_path):
    solver = tiny_solver(stand_in, hooks=PoisonAt(1), snapshot=3,
                         snapshot_prefix=str(tmp_path / "snap"))
    with pytest.raises(PoseidonError, match="iteration 1:"):
        solver.step(10)
    assert not list(tmp_path.iterdir())


def test_a_bad_label_stops_at_the_display_naming_the_layer(stand_in):
    solver = tiny_solver(stand_in, hooks=PoisonAt(2, "label", 7), display=4)
    with pytest.raises(ModelError) as bad:
        solver.step(10)
    assert solver.iter == 4                               # read at the display of iteration 4
    message = str(bad.value)
    assert "layer 'loss'" in message and "[0, 3)" in message and "\n" not in message
    with pytest.raises(ModelError, match=r"label 7 is not a class index in \[0, 3\)"):
        tiny_solver(np, labels=(0, 1, 2, 0, 7, 2, 0, 1)).step(1)


def test_negative_labels_are_caught_on_the_device_too(stand_in):
    solver = tiny_solver(stand_in, labels=(0, 1, 2, 0, -1, 2, 0, 1))
    with pytest.raises(ModelError, match="layer 'loss'"):
        solver.step(2)                                    # read when step() returns


SMALL_CONV = """
name: "small_conv"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 }
                      bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 5 kernel_size: 3 stride: 2 weight_filler { type: "gaussian" std: 0.3 }
                      bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" relu_param { negative_slope: 0.1 } }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu3" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("chunked", [False, True])
def test_the_stand_in_with_the_kernels_trains_as_numpy(monkeypatch, chunked):
    """Three steps of a net whose ReLUs are fused into the convolutions and the InnerProduct,
    on numpy and on the stand-in with the layers' kernels (host build): the same parameters
    (the kernel route writes the fresh diffs that numpy adds to, the NaN record and the update
    run through their twins). chunked: a sample a chunk, the first writing, the others adding."""
    monkeypatch.setenv("POSEIDON_CONV", "im2col")
    if chunked:
        from poseidon.engine.layers.conv.columns import Im2colConvCore
        monkeypatch.setattr(Im2colConvCore, "GPU_BLOCK_BYTES", 1)

    def trained(xp):
        sp = caffe_pb2.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=0.01,
                                       lr_policy="fixed", max_iter=100, display=0, random_seed=5)
        sp.net_param.CopyFrom(parse_net_text(SMALL_CONV))
        solver = get_solver(sp, xp=xp)
        assert solver.net.fused_relus == [(2, 3), (5, 6), (7, 8)]
        gen = np.random.RandomState(1)
        for name, value in (("data", gen.standard_normal((4, 3, 8, 8))),
                            ("label", np.array([0, 1, 2, 1]))):
            solver.net.blobs[name].data[...] = backend.to_xp(value.astype(np.float32), xp)
        solver.step(3)
        return params(solver)

    want = trained(np)
    xp = CountingModule()
    xp.use_kernels(kernel_host.runner)
    backend.set_array_module_for_tests(xp)
    try:
        got = trained(xp)
    finally:
        backend.set_array_module_for_tests(None)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# ----- the NaN/Inf record's kernel, without a GPU -------------------------------------------------
def test_the_nan_record_kernel_compiles_with_nvcc(tmp_path):
    import shutil
    import subprocess
    from poseidon.engine.solvers import health
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    source = tmp_path / "first_bad.cu"
    source.write_text(health.kernel_source("float") + health.kernel_source("double"))
    done = subprocess.run([nvcc, "--ptx", "-o", str(tmp_path / "first_bad.ptx"), str(source)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "first_bad_double" in (tmp_path / "first_bad.ptx").read_text()


def test_the_nan_record_kernel_is_its_numpy_twin(tmp_path):
    """The kernel body built for the CPU against the twin the stand-in runs: the entry of each
    parameter with a non-finite element drops to the iteration (never rises), the loss's too."""
    import ctypes
    import shutil
    import subprocess
    from poseidon.engine.solvers import health
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    source = tmp_path / "first_bad.cpp"
    source.write_text("#include <cmath>\nusing std::isfinite;\n"
                      "static long long atomicMin(long long* a, long long v) "
                      "{ long long old = *a; if (v < old) *a = v; return old; }\n"
                      + health.kernel_source("double", host=True))
    done = subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(tmp_path / "fb.so"),
                           str(source)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kernel = ctypes.CDLL(str(tmp_path / "fb.so")).first_bad_double
    off = np.array([0, 5, 6, 20, 31], np.int64)              # 4 parameters in flat order
    slot = np.array([2, 0, 3, 1], np.int64)                   # their parameter ids
    pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)     # noqa: E731
    got = np.full(5, health.NEVER, np.int64)
    want = got.copy()
    gen = np.random.default_rng(3)
    for it, (bad, loss) in enumerate([((), 1.0), ((5, 25), 1.0), ((0, 19), np.inf),
                                      ((30,), np.nan)]):
        g = gen.standard_normal(31)
        g[list(bad)] = [np.nan, np.inf][it % 2]
        loss = np.array([loss])
        kernel(pointer(g), pointer(off), pointer(slot), ctypes.c_int(4), pointer(loss),
               ctypes.c_longlong(it + 3), ctypes.c_longlong(4), pointer(got),
               ctypes.c_longlong(31))
        health._first_bad_twin(g, off, slot, np.int32(4), loss[0], it + 3, 4, want)
        np.testing.assert_array_equal(got, want)
    assert want.tolist() == [4, 4, 5, 5, 5]


# ----- precision: --tf32 ----------------------------------------------------------------------------
def test_tf32_is_asked_for_through_the_environment(monkeypatch):
    monkeypatch.delenv(backend.TF32_VARIABLE, raising=False)
    assert not backend.tf32_requested()
    said = backend.set_tf32(True)
    assert backend.tf32_requested()                       # a job's processes inherit it
    if backend.cupy is None:
        assert "CuPy is not installed" in said
    backend.set_tf32(False)
    assert not backend.tf32_requested()


def test_tf32_without_a_gpu_is_one_line(monkeypatch, capsys):
    from poseidon.tools import cli
    monkeypatch.delenv(backend.TF32_VARIABLE, raising=False)
    assert cli.main(["bench", "--tf32", "--no-plots", "--parts", ""]) == 1
    assert cli.main(["train", "--solver", "missing.prototxt", "--tf32"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("--tf32" in line and "--gpu" in line for line in err)
    assert not backend.tf32_requested()


def test_the_torch_reference_is_held_to_the_engines_precision():
    from types import SimpleNamespace
    from poseidon.tools.bench.torch_ref import set_precision
    torch = SimpleNamespace(backends=SimpleNamespace(cudnn=SimpleNamespace(allow_tf32=True),
                                                     cuda=SimpleNamespace(matmul=SimpleNamespace(
                                                         allow_tf32=True))))
    assert set_precision(torch, False) == "fp32"
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert set_precision(torch, True) == "tf32"
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32


# ----- the device probe, as far as the CPU goes -------------------------------------------------------
def test_the_probe_plan_fits_its_budget():
    from poseidon.tools.bench import gpu_probe
    full = gpu_probe.plan()
    assert [name for name, _ in full] == ["env", "tests", "layers", "timings", "launches",
                                          "layer_times", "capture"]
    assert sum(s for _, s in full) <= gpu_probe.BUDGET_S <= 7 * 60 - 20
    assert sum(s for _, s in gpu_probe.plan(budget=100)) <= 100
    assert gpu_probe.plan("capture,env") == [("env", 20), ("capture", 25)]
    with pytest.raises(ValueError, match="unknown probe part.*choose from env"):
        gpu_probe.plan("env,warp")
    args = gpu_probe.parse_args(["--gpu", "1", "--probe-parts", "timings", "--budget", "60"])
    assert (args.gpu, args.probe_parts, args.budget, args.part) == ("1", "timings", 60.0, None)


def test_the_probe_without_a_gpu_says_so_in_one_line(tmp_path):
    """Run as the image has it: no pyzmq, no lmdb (blocked here), and no GPU on this machine."""
    import subprocess
    import sys
    if backend.gpu_available():
        pytest.skip("this machine has a GPU")
    code = ("import sys; sys.modules['zmq'] = sys.modules['lmdb'] = None; "
            "from poseidon.tools import cli; "
            f"sys.exit(cli.main(['bench', '--gpu', '0', '--probe', '--out', r'{tmp_path}']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no GPU here" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_a_failed_or_slow_part_is_recorded_and_the_results_written(tmp_path):
    from poseidon.tools.bench import gpu_probe
    failed = gpu_probe.run_part("env", 30, 0, tmp_path)   # no GPU here: the child stops
    assert failed["status"] == "failed" and failed["last_lines"]
    slow = gpu_probe.run_part("env", 0.05, 0, tmp_path)
    assert slow["status"] == "timed out"
    results = {"gpu": "0", "budget_s": 400, "parts": {"env": failed, "timings": slow}}
    gpu_probe.write_results(results, tmp_path / "out")
    assert json_of(tmp_path / "out" / "results.json")["parts"]["timings"]["status"] == "timed out"
    text = (tmp_path / "out" / "results.md").read_text()
    assert "| env | failed |" in text and "| timings | timed out |" in text


def json_of(path):
    import json
    return json.loads(path.read_text())


def test_the_probe_report_reads_fake_measurements(tmp_path):
    from poseidon.tools.bench import gpu_probe
    measured = {"net": "cifar10_quick", "batch": 100, "status": "measured",
                "fp32": {"engine": 20.0, "torch": 5.0, "engine_speed_vs_torch": 0.25},
                "tf32": {"engine": 16.0, "torch": 4.0, "engine_speed_vs_torch": 0.25}}
    parts = {
        "env": {"status": "ok", "seconds": 3, "record": {
            "device": "NVIDIA H100 80GB HBM3", "cupy": "14.0.0", "skipped": [
                "the distributed tests and bench parts c-e, g: pyzmq is not installed"]}},
        "timings": {"status": "ok", "seconds": 140, "record": {"rows": [
            measured, {"net": "resnet50", "batch": 32, "status": "not run (time)"}]}},
        "launches": {"status": "ok", "seconds": 20, "record": {
            "stand_in": {"launches_per_step": 332, "host_syncs_per_step": 0},
            "engine_step": {"kernels": 340, "memcpy": 0, "memset": 10}}},
        "capture": {"status": "ok", "seconds": 9, "record": {
            "captured": False, "error": "CUDARuntimeError: operation not permitted"}}}
    gpu_probe.write_results({"gpu": "0", "budget_s": 400, "parts": parts}, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "| cifar10_quick | 100 | 20.0 | 5.0 | 0.25x | 16.0 | 4.0 | 0.25x |" in text
    assert "resnet50 | 32 | not run (time)" in text
    assert "pyzmq is not installed" in text and "332 launches and 0 host syncs" in text
    assert "captured: False; CUDARuntimeError" in text
    assert json_of(tmp_path / "results.json")["parts"]["launches"]["record"]["stand_in"][
        "launches_per_step"] == 332


def test_the_probes_stand_in_count_is_the_tests(cifar_counts):
    from poseidon.tools.bench.gpu_probe_parts import _stand_in_count
    routes = {name: "im2col" for name in ("conv1", "conv2", "conv3")}
    counted = _stand_in_count(routes, kernel_host.runner)
    assert counted["launches_per_step"] == cifar_counts["step"][0]
    assert counted["host_syncs_per_step"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")
def test_a_cupy_step_keeps_its_loss_on_the_device_and_trains_as_numpy():
    import cupy
    want = tiny_solver(np, clip_gradients=0.05, display=2)
    want.step(6)
    solver = tiny_solver(cupy, clip_gradients=0.05, display=2)
    assert isinstance(solver.net.loss_on_device(), cupy.ndarray)
    solver.step(6)
    for w, g in zip(params(want), params(solver)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    assert solver.smoothed_loss == pytest.approx(want.smoothed_loss, rel=1e-4)
    with pytest.raises(PoseidonError, match="iteration 3: loss is not finite"):
        tiny_solver(cupy, hooks=PoisonAt(3), display=5).step(20)


def test_a_test_nets_bad_label_stops_the_test(stand_in):
    solver = tiny_solver(stand_in, test_iter=2, test_interval=100)
    assert solver.test_all()[0]["loss"] > 0                # labels 0: fine
    solver.test_nets[0].blobs["label"].data[...] = 7
    with pytest.raises(ModelError, match="layer 'loss'.*not a class index"):
        solver.test_all()
