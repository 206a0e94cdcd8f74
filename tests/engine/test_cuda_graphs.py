"""CUDA graphs of a training step (engine/graphs.py), checked on the CPU: the counting stand-in
(poseidon/testing/launches.py) with its fake capture (poseidon/testing/fake_graphs.py) records the launches between
begin_capture and end_capture as closures, undoes them, and reruns them at each graph launch;
GEMMs and host reads raise during a capture, as on CuPy. Numbers are numpy's underneath, so a
step replayed from graphs must give bitwise the parameters of the same step run eagerly.
"""
import logging

import numpy as np
import pytest

from poseidon.engine import backend, graphs
from poseidon.testing.fake_graphs import CaptureError
from poseidon.testing.launches import CountingModule

STEPS = 5


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv("POSEIDON_CONV", "im2col")          # convolutions as GEMMs, as on CuPy
    xp = CountingModule()
    backend.set_array_module_for_tests(xp)
    try:
        yield xp
    finally:
        backend.set_array_module_for_tests(None)


def cifar_solver(xp, monkeypatch, graphs_on, batch=4):
    from poseidon.tools.bench import nets
    monkeypatch.setenv(graphs.ENV, "on" if graphs_on else "off")
    return nets.make_solver(nets.cifar10_quick(batch), xp=xp)


def params(solver):
    return [backend.to_numpy(b.data).copy() for b in solver.net.learnable_params]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


# ----- the fake capture itself ------------------------------------------------------------------
def test_the_stand_in_captures_as_cupy_does(stand_in):
    xp = stand_in
    a = xp.zeros(3, np.float32)
    b = xp.ones(3, np.float32)
    with pytest.raises(CaptureError):
        xp.cuda.Stream.null.begin_capture()                # the default stream cannot capture
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        a += b                                             # recorded, not run
        c = a * 2                                          # allocated inside: garbage until run
        with pytest.raises(NotImplementedError):
            xp.matmul(a.reshape(3, 1), b.reshape(1, 3))    # cuBLAS refuses a capture
        with pytest.raises(CaptureError):
            float(a[0])                                    # so does a host read
        graph = stream.end_capture()
    assert a.tolist() == [0, 0, 0] and np.isnan(c.view(np.ndarray)).all()
    graph.launch(stream)
    graph.launch(stream)
    assert a.tolist() == [2, 2, 2] and c.tolist() == [4, 4, 4]
    assert xp.graph_launches == 2


# ----- cifar10_quick ------------------------------------------------------------------------------
def test_the_segment_plan_of_cifar10_quick(stand_in, monkeypatch):
    """GEMM layers (convolutions through im2col, InnerProducts) and the Input layers run
    eagerly, and so do the loss (a fresh device scalar the step returns) and the softmax loss
    layer (its forward keeps the labels' indices as new arrays each step, which its backward
    reads); pooling, ReLU and the clearing of the gradients sit in the graphs between them."""
    solver = cifar_solver(stand_in, monkeypatch, True)
    solver.step(3)
    segments, eager = graphs.graphs_of(solver).describe()
    gemm_layers = ("conv1", "conv2", "conv3", "ip1", "ip2")
    expected = {f"{way} of layer '{name}'": "GEMM" for name in gemm_layers
                for way in ("forward", "backward")}
    expected.update({"forward of layer 'data'": "a source layer (host data)",
                     "forward of layer 'label'": "a source layer (host data)",
                     "backward of layer 'data'": "a source layer (host data)",
                     "backward of layer 'label'": "a source layer (host data)",
                     "forward of layer 'loss'": "keeps an array it allocated",
                     "backward of layer 'loss'": "its forward keeps an array it allocated",
                     "the loss": "returns the step's loss (a new array each step)"})
    assert eager == expected
    assert segments == [
        ["forward of layer 'pool1'", "forward of layer 'relu1'"],
        ["forward of layer 'relu2'", "forward of layer 'pool2'"],
        ["forward of layer 'relu3'", "forward of layer 'pool3'"],
        ["clearing the gradients"],
        ["backward of layer 'pool3'", "backward of layer 'relu3'"],
        ["backward of layer 'pool2'", "backward of layer 'relu2'"],
        ["backward of layer 'relu1'", "backward of layer 'pool1'"]]
    assert stand_in.graph_launches == len(segments)        # the third step replays each once


def new_batch(solver, i):
    """Step i's data and labels, written into the Input blobs' arrays (as a data layer does)."""
    from poseidon.tools.bench import nets
    net = solver.net
    data, label = nets.synthetic_batch(nets.cifar10_quick(net.blobs["data"].shape[0]), seed=i)
    net.blobs["data"].data[...] = backend.to_xp(data, net.xp)
    net.blobs["label"].data[...] = backend.to_xp(label, net.xp)


