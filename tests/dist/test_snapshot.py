"""Distributed snapshots, exact resume, the distributed TEST phase, BatchNorm statistics.

A snapshot of a distributed run is one Caffe snapshot by worker 0 (weights; solverstate whose
history comes from the servers for PS layers and from worker 0 for SFB layers) plus a cursor file
per worker; resuming it gives bitwise the parameters of the uninterrupted run (CPU).

Run: python -m pytest tests/dist/test_snapshot.py -q
"""
import os

import numpy
import pytest

from poseidon.dist.worker.snapshots import worker_cursor_path
from poseidon.dist.worker.hooks import WorkerHooks
from poseidon.engine.io import caffemodel
from poseidon.engine.solvers import get_solver

from .helpers import (assert_params_close, conv_net, fc_net, make_lmdb, params_of,
                      run_processes, run_threads, solver_param)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("db")
    return make_lmdb(folder / "train"), make_lmdb(folder / "test", n=40, seed=1)


def snap_param(train, test, prefix, max_iter=20, batch=2, test_batch=5):
    net = conv_net(train, batch, test_source=test, test_batch=test_batch)
    p = solver_param(net, max_iter=max_iter)
    p.snapshot = 10
    p.snapshot_prefix = str(prefix)
    p.test_iter.append(4)
    p.test_interval = 10
    p.test_initialization = False
    return p


@pytest.mark.slow
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(data, tmp_path):
    train, test = data
    P1, P2 = 2, 1
    # float32, the real mode (the engine writes snapshots in float32, as Caffe's Blob<float>)
    full = run_threads(snap_param(train, test, tmp_path / "a" / "run"), P1, P2, dtype="float32")
    want = [params_of(s) for s in full]
    state10 = str(tmp_path / "a" / "run_iter_10.solverstate")
    for name in ("run_iter_10.caffemodel", "run_iter_10.solverstate", "run_iter_10.cursors.json",
                 "run_iter_10.cursors.worker-1.json", "run_iter_20.solverstate"):
        assert os.path.exists(tmp_path / "a" / name), name
    assert worker_cursor_path(state10, 1).endswith("run_iter_10.cursors.worker-1.json")

    resumed = run_threads(snap_param(train, test, tmp_path / "b" / "run"), P1, P2,
                          snapshot=state10, dtype="float32")
    assert resumed[0].solver.iter == 20
    for got, exp in zip(resumed, want):
        for a, b in zip(params_of(got), exp):
            assert numpy.array_equal(a, b), "resumed run differs from the uninterrupted one"
    # the final solver states (history from the servers for PS, from worker 0 for SFB) agree too
    ha = caffemodel.read_solverstate(str(tmp_path / "a" / "run_iter_20.solverstate"))
    hb = caffemodel.read_solverstate(str(tmp_path / "b" / "run_iter_20.solverstate"))
    assert ha.iter == hb.iter == 20
    assert len(ha.history) == len(hb.history) > 0
    for x, y in zip(ha.history, hb.history):
        assert numpy.array_equal(numpy.asarray(x), numpy.asarray(y))
    assert any(numpy.abs(numpy.asarray(h)).max() > 0 for h in ha.history)


@pytest.mark.slow
def test_processes_resume_bitwise_equal_to_an_uninterrupted_run(data, tmp_path):
    """The case above as `poseidon train` processes: a job resumed from the uninterrupted one's
    snapshot at 10 (--snapshot) ends with its parameters and solver history, bit for bit."""
    train, test = data
    full = run_processes(snap_param(train, test, tmp_path / "unused"), 2, 1, tmp_path / "a",
                         dtype="float32")
    folder_a = tmp_path / "a" / "process-job"
    resumed = run_processes(snap_param(train, test, tmp_path / "unused"), 2, 1, tmp_path / "b",
                            dtype="float32", snapshot=str(folder_a / "snap_iter_10.solverstate"))
    for a, b in zip(resumed, full):
        assert numpy.array_equal(a, b), "resumed processes differ from the uninterrupted ones"
    ha = caffemodel.read_solverstate(str(folder_a / "snap_iter_20.solverstate"))
    hb = caffemodel.read_solverstate(str(tmp_path / "b" / "process-job" /
                                         "snap_iter_20.solverstate"))
    assert ha.iter == hb.iter == 20
    assert len(ha.history) == len(hb.history) > 0
    for x, y in zip(ha.history, hb.history):
        assert numpy.array_equal(numpy.asarray(x), numpy.asarray(y))


