"""Caffe's --sigint_effect / --sighup_effect in distributed runs, and the stall inspector.

A signal to the launcher (or to any rank of a multi-host job) becomes a request to the
coordinator, which tells every worker with the next iteration's loss, so all of them snapshot or
stop at the SAME iteration. The stall inspector: a process stopped with SIGSTOP is named by the
others' periodic `waiting N s for ... from <role and rank>` lines, and the job goes on after
SIGCONT.

Run: python -m pytest tests/dist/test_signals_dist.py -q -s
"""
import glob
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy
import pytest

from poseidon.dist.transport import free_port
from poseidon.engine.io import caffemodel, manifest

from .helpers import conv_net, make_lmdb
from .test_processes import alive, cli, env, write_solver


@pytest.fixture(scope="module")
def solver(tmp_path_factory):
    folder = tmp_path_factory.mktemp("signals")
    data = make_lmdb(folder / "train", n=64)
    return folder, write_solver(folder / "job", conv_net(data, 4), 1_000_000)


class Output:
    """The lines a process prints, read on a thread, with a wait for a pattern."""

    def __init__(self, proc):
        self.lines = []
        self.proc = proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for raw in iter(self.proc.stdout.readline, b""):
            self.lines.append(raw.decode("utf-8", "replace"))

    def wait_for(self, pattern, limit=40, since=0):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for line in self.lines[since:]:
                if re.search(pattern, line):
                    return line
            if self.proc.poll() is not None and not self._thread.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(self.lines[-40:]))

    def text(self):
        self._thread.join(10)
        return "".join(self.lines)


def snapshots(folder, cursor_of=1):
    """{iteration: (solver state's iteration, worker `cursor_of`'s cursor iteration)} of the
    complete snapshots, every one verified (every worker's cursor must agree with the state);
    cursor_of=None: a one-worker job's, whose cursors are the engine's own file."""
    found = {}
    for m in glob.glob(str(Path(folder) / "run_iter_*.manifest.json")):
        manifest.verify_manifest(m)
        it = int(re.search(r"_iter_(\d+)\.", m).group(1))
        state = caffemodel.read_solverstate(m.replace(".manifest.json", ".solverstate"))
        name = ".cursors.json" if cursor_of is None else f".cursors.worker-{cursor_of}.json"
        with open(m.replace(".manifest.json", name), encoding="utf-8") as f:
            cursor = json.load(f)["iter"]
        found[it] = (state.iter, cursor)
    return found


