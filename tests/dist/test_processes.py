"""Real processes: the multi-host form on one machine (explicit --rank / mpirun's variable), a
process SIGKILLed mid-run (launcher and multi-host), the local launcher on the digits demo net,
and the checks that stop a job whose processes disagree.

Run: python -m pytest tests/dist/test_processes.py -q
"""
import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

from poseidon.dist.errors import DistError
from poseidon.dist.transport import free_port
from poseidon.engine.io import caffemodel, manifest
from poseidon.engine.solvers import get_solver

from .helpers import (assert_params_close, conv_net, fc_net, make_lmdb, run_threads, solver_param)
from .jobs import env

ROOT = Path(__file__).resolve().parents[2]


def write_solver(folder, net_text, max_iter, snapshot=0, extra=""):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "net.prototxt").write_text(net_text)
    (folder / "solver.prototxt").write_text(f"""
net: "{folder / 'net.prototxt'}"
base_lr: 0.05
momentum: 0.9
weight_decay: 0.001
lr_policy: "step"
gamma: 0.5
stepsize: 7
max_iter: {max_iter}
display: 0
snapshot: {snapshot}
snapshot_prefix: "{folder / 'snap' / 'run'}"
random_seed: 3
{extra}
""")
    return str(folder / "solver.prototxt")