@pytest.mark.slow
def test_snapshot_restores_in_one_process(data, tmp_path):
    """The distributed snapshot is a normal Caffe snapshot with complete solver state: one process
    restores it (its data cursor aside) and its next update matches one process's own."""
    train, test = data
    P1, K = 2, 2
    weights = str(tmp_path / "init.caffemodel")
    single = snap_param(train, test, tmp_path / "s" / "run", max_iter=11, batch=P1 * K)
    ref = get_solver(single, dtype=numpy.float64)
    ref.net.save(weights)
    ref.step(10)
    at10 = params_of(ref)
    ref.step(1)
    step_ref = [b - a for a, b in zip(at10, params_of(ref))]

    run_threads(snap_param(train, test, tmp_path / "d" / "run", max_iter=10, batch=K), P1, 1,
                weights=weights)
    state = str(tmp_path / "d" / "run_iter_10.solverstate")
    one = get_solver(single, dtype=numpy.float64)
    for net in [one.net] + one.test_nets:               # worker 0's cursors are of shard (0, 2)
        net.set_data_cursors = lambda cursors: None
    one.restore(state)                                   # weights, history, iter
    assert one.iter == 10
    for _ in range(10):                                  # the data position of iteration 10
        one.net.ForwardLayer(0)
    before = params_of(one)
    assert_params_close(before, at10, rtol=1e-5, label="weights at 10")
    one.step(1)
    step_one = [b - a for a, b in zip(before, params_of(one))]
    assert_params_close(step_one, step_ref, rtol=1e-4, label="update 11 (needs the history)")
    for s in (one, ref):
        s.net.shutdown()


@pytest.mark.slow
def test_distributed_test_phase_averages_the_shares(data, tmp_path):
    """Each worker tests test_iter / P1 batches of its shard; the averaged outputs equal one
    process testing test_iter batches with the same weights."""
    train, test = data
    P1 = 2
    solvers = run_threads(snap_param(train, test, tmp_path / "t" / "run"), P1, 1)
    got = solvers[0].solver.last_test_results[0]
    assert set(got) == {"accuracy", "loss"}
    assert solvers[1].solver.last_test_results[0] == got
    one = get_solver(snap_param(train, test, tmp_path / "o" / "run"), dtype=numpy.float64)
    for blob, value in zip(one.net.learnable_params, params_of(solvers[0])):
        blob.data[...] = value
    one.test(0)                       # the test at iteration 10 read the first test_iter batches
    want = one.test(0)                # the one at 20 the next ones (test data is not rewound)
    one.net.shutdown()
    for key in got:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key


@pytest.mark.slow
def test_batchnorm_statistics_are_averaged(data, tmp_path, monkeypatch):
    train, _ = data
    net = fc_net(train, 4).replace(
        'layer { name: "relu1"',
        'layer { name: "bn1" type: "BatchNorm" bottom: "ip1" top: "ip1" }\nlayer { name: "relu1"')
    p = solver_param(net, max_iter=3)
    p.snapshot_prefix = str(tmp_path / "bn" / "run")
    seen = {}
    original = WorkerHooks._average_statistics

    def spy(self):
        before = [numpy.array(b.data) for b in self.net.layer_dict["bn1"].blobs]
        original(self)
        seen.setdefault(self.rank, []).append(
            (before, [numpy.array(b.data) for b in self.net.layer_dict["bn1"].blobs]))
    monkeypatch.setattr(WorkerHooks, "_average_statistics", spy)
    solvers = run_threads(p, 2, 1)
    (b0, a0), (b1, a1) = seen[0][-1], seen[1][-1]
    assert not all(numpy.array_equal(x, y) for x, y in zip(b0, b1))   # workers saw other data
    for x, y, m0, m1 in zip(b0, b1, a0, a1):
        numpy.testing.assert_allclose(m0, (x + y) / 2, rtol=1e-12)
        assert numpy.array_equal(m0, m1)
    stats = [numpy.array(b.data) for b in solvers[0].net.layer_dict["bn1"].blobs]
    saved = caffemodel.read_net_proto(str(tmp_path / "bn" / "run_iter_3.caffemodel"))
    layer = [lp for lp in saved.layer if lp.name == "bn1"][0]
    for blob, want in zip(layer.blobs, stats):
        saved_values = caffemodel.proto_to_array(blob).reshape(want.shape)     # stored as float32
        numpy.testing.assert_array_equal(saved_values, want.astype(saved_values.dtype))