def hup_then_int(path, cwd, workers):
    """A local job of `workers` workers and one server: SIGHUP to the launcher once it trains,
    then SIGINT once it has snapshotted. Returns (its output, its exit status, the pids of its
    processes), the snapshot folder emptied first (the module's jobs share it)."""
    for old in glob.glob(str(Path(path).parent / "snap" / "run_*")):
        os.remove(old)
    proc = subprocess.Popen(cli("--solver", path, "--workers", workers, "--servers", 1,
                                "--no-progress"),
                            env=env(), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = Output(proc)
    try:
        pids = [int(p) for p in re.findall(r"pid (\d+)", out.wait_for(r"^poseidon: worker 0 pid"))]
        out.wait_for(r"book sent")
        time.sleep(1.0)
        proc.send_signal(signal.SIGHUP)
        out.wait_for(r"Distributed snapshot at iteration \d+")
        time.sleep(0.5)
        assert proc.poll() is None, "SIGHUP's default effect (snapshot) must not stop the job"
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out.text(), proc.returncode, pids


@pytest.mark.slow
def test_sighup_snapshots_and_sigint_stops_every_worker_at_one_iteration(solver, tmp_path):
    folder, path = solver
    text, status, pids = hup_then_int(path, tmp_path, workers=2)
    assert status == 0, text[-3000:]
    assert "poseidon: SIGHUP: the job will snapshot after the current iteration" in text
    assert "poseidon: SIGINT: the job will stop after the current iteration" in text
    assert "Optimization stopped early." in text and "poseidon: all processes finished" in text
    found = snapshots(Path(path).parent / "snap")
    assert len(found) == 2, found              # the SIGHUP snapshot and the one taken on stop
    for it, (state_iter, worker1_iter) in found.items():
        assert state_iter == worker1_iter == it   # every worker's state from the same iteration
    assert not any(alive(p) for p in pids)
    print(f"\nSIGHUP -> snapshot, SIGINT -> stop: snapshots at iterations {sorted(found)}, "
          f"every worker's cursor at the same iteration")


@pytest.mark.slow
def test_a_one_worker_job_takes_signals_without_the_loss_round_trip(solver, tmp_path):
    """With one worker the loss is not reduced through the coordinator (its mean is the worker's
    own); a request is read from the coordinator, which shares worker 0's process, at the next
    iteration: SIGHUP still snapshots and SIGINT still stops, each after one iteration."""
    folder, path = solver
    text, status, pids = hup_then_int(path, tmp_path, workers=1)
    assert status == 0, text[-3000:]
    assert "Optimization stopped early." in text and "poseidon: all processes finished" in text
    found = snapshots(Path(path).parent / "snap", cursor_of=None)
    assert len(found) == 2, found              # the SIGHUP snapshot and the one taken on stop
    assert all(a == b == it for it, (a, b) in found.items()), found
    assert not any(alive(p) for p in pids)


@pytest.mark.slow
def test_signals_to_any_rank_of_a_multi_host_job(solver, tmp_path):
    """SIGHUP to worker 1 snapshots the whole job; SIGINT to the server stops it (rank 0 hears of
    both through the coordinator)."""
    folder, path = solver
    job = Path(tmp_path) / "job"
    path = write_solver(job, Path(path).parent.joinpath("net.prototxt").read_text(), 1_000_000)
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(cli("--solver", path, "--workers", 2, "--servers", 1, "--no-progress",
                                  "--coordinator", address, "--rank", r),
                              env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(3)]
    outs = [Output(p) for p in procs]
    try:
        outs[0].wait_for(r"book sent")
        time.sleep(1.0)
        procs[1].send_signal(signal.SIGHUP)
        outs[0].wait_for(r"Distributed snapshot at iteration \d+")
        procs[2].send_signal(signal.SIGINT)
        for p in procs:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [o.text() for o in outs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, texts[r][-3000:]
    assert "worker 1: SIGHUP: the job will snapshot" in texts[1]
    assert "server 0 (rank 2): SIGINT: the job will stop" in texts[2]
    assert "Optimization stopped early." in texts[0]
    found = snapshots(job / "snap")
    assert len(found) == 2 and all(a == b == it for it, (a, b) in found.items()), found


@pytest.mark.slow
def test_stall_inspector_names_the_stopped_process(solver, tmp_path):
    """SIGSTOP worker 1, then server 0: worker 0 logs, every --stall-warning seconds, what it
    waits for and from whom; after SIGCONT the job goes on."""
    folder, path = solver
    job = Path(tmp_path) / "job"
    path = write_solver(job, Path(path).parent.joinpath("net.prototxt").read_text(), 1_000_000)
    proc = subprocess.Popen(cli("--solver", path, "--workers", 2, "--servers", 1, "--no-progress",
                                "--stall-warning", 1, "--heartbeat-timeout", 20),
                            env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    out = Output(proc)
    try:
        pids = [int(p) for p in re.findall(r"pid (\d+)", out.wait_for(r"^poseidon: worker 0 pid"))]
        out.wait_for(r"book sent")
        time.sleep(1.0)
        for victim, name in ((pids[1], r"worker 1"), (pids[2], r"server 0 \(rank 2\)")):
            since = len(out.lines)
            os.kill(victim, signal.SIGSTOP)
            try:     # whoever waits on it directly names it (a peer, the server, the coordinator)
                line = out.wait_for(rf"waiting [2-9] s for (.* from )?{name}", limit=20, since=since)
            finally:
                os.kill(victim, signal.SIGCONT)
            print("\n" + line.rstrip())
            time.sleep(1.5)        # the woken process's own overdue waits report themselves
        time.sleep(1.0)
        assert proc.poll() is None, "the job must go on after SIGCONT"
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.text()
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"worker [01]: iteration \d+: waiting \d+ s for the new values of KV pair \d+ "
                     r"(\(\+\d+ more in its message\) )?\(layer '[\w+]+', iteration \d+\) "
                     r"from server 0 \(rank 2\)", text), text[-3000:]


def test_coordinator_stall_lines_name_the_ranks_a_collective_waits_for():
    """The coordinator's side, on its real socket with messages as the workers send them: a
    barrier two of four workers reached, and an allreduce, are reported once per interval."""
    from poseidon.dist.coord.coordinator import Coordinator, _key
    from poseidon.dist.job.roles import Roles
    from poseidon.dist.transport import Message, Msg
    lines = []
    coordinator = Coordinator(Roles(4, 1), "127.0.0.1", free_port(), stall_warning=10,
                              warn=lines.append)
    try:
        for sender in (0, 2):
            coordinator._on_barrier(Message(Msg.BARRIER, sender, 5, _key("test-5"), 0, [],
                                            {"group": "workers", "name": "test-5"}, 0, 0))
        coordinator._on_allreduce(Message(Msg.ALLREDUCE, 3, 12, _key("loss"), 0,
                                          [numpy.zeros(1)], {"name": "loss"}, 0, 0))
        start = time.monotonic()
        coordinator._inspect_stalls(start + 5)            # not yet an interval
        assert lines == []
        coordinator._inspect_stalls(start + 10.4)
        coordinator._inspect_stalls(start + 12)           # at most one line per interval
        assert sorted(lines) == [
            "the coordinator: allreduce 'loss' (call 12): waiting 10 s for worker 0, worker 1, "
            "worker 2",
            "the coordinator: barrier 'test-5' (call 5): waiting 10 s for worker 1, worker 3"]
        coordinator._on_barrier(Message(Msg.BARRIER, 1, 5, _key("test-5"), 0, [],
                                        {"group": "workers", "name": "test-5"}, 0, 0))
        coordinator._inspect_stalls(start + 21)
        assert "the coordinator: barrier 'test-5' (call 5): waiting 21 s for worker 3" in lines
    finally:
        coordinator.transport.close(0)