def cli(*args):
    return [sys.executable, "-m", "poseidon.tools.cli", "train", *map(str, args)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:      # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ----- multi-host form -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("ipc", ["auto", "zmq", "off"])
def test_multi_host_form_with_explicit_ranks(data, tmp_path, ipc):
    """Three separate processes, each with --coordinator and its own rank (rank 1 from mpirun's
    OMPI_COMM_WORLD_RANK), train to the same parameters as one process on the combined batch,
    over Unix sockets between them (--ipc auto: they share this host, and the KV pushes and
    their answers go on direct links; --ipc zmq: every message through ZeroMQ) and over TCP
    with CURVE (--ipc off)."""
    P1, P2, K, iters = 2, 1, 8, 8
    ref = get_solver(solver_param(fc_net(data, P1 * K), max_iter=iters), dtype=numpy.float64)
    weights = str(tmp_path / "init.caffemodel")
    ref.net.save(weights)
    ref.net.copy_from(weights)          # the file holds float32: start both runs from it
    ref.step(iters)
    want = [numpy.array(b.data) for b in ref.net.learnable_params]
    ref.net.shutdown()

    solver = write_solver(tmp_path / "job", fc_net(data, K), iters)
    address = f"tcp://127.0.0.1:{free_port()}"
    common = ["--solver", solver, "--workers", P1, "--servers", P2, "--coordinator", address,
              "--dtype", "float64", "--weights", weights, "--timeout", 30, "--ipc", ipc]
    procs = []
    for rank in range(P1 + P2):
        e = env()
        args = list(common)
        if rank == 1:
            e["OMPI_COMM_WORLD_RANK"] = "1"          # as mpirun would set it
        else:
            args += ["--rank", rank]
        procs.append(subprocess.Popen(cli(*args), env=e, cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
        local = re.search(r": ([^:]*) on this host: Unix sockets", out)
        if ipc == "off":
            assert local is None, out
        elif rank != 1:   # each peer over a Unix socket (worker 1 logs warnings only)
            peers = {0: "server 0, worker 1", 2: "worker 0, worker 1"}
            assert local is not None and local.group(1) == peers[rank], out
            assert ("on direct links" in out) == (ipc == "auto"), out
    # --bucket-bytes auto: buckets when the processes share this host, none with --ipc off
    assert ("one host: consecutive PS layers" in outs[0]) == (ipc != "off"), outs[0]
    snap = tmp_path / "job" / "snap" / f"run_iter_{iters}.caffemodel"
    assert snap.exists(), outs[0]
    proto = caffemodel.read_net_proto(str(snap))
    got = [caffemodel.proto_to_array(b) for lp in proto.layer for b in lp.blobs]
    assert_params_close([g.reshape(w.shape) for g, w in zip(got, want)], want, rtol=1e-5,
                        label="multi-host")


# ----- a process killed mid-run --------------------------------------------------------------------
def _last_snapshot(folder):
    manifests = glob.glob(str(Path(folder) / "run_iter_*.manifest.json"))
    assert manifests, "no complete snapshot was written before the kill"
    last = max(manifests, key=lambda p: int(re.search(r"_iter_(\d+)\.", p).group(1)))
    manifest.verify_manifest(last)                         # every file complete and unaltered
    state = last.replace(".manifest.json", ".solverstate")
    st = caffemodel.read_solverstate(state)
    assert st.iter > 0 and len(st.history) > 0
    assert os.path.exists(state.replace(".solverstate", ".cursors.worker-1.json"))
    return state


def _wait_for_snapshot(folder, procs, limit=60):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if glob.glob(str(Path(folder) / "run_iter_*.manifest.json")):
            return
        for p in procs:
            assert p.poll() is None, "a process ended before the first snapshot"
        time.sleep(0.1)
    raise AssertionError("no snapshot within the time limit")


@pytest.mark.slow
def test_sigkill_under_the_launcher_stops_everyone(data, tmp_path):
    solver = write_solver(tmp_path / "job", conv_net(data, 4), 1_000_000, snapshot=5)
    launcher = subprocess.Popen(cli("--solver", solver, "--workers", 2, "--servers", 1),
                                env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    lines = []
    pids = None
    while pids is None:
        line = launcher.stdout.readline().decode()
        assert line, "launcher ended early:\n" + "".join(lines)
        lines.append(line)
        m = re.match(r"poseidon: worker 0 pid (\d+), worker 1 pid (\d+), server 0 pid (\d+)", line)
        if m:
            pids = [int(x) for x in m.groups()]
    _wait_for_snapshot(tmp_path / "job" / "snap", [launcher])
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = launcher.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    text = "".join(lines) + out.decode()
    assert elapsed < 30, f"took {elapsed:.1f} s to stop"
    assert launcher.returncode != 0
    assert f"worker 1 (pid {pids[1]}) was killed by SIGKILL" in text
    for who in ("worker 0", "server 0"):
        assert re.search(rf"\[{who}\] .*stopping: .*worker 1", text), text[-3000:]
    assert not any(alive(pid) for pid in pids), "a process was left behind"
    _last_snapshot(tmp_path / "job" / "snap")


@pytest.mark.slow
@pytest.mark.parametrize("victim", [2, 0], ids=["server", "worker0-with-coordinator"])
def test_sigkill_in_a_multi_host_job(data, tmp_path, victim):
    """No launcher: the others learn of the loss from the heartbeats and stop, naming it."""
    solver = write_solver(tmp_path / "job", conv_net(data, 4), 1_000_000, snapshot=5)
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(cli("--solver", solver, "--workers", 2, "--servers", 1,
                                  "--coordinator", address, "--rank", r, "--heartbeat-timeout", 3),
                              env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
             for r in range(3)]
    try:
        _wait_for_snapshot(tmp_path / "job" / "snap", procs)
        procs[victim].kill()
        t0 = time.monotonic()
        outs = {}
        for r, p in enumerate(procs):
            if r != victim:
                outs[r] = p.communicate(timeout=45)[0].decode()
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert elapsed < 30, f"took {elapsed:.1f} s to stop"
    lost = "server 0 (rank 2)" if victim == 2 else "the coordinator (beside worker 0)"
    for r, out in outs.items():
        assert procs[r].returncode != 0
        assert "stopping" in out and lost in out, out[-2000:]
    _last_snapshot(tmp_path / "job" / "snap")


# ----- the launcher on the demo net ----------------------------------------------------------------
@pytest.mark.slow
def test_launcher_trains_the_digits_demo_net(tmp_path):
    """`poseidon train --workers 2 --servers 1` on the digits demo set and model (a test copy of
    prototxt/digits_quick with smaller batches and 6 iterations)."""
    from poseidon.engine.io.datasets import make_digits_lmdb
    make_digits_lmdb(str(tmp_path / "data" / "digits"))
    net = (ROOT / "prototxt" / "digits_quick" / "train_val.prototxt").read_text()
    net = net.replace("batch_size: 64", "batch_size: 16").replace("batch_size: 100",
                                                                  "batch_size: 25")
    (tmp_path / "train_val.prototxt").write_text(net)
    solver = (ROOT / "prototxt" / "digits_quick" / "solver.prototxt").read_text()
    for key, value in (("max_iter", 6), ("test_interval", 6), ("test_iter", 2), ("display", 3),
                       ("snapshot", 0)):
        solver = re.sub(rf"\n{key}: \d+", f"\n{key}: {value}", solver)
    (tmp_path / "solver.prototxt").write_text(solver)
    stats = tmp_path / "stats.jsonl"
    r = subprocess.run(cli("--solver", "solver.prototxt", "--workers", 2, "--servers", 1,
                           "--stats", stats, "--timeline", tmp_path / "trace.json"),
                       env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=240)
    out = r.stdout.decode()
    assert r.returncode == 0, out[-4000:]
    assert "[worker 0]" in out and "poseidon: all processes finished" in out
    assert re.search(r"\[worker 0\] Final test accuracy \(net #0\): [0-9.]+", out), out[-3000:]
    assert (tmp_path / "stats.worker-1.jsonl").exists() and (tmp_path / "stats.server-0.jsonl").exists()
    assert (tmp_path / "trace.json").exists()
    assert (tmp_path / "snapshots" / "digits_quick_iter_6.caffemodel").exists()


# ----- disagreement and impossible layouts (threads: fast) --------------------------------------------
def test_ranks_with_different_options_are_stopped_naming_both(data, tmp_path):
    from poseidon.dist.job.process import run_role
    import threading
    address = f"tcp://127.0.0.1:{free_port()}"
    errors = {}

    def role(rank, sync):
        job = {"solver": solver_param(fc_net(data, 4), max_iter=2), "options": dict(
            workers=2, servers=1, coordinator=address, local=True, sync=sync, timeout=20,
            start_timeout=20, dtype="float64")}
        try:
            run_role(job, rank, in_thread=True)
        except Exception as e:
            errors[rank] = e

    threads = [threading.Thread(target=role, args=(r, s)) for r, s in
               ((0, "hybrid"), (1, "ps"), (2, "hybrid"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(errors) == {0, 1, 2}
    for e in errors.values():
        assert isinstance(e, DistError)
        assert "worker 0 and worker 1 were started with different options" in str(e)
        assert "sync: 'hybrid' vs 'ps'" in str(e)


def test_workers_with_different_networks_are_stopped(data, tmp_path):
    from poseidon.dist.job.process import run_role
    import threading
    address = f"tcp://127.0.0.1:{free_port()}"
    errors = {}

    def role(rank, classes):
        job = {"solver": solver_param(fc_net(data, 4, classes=classes), max_iter=2),
               "options": dict(workers=2, servers=1, coordinator=address, local=True,
                               timeout=20, start_timeout=20, dtype="float64")}
        try:
            run_role(job, rank, in_thread=True)
        except Exception as e:
            errors[rank] = e

    threads = [threading.Thread(target=role, args=(r, c)) for r, c in ((0, 5), (1, 6), (2, 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(errors) == {0, 1, 2}
    text = str(errors[2])
    assert "worker 0 and worker 1 do not train the same network" in text and "'ip3'" in text


@pytest.mark.slow
def test_no_servers_refused_for_convolutions_under_sync_sfb(data):
    """--sync sfb sends a convolution by PS, which --servers 0 cannot (under hybrid the ring
    takes it: tests/dist/test_allreduce.py)."""
    with pytest.raises(DistError, match=r"--servers 0 needs every layer .*'conv1' \(Convolution\)"):
        run_threads(solver_param(conv_net(data, 2), max_iter=2), 2, 0, timeout=20, sync="sfb")


@pytest.mark.slow
def test_no_servers_with_an_all_fc_net(data, tmp_path):
    weights = str(tmp_path / "w.caffemodel")
    ref = solver_param(fc_net(data, 8), max_iter=5)
    from .helpers import reference, params_of
    want = reference(ref, weights_out=weights)
    solvers = run_threads(solver_param(fc_net(data, 4), max_iter=5), 2, 0, weights=weights)
    assert all(rec.scheme == "sfb" for rec in solvers[0].book.layers)
    assert_params_close(params_of(solvers[0]), want, rtol=1e-5, label="servers 0")


# ----- convergence: 4 workers + 2 servers vs one process on the combined batch -------------------
def _digits_run(tmp_path, name, batch, extra_args):
    folder = tmp_path / name
    folder.mkdir()
    net = (ROOT / "prototxt" / "digits_quick" / "train_val.prototxt").read_text()
    net = net.replace("batch_size: 64", f"batch_size: {batch}")
    net = net.replace("data/digits/", str(tmp_path / "data" / "digits") + "/")
    assert net.count("std: 0.0001") == 1                # conv1's filler (see the test)
    net = net.replace("std: 0.0001", "std: 0.01")
    (folder / "train_val.prototxt").write_text(net)
    solver = (ROOT / "prototxt" / "digits_quick" / "solver.prototxt").read_text()
    for key, value in (("max_iter", 500), ("test_interval", 500), ("display", 100),
                       ("snapshot", 0)):
        solver = re.sub(rf"\n{key}: \d+", f"\n{key}: {value}", solver)
    assert "\nbase_lr: 0.01\n" in solver
    solver = solver.replace("\nbase_lr: 0.01\n", "\nbase_lr: 0.005\n")
    (folder / "solver.prototxt").write_text(solver)
    r = subprocess.run(cli("--solver", "solver.prototxt", "--no-progress", *extra_args), env=env(),
                       cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    out = r.stdout.decode()
    assert r.returncode == 0, out[-3000:]
    return float(re.findall(r"Final test accuracy \(net #0\): ([0-9.]+)", out)[-1])


@pytest.mark.slow
def test_four_workers_two_servers_converge_like_one_process_on_the_combined_batch(tmp_path):
    """The digits demo set, 500 iterations (about 22 epochs of the combined batch 64), with
    conv1's filler at std 0.01 instead of the file's 0.0001 and base_lr 0.005 instead of 0.01.

    Why not the file as it is: with it both runs sit on the loss-2.30 plateau for 100-250
    iterations and leave it through loss spikes (6.6 seen), so float32 rounding decides whether a
    run has left it by iteration 500: a change that only reordered conv1's sums (the same
    gradients to 1e-7) left the 4-worker run on the plateau (accuracy 0.09) where it had
    reached 0.95 before. With these two settings both runs leave it by iteration 150 along
    nearly the same losses (1.999 and 1.949 at 100; 0.95 and 0.95 at the end).

    Past the plateau the two runs are two equally good models whose float32 paths have parted:
    the machine decides which is ahead (0.9725 vs 0.9525 was seen). So they are compared as two
    draws on the 400 test images: at about 96% accuracy the difference of two such draws has a
    standard deviation of about 0.014, and 0.045 is three of them. A run that averaged its
    gradients wrongly, or diverged, lands far outside that; equality with one process is tested
    in float64 (test_equivalence.py and test_multi_host_form_with_explicit_ranks)."""
    from poseidon.engine.io.datasets import make_digits_lmdb
    make_digits_lmdb(str(tmp_path / "data" / "digits"))
    single = _digits_run(tmp_path, "single", 64, [])
    distributed = _digits_run(tmp_path, "dist", 16, ["--workers", 4, "--servers", 2])
    print(f"\ntest accuracy after 500 iterations: one process (batch 64) {single:.4f}, "
          f"4 workers x 16 + 2 servers {distributed:.4f}")
    assert single > 0.9 and distributed > 0.9
    assert abs(single - distributed) <= 0.045
