"""Whom a failed job blames: the process at the root of the failure, not the first to exit.

A worker that is alive but silent (SIGSTOP) makes the others stop one after another; the
launcher's last line must still name the silent worker, and a worker stopped before it registered
must be named within the heartbeat timeout (the local launcher sees that its child is stopped),
not after --start-timeout, by the first error line of the job. Around them: the launcher's choice
of cause from its children's states and the coordinator's verdict file, the coordinator's verdict
and its registration lines, and a registering rank that hears the coordinator's reason first.

Run: python -m pytest tests/dist/test_blame.py -q -s
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from poseidon.dist.job import faults
from poseidon.dist.coord.coordinator import Coordinator
from poseidon.dist.errors import AbortError
from poseidon.dist.job.launch import LocalJob, process_state
from poseidon.dist.job.options import DistOptions
from poseidon.dist.job.roles import Roles
from poseidon.dist.transport import free_port

from .helpers import conv_net, make_lmdb
from .test_coordinator import register_all_but, start_job
from .test_processes import alive, cli, env, write_solver
from .test_signals_dist import Output

HEARTBEAT = 3          # --heartbeat-timeout of the jobs below
ERROR_LINE = re.compile(r"stopping|error|failed|missing|lost contact|is worker 0 running|"
                        r"waiting \d+ s")


@pytest.fixture(scope="module")
def solver(tmp_path_factory):
    folder = tmp_path_factory.mktemp("blame")
    data = make_lmdb(folder / "train", n=64)
    return write_solver(folder / "job", conv_net(data, 4), 1_000_000)


def launch(solver, cwd, *extra, environ=None):
    proc = subprocess.Popen(cli("--solver", solver, "--workers", 2, "--servers", 1,
                                "--no-progress", "--heartbeat-timeout", HEARTBEAT,
                                "--timeout", 5, *extra),
                            env=environ or env(), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    return proc, Output(proc)


def wait_end(proc, out, limit):
    """The launcher's exit within `limit` s, else an assertion naming the last lines."""
    try:
        proc.wait(limit)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job still ran {limit} s after the worker was stopped:\n"
                             + "".join(out.lines[-30:])) from None


def clean_up(proc, pids):
    """Nothing left behind: the stopped child woken and killed with the others."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for pid in pids:
        if alive(pid):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def last_line(text):
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_a_worker_stopped_mid_run_is_named_by_the_last_line(solver, tmp_path):
    """SIGSTOP worker 1 of a training job (measured cost model): the job stops within a few
    heartbeat timeouts and the launcher's last line names worker 1, not whoever exited first."""
    proc, out = launch(solver, tmp_path, "--cost-model", "measured")
    pids = []
    try:
        pids = [int(p) for p in re.findall(r"pid (\d+)", out.wait_for(r"^poseidon: worker 0 pid"))]
        out.wait_for(r"book sent")
        time.sleep(1.5)                                    # a few iterations
        assert proc.poll() is None, "".join(out.lines[-30:])
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        wait_end(proc, out, 8 * HEARTBEAT)
        elapsed = time.monotonic() - t0
    finally:
        clean_up(proc, pids)
    text = out.text()
    last = last_line(text)
    print(f"\nstopped {elapsed:.1f} s after the SIGSTOP; last line: {last}")
    assert proc.returncode != 0
    assert last.startswith(f"poseidon: the job failed: worker 1 (pid {pids[1]})"), text[-3000:]
    assert "stopped" in last, last
    assert elapsed < 4 * HEARTBEAT, text[-3000:]
    assert not any(alive(pid) for pid in pids), "a process was left behind"


@pytest.mark.slow
def test_a_worker_stopped_before_registering_is_named_within_the_heartbeat_timeout(solver,
                                                                                  tmp_path):
    """Worker 1 stops itself (a failpoint with SIGSTOP) before it registers: the coordinator
    cannot know it exists, but the launcher sees its child stopped; the job ends within a few
    heartbeat timeouts (not the 60 s --start-timeout), its first error line names worker 1, and
    so does its last."""
    environ = dict(env(), POSEIDON_FAILPOINT="worker:1:register",
                   POSEIDON_FAILPOINT_SIGNAL="SIGSTOP")
    proc, out = launch(solver, tmp_path, "--start-timeout", 60, environ=environ)
    pids = []
    try:
        pids = [int(p) for p in re.findall(r"pid (\d+)", out.wait_for(r"^poseidon: worker 0 pid"))]
        out.wait_for(r"\[worker 1\] failpoint register: SIGSTOP")
        t0 = time.monotonic()
        wait_end(proc, out, 8 * HEARTBEAT)
        elapsed = time.monotonic() - t0
    finally:
        clean_up(proc, pids)
    text = out.text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "failpoint register" in line)
    errors = [line for line in lines[start + 1:] if ERROR_LINE.search(line)]
    last = last_line(text)
    print(f"\nstopped {elapsed:.1f} s after worker 1 stopped; first error line: "
          f"{errors[0] if errors else None}\nlast line: {last}")
    assert proc.returncode != 0
    assert elapsed < 4 * HEARTBEAT, text[-3000:]
    assert errors and f"worker 1 (pid {pids[1]})" in errors[0], text[-3000:]
    assert last.startswith(f"poseidon: the job failed: worker 1 (pid {pids[1]}) is stopped"), \
        text[-3000:]
    assert not any(alive(pid) for pid in pids), "a process was left behind"