def run_both(stand_in, monkeypatch, steps, between=None):
    """Parameters after `steps` iterations with graphs and without, each step on a new batch
    (`between(solver, i)` runs after step i on both), and the graphs' solver."""
    out = []
    for on in (False, True):
        solver = cifar_solver(stand_in, monkeypatch, on)
        for i in range(steps):
            new_batch(solver, i)
            solver.step(1)
            if between:
                between(solver, i)
        out.append(params(solver))
        if on:
            graph_solver = solver
    return out[0], out[1], graph_solver


def test_replayed_steps_give_bitwise_the_eager_parameters(stand_in, monkeypatch):
    eager, replayed, solver = run_both(stand_in, monkeypatch, STEPS)
    assert_bitwise(eager, replayed)
    assert stand_in.graph_launches >= 7 * (STEPS - 2)
    first = cifar_solver(stand_in, monkeypatch, False)
    assert any(not np.array_equal(p, q) for p, q in zip(params(first), replayed))   # it trained


def test_a_changed_learning_rate_takes_effect_under_replay(stand_in, monkeypatch):
    def change(solver, i):
        solver.rule.param.base_lr *= 3 if i % 2 else 0.1
    eager, replayed, _ = run_both(stand_in, monkeypatch, STEPS, change)
    assert_bitwise(eager, replayed)
    same_rate, _, _ = run_both(stand_in, monkeypatch, STEPS)
    assert any(not np.array_equal(p, q) for p, q in zip(same_rate, replayed))


def test_a_reshape_captures_again(stand_in, monkeypatch, caplog):
    def smaller_batch(solver, i):
        if i == 3:
            net = solver.net
            net.blobs["data"].reshape((2,) + net.blobs["data"].shape[1:])
            net.blobs["label"].reshape((2,))
            net.reshape()
    caplog.set_level(logging.INFO, logger="poseidon")
    eager, replayed, solver = run_both(stand_in, monkeypatch, 8, smaller_batch)
    assert_bitwise(eager, replayed)
    assert any("capturing again" in r.getMessage() for r in caplog.records)
    before = stand_in.graph_launches
    solver.step(1)                                         # the new shapes' graphs replay
    assert stand_in.graph_launches == before + 7


def after_forward(layer, action, from_call=1):
    """Make `layer`'s forward do action(top) after its own work from its `from_call`-th call on."""
    forward, calls = layer.forward, [0]

    def forward_then(bottom, top):
        forward(bottom, top)
        calls[0] += 1
        if calls[0] >= from_call:
            action(top)
    layer.forward = forward_then


def keep_a_new_array(layer, xp, from_call=1):
    def keep(top):
        layer.kept = xp.zeros_like(top[0].data)
    after_forward(layer, keep, from_call)


def test_a_layer_that_keeps_a_new_array_runs_eagerly(stand_in, monkeypatch, caplog):
    """Seen while watching the warm-up: planned eagerly from the start."""
    caplog.set_level(logging.INFO, logger="poseidon")
    solver = cifar_solver(stand_in, monkeypatch, True)
    keep_a_new_array(solver.net.layer_dict["pool2"], stand_in)
    solver.step(3)
    _, eager = graphs.graphs_of(solver).describe()
    assert eager["forward of layer 'pool2'"] == "keeps an array it allocated"
    assert eager["backward of layer 'pool2'"] == "its forward keeps an array it allocated"
    lines = [r.getMessage() for r in caplog.records if "pool2" in r.getMessage()]
    assert lines == ["CUDA graphs: the forward of layer 'pool2' keeps an array it allocated in a "
                     "warmed-up step; the layer runs eagerly"]


def test_an_allocation_first_made_inside_a_capture_is_caught(stand_in, monkeypatch, caplog):
    """A layer that starts keeping new arrays at the capture: the capture is dropped, its calls
    run eagerly (the step's numbers stay right), one line names the layer, and the next plan
    runs it eagerly."""
    caplog.set_level(logging.INFO, logger="poseidon")

    def from_capture(solver, i):
        if i == 0:
            layer = solver.net.layer_dict["pool2"]
            keep_a_new_array(layer, solver.net.xp, from_call=2)
    eager, replayed, solver = run_both(stand_in, monkeypatch, 7, from_capture)
    assert_bitwise(eager, replayed)
    lines = [r.getMessage() for r in caplog.records if "pool2" in r.getMessage()]
    assert lines == ["CUDA graphs: the forward of layer 'pool2' keeps an array it allocated; "
                     "it runs eagerly"]
    _, planned = graphs.graphs_of(solver).describe()
    assert {"forward of layer 'pool2'", "backward of layer 'pool2'"} <= set(planned)


