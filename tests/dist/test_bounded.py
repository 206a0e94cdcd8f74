"""Bounded waits and bounded state: what a stopped worker, a repeating member or a same-user
process can do to a job's processes, and what they must not.

- A KV server under --straggler-timeout with one worker SIGSTOPped (a real process job): it keeps
  answering the other workers (their iterations go on while the straggler is stopped), and after
  SIGCONT the job finishes. A server that waited for the stopped worker to take its last answer
  would stop its receive thread with it: no answers, no heartbeats.

Run: python -m pytest tests/dist/test_bounded.py -q -s
"""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .helpers import fc_net, make_lmdb
from .test_processes import alive, cli, env, write_solver
from .test_signals_dist import Output


def _lines(path):
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _wait_lines(path, n, limit):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if _lines(path) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} has {_lines(path)} lines after {limit} s, expected {n}")


def test_a_stopped_worker_does_not_stop_the_server(tmp_path):
    """Answers to the stopped worker queue up (its socket is not read): the server's next update of
    the same pair must not wait for them. Big enough answers (a 3072 x 48 layer) to fill a socket's
    buffer in one iteration."""
    data = make_lmdb(tmp_path / "train", n=32, shape=(3, 32, 32))
    path = write_solver(tmp_path / "job", fc_net(data, 4), 40)
    stats = tmp_path / "stats.jsonl"
    proc = subprocess.Popen(cli("--solver", path, "--workers", 3, "--servers", 1,
                                "--no-progress", "--straggler-timeout", 0.3, "--timeout", 20,
                                "--heartbeat-timeout", 30, "--stats", stats),
                            env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    out = Output(proc)
    pids = []
    try:
        pids = [int(p) for p in re.findall(r"pid (\d+)", out.wait_for(r"^poseidon: worker 0 pid"))]
        worker0, server = tmp_path / "stats.worker-0.jsonl", tmp_path / "stats.server-0.jsonl"
        _wait_lines(worker0, 3, 60)
        os.kill(pids[2], signal.SIGSTOP)
        try:
            time.sleep(0.5)                       # what was in flight settles
            before, served = _lines(worker0), _lines(server)
            time.sleep(3.0)
            during, served_during = _lines(worker0) - before, _lines(server) - served
        finally:
            os.kill(pids[2], signal.SIGCONT)
        assert during >= 3 and served_during >= 3, (
            f"while worker 2 was stopped worker 0 did {during} iterations and the server "
            f"answered {served_during}:\n" + "".join(out.lines[-30:]))
        proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    text = out.text()
    assert proc.returncode == 0, text[-3000:]
    assert "poseidon: all processes finished" in text
    print(f"\nworker 2 stopped for 3 s: worker 0 went on {during} iterations, the server "
          f"answered {served_during}; after SIGCONT the job finished")