# ----- the launcher's choice of cause -----------------------------------------------------------
def _child(code):
    """A child that exits with `code`, or (None) one that sleeps until killed."""
    body = f"import sys; sys.exit({code})" if code is not None else "import time; time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", body], start_new_session=True)


@pytest.fixture
def local_job():
    job = LocalJob({"solver": None}, DistOptions(workers=2, servers=1, heartbeat_timeout=3))
    yield job
    for p in job.children.values():
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait(10)
    for path in (job.verdict_file, job.abort_file):
        if os.path.exists(path):
            os.remove(path)
    os.rmdir(job._tmp)


def _wait_state(pid, states, limit=10):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process_state(pid) in states:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} is in state {process_state(pid)}, not one of {states}")


@pytest.mark.slow
def test_the_cause_is_the_stopped_child_then_the_coordinators_verdict_then_the_lowest_error(
        local_job):
    job = local_job
    job.children = {0: _child(1), 1: _child(None), 2: _child(1)}   # worker 0 and server 0 exit
    for rank in (0, 2):
        job.children[rank].wait(30)
    pid1 = job.children[1].pid
    assert job._cause() == f"worker 0 (pid {job.children[0].pid}) exited with status 1"
    lost = ("the coordinator: lost contact with worker 1: nothing heard from it for 3 s (it has "
            "probably died; see its output)")
    with open(job.verdict_file, "w", encoding="utf-8") as f:
        json.dump({"reason": lost, "ranks": [1]}, f)
    assert job._cause() == f"worker 1 (pid {pid1}), still running: {lost}"
    os.kill(pid1, signal.SIGSTOP)
    _wait_state(pid1, {"T"})
    cause = job._cause()
    assert cause.startswith(f"worker 1 (pid {pid1}) is stopped (SIGSTOP"), cause
    assert "process state T" in cause and "coordinator" not in cause, cause
    os.kill(pid1, signal.SIGCONT)
    _wait_state(pid1, {"R", "S"})
    with open(job.verdict_file, "w", encoding="utf-8") as f:        # ranks that disagree
        json.dump({"reason": "worker 0 and worker 1 do not train the same network", "ranks": []},
                  f)
    assert job._cause() == "worker 0 and worker 1 do not train the same network"
    job.children[1].kill()                                       # a signal death comes first
    job.children[1].wait(10)
    assert job._cause() == f"worker 1 (pid {pid1}) was killed by SIGKILL"


@pytest.mark.slow
def test_the_launcher_stops_a_job_whose_child_stays_stopped(local_job):
    """The monitor itself: a child stopped for --heartbeat-timeout (3 s here) is lost; the
    others are told why, woken and stopped, and the reason names the stopped child."""
    job = local_job
    job.children = {r: _child(None) for r in range(3)}
    pid2 = job.children[2].pid
    os.kill(pid2, signal.SIGSTOP)
    t0 = time.monotonic()
    status, reason = job._monitor()
    elapsed = time.monotonic() - t0
    assert status == 1 and reason.startswith(f"server 0 (rank 2) (pid {pid2}) is stopped"), reason
    assert 2.5 < elapsed < 3 + 6, elapsed
    assert all(p.poll() is not None for p in job.children.values())
    with open(job.abort_file, encoding="utf-8") as f:
        assert f.read() == reason


# ----- the coordinator's verdict and registration ------------------------------------------------
def test_the_coordinator_names_the_ranks_that_did_not_register(tmp_path):
    """While it waits, one line per --stall-warning naming who has not registered; at the start
    timeout, the verdict (reason and ranks) in the file the local launcher reads."""
    lines = []
    verdict = tmp_path / "verdict"
    coordinator = Coordinator(Roles(2, 1), "127.0.0.1", free_port(), start_timeout=1.5,
                              stall_warning=0.5, warn=lines.append, verdict_file=str(verdict))
    try:
        coordinator.start()
        assert coordinator.join(10)
    finally:
        coordinator.transport.close(0)
    got = json.loads(verdict.read_text())
    assert got["ranks"] == [0, 1, 2]
    assert "missing: worker 0, worker 1, server 0 (rank 2)" in got["reason"], got
    assert lines and re.match(r"the coordinator: waiting \d+ s for worker 0, worker 1, server 0 "
                              r"\(rank 2\) to register \(0 of 3 have", lines[0]), lines
    assert not list(tmp_path.glob("*.tmp"))


def test_a_registered_rank_stops_with_the_coordinators_reason_not_its_own_wait():
    """Both wait --start-timeout: the coordinator for every rank, a rank for the book. The rank
    waits a little longer, so it stops with the coordinator's reason naming the missing rank
    rather than asking whether worker 0 runs."""
    roles, coord, clients = start_job(2, 1, start_timeout=1.0)
    errors = {}
    try:
        errors = register_all_but(roles, clients, absent=1)
    finally:
        coord.join(5)
        for c in clients:
            c.transport.close(0)
    for rank in (0, 2):
        assert isinstance(errors[rank], AbortError), errors
        assert "missing: worker 1" in str(errors[rank]), errors
    assert coord.blamed == [1]


def test_failpoint_signal():
    assert faults.parse_signal(None) == signal.SIGKILL
    assert faults.parse_signal("SIGSTOP") == faults.parse_signal("stop") == signal.SIGSTOP
    assert faults.parse_signal(str(int(signal.SIGSTOP))) == signal.SIGSTOP
    with pytest.raises(ValueError, match="POSEIDON_FAILPOINT_SIGNAL"):
        faults.parse_signal("SIGNOPE")