def test_an_array_another_layer_holds_is_checked_before_a_replay(stand_in, monkeypatch, caplog):
    """As a BatchNorm + Scale pair shares state: relu2's forward keeps a copy of its top each
    step (so it runs eagerly), and pool2 holds relu2 and reads that copy in its backward. The
    captured backward would read the copy of the capture's step; the check before the replay
    finds the array moved, finishes the step eagerly, names pool2, and runs it eagerly."""
    caplog.set_level(logging.INFO, logger="poseidon")

    def share(solver, i):
        if i == 0:
            relu2, pool2 = (solver.net.layer_dict[n] for n in ("relu2", "pool2"))
            after_forward(relu2, lambda top: setattr(relu2, "kept", top[0].data * 1))
            pool2.partner = relu2
            backward = pool2.backward

            def backward_reading(top, propagate_down, bottom):
                backward(top, propagate_down, bottom)
                bottom[0].diff[...] += pool2.partner.kept.mean() * 1e-3
            pool2.backward = backward_reading
    eager, replayed, solver = run_both(stand_in, monkeypatch, 7, share)
    assert_bitwise(eager, replayed)
    lines = [r.getMessage() for r in caplog.records if "'pool2'" in r.getMessage()
             and r.levelno == logging.WARNING]
    assert lines == ["CUDA graphs: layer 'pool2' holds a new array in 'partner.kept' each step; "
                     "its calls run eagerly"]
    segments, planned = graphs.graphs_of(solver).describe()
    assert "backward of layer 'pool2'" in planned
    assert not any("pool2" in label for segment in segments for label in segment)


def test_a_host_read_met_in_a_capture_falls_back_to_eager(stand_in, monkeypatch, caplog):
    """A layer that starts reading a device value on the host at the capture: the capture is
    refused, the calls rerun eagerly with the same numbers, and one line names the layer."""
    caplog.set_level(logging.INFO, logger="poseidon")
    reads = []

    def from_capture(solver, i):
        if i == 0:
            after_forward(solver.net.layer_dict["relu2"],
                          lambda top: reads.append(float(top[0].data.sum())), from_call=2)
    eager, replayed, solver = run_both(stand_in, monkeypatch, 6, from_capture)
    assert_bitwise(eager, replayed)
    lines = [r.getMessage() for r in caplog.records if "relu2" in r.getMessage()]
    assert len(lines) == 1 and "cannot be captured (CaptureError" in lines[0]
    _, planned = graphs.graphs_of(solver).describe()
    assert "forward of layer 'relu2'" in planned


def test_graphs_are_off_by_default_and_for_numpy(stand_in, monkeypatch):
    monkeypatch.delenv(graphs.ENV, raising=False)
    assert not graphs.enabled()
    from poseidon.tools.bench import nets
    solver = nets.make_solver(nets.cifar10_quick(2), xp=stand_in)
    solver.step(3)
    assert graphs.graphs_of(solver) is None and stand_in.graph_launches == 0
    monkeypatch.setenv(graphs.ENV, "on")                   # numpy: nothing to capture
    solver = nets.make_solver(nets.cifar10_quick(2), xp=np)
    solver.step(3)
    assert graphs.graphs_of(solver) is None


def test_the_train_flag_sets_the_variable(monkeypatch):
    from poseidon.tools import cli
    monkeypatch.setenv(graphs.ENV, "off")                 # restored after the test
    assert not graphs.enabled()
    with pytest.raises(SystemExit):
        cli.main(["train", "--cuda-graphs", "sometimes"])
    try:
        cli.main(["train", "--cuda-graphs", "on"])         # no solver: stops after the flag
    except SystemExit:
        pass
    assert graphs.enabled()


# ----- a real GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_captured_cifar10_quick_step_matches_eager_on_cupy(monkeypatch):
    cupy = pytest.importorskip("cupy")
    if not backend.gpu_available():
        pytest.skip("no GPU")
    from poseidon.tools.bench import nets
    monkeypatch.setenv("POSEIDON_CONV", "im2col")
    results = []
    for on in ("off", "on"):
        monkeypatch.setenv(graphs.ENV, on)
        solver = nets.make_solver(nets.cifar10_quick(32), xp=cupy)
        solver.step(6)
        results.append(params(solver))
        if on == "on":
            assert graphs.graphs_of(solver).describe() is not None
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
