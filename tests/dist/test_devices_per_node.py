"""--devices-per-node G: each worker is a node of G replicas behind one leader (engine/replicas.py).

* P1 = 2 workers of G = 2 replicas with batch K end with the parameters of ONE process on the
  combined batch P1·G·K (float64), under --sync ps and --sync hybrid, where the FC layers go by
  SFB between the leaders with each leader's factors stacked (K·G rows); the leaders stay
  bitwise identical.
* The P1·G replicas read disjoint shares of the data: within an epoch no record twice, none left.
* Bad flags (G < 1, G against a --gpu list of another length) are one line, before any process
  starts.
* On a GPU (marked `gpu`): two workers of two replicas on one device equal the numpy reference.

Every role runs as a thread of this process over real ZeroMQ sockets (tests/dist/helpers.py).
Run: python -m pytest tests/dist/test_devices_per_node.py -q
"""
import numpy
import pytest

from poseidon.dist.errors import DistError
from poseidon.dist.job.options import DistOptions
from poseidon.engine import backend
from poseidon.engine.io.datum import array_to_datum
from poseidon.engine.io.lmdb_store import write_lmdb
from poseidon.engine.solvers import get_solver
from poseidon.tools import cli

from .helpers import (assert_params_close, fc_net, make_lmdb, params_of, reference,
                      run_processes, run_threads, solver_param)

P1, G, K, ITERS = 2, 2, 4, 10


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


@pytest.fixture(scope="module")
def combined(data, tmp_path_factory):
    """(initial weights, parameters of one process trained on the batch P1·G·K)."""
    weights = str(tmp_path_factory.mktemp("init") / "init.caffemodel")
    want = reference(solver_param(fc_net(data, P1 * G * K), max_iter=ITERS), weights_out=weights)
    return weights, want


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["ps", "hybrid"])
def test_workers_of_two_replicas_equal_one_process(data, combined, sync):
    weights, want = combined
    solvers = run_threads(solver_param(fc_net(data, K), max_iter=ITERS), P1, 1, weights=weights,
                          sync=sync, devices_per_node=G)
    for s in solvers:
        s.solver.replicas.shutdown()
    book = solvers[0].book
    assert all(rec.K == K * G for rec in book.layers)       # a leader's factors: K·G rows
    schemes = {rec.name: rec.scheme for rec in book.layers}
    if sync == "hybrid":
        assert "sfb" in schemes.values(), schemes
    else:
        assert set(schemes.values()) == {"ps"}
    for s in solvers:
        assert s.solver.replicas.count == G and s.solver.iter == ITERS
        assert_params_close(params_of(s), want, rtol=1e-5, label=f"P1={P1} G={G} {sync}")
    for a, b in zip(params_of(solvers[0]), params_of(solvers[1])):
        assert numpy.array_equal(a, b), "the leaders differ"


@pytest.mark.slow
def test_processes_of_two_replicas_equal_one_process(data, combined, tmp_path):
    """The hybrid case above as `poseidon train --devices-per-node 2` processes: one process on
    the combined batch P1·G·K within 1e-5, and the leaders bitwise equal."""
    weights, want = combined
    got = run_processes(solver_param(fc_net(data, K), max_iter=ITERS), P1, 1, tmp_path,
                        weights=weights, sync="hybrid", devices_per_node=G)
    assert_params_close(got, want, rtol=1e-5, label=f"processes: P1={P1} G={G} hybrid")


def test_replicas_of_all_workers_share_out_an_epoch(tmp_path):
    """Records labelled by their index: over one epoch the P1·G replicas' batches hold every
    index exactly once."""
    n, batch = 48, 3
    source = str(tmp_path / "indexed")
    write_lmdb(source, (array_to_datum(numpy.full((1, 2, 2), i, numpy.uint8), label=i)
                        .SerializeToString() for i in range(n)))
    param = solver_param(fc_net(source, batch, classes=n), base_lr=0.0)
    solvers = [get_solver(param, shard=(rank, P1), replicas=G) for rank in range(P1)]
    seen = []
    for _ in range(n // (P1 * G * batch)):
        for s in solvers:
            s.step(1)
            seen += [int(v) for net in s.replicas.nets for v in net.blobs["label"].data]
    for s in solvers:
        s.net.shutdown()
        s.replicas.shutdown()
    assert sorted(seen) == list(range(n))


def one_line_error(capsys, *argv):
    assert cli.main([str(a) for a in argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("poseidon train: error:") and "\n" not in err, err
    return err


def test_bad_devices_per_node_is_one_line(capsys, tmp_path, data):
    solver = tmp_path / "solver.prototxt"
    net = tmp_path / "net.prototxt"
    net.write_text(fc_net(data, K))
    solver.write_text(f'net: "{net}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 1\n')
    err = one_line_error(capsys, "train", "--solver", solver, "--workers", "2",
                         "--gpu", "0,1", "--devices-per-node", "3")
    assert "--devices-per-node 3" in err and "2 devices" in err
    err = one_line_error(capsys, "train", "--solver", solver, "--workers", "2",
                         "--devices-per-node", "0")
    assert "--devices-per-node 0" in err and "at least 1" in err
    err = one_line_error(capsys, "train", "--solver", solver, "--devices-per-node", "-1")
    assert "--devices-per-node -1" in err
    with pytest.raises(DistError) as e:
        DistOptions(workers=2, devices_per_node=0)
    assert "at least 1" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")
def test_two_workers_of_two_replicas_on_one_gpu(data, combined):
    weights, want = combined
    backend.set_mode_gpu(0)
    try:
        solvers = run_threads(solver_param(fc_net(data, K), max_iter=ITERS), P1, 1,
                              weights=weights, sync="hybrid", devices_per_node=G)
        for s in solvers:
            s.solver.replicas.shutdown()
            assert s.net.xp is not numpy
            assert_params_close(params_of(s), want, rtol=1e-5, label="gpu P1=2 G=2")
    finally:
        backend.set_mode_cpu()
