"""Caffe's --sigint_effect / --sighup_effect on a real `poseidon train` process."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

NET = """
name: "sig"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        transform_param { scale: 0.00390625 } data_param { source: "%s" batch_size: 16 backend: LMDB } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


class Training:
    """A `poseidon train` process whose output (stdout and stderr) a thread collects by line, so
    that a test can wait for a line instead of sleeping."""

    def __init__(self, proc):
        self.proc = proc
        self.lines = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern, after=0, timeout=60):
        """The index of the first line from `after` on that matches `pattern`; fails with the
        output so far when the process ends or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for i in range(after, len(self.lines)):
                    if re.search(pattern, self.lines[i]):
                        return i
                after = max(after, len(self.lines))
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    pytest.fail(f"no line matching {pattern!r} within {timeout} s (exit "
                                f"{self.proc.poll()}):\n{''.join(self.lines[-40:])}")
                self._changed.wait(min(left, 0.5))

    def output(self, timeout=60):
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout)
        return "".join(self.lines)


# the loop's display line: training runs, and the signal handlers are in place (train.py installs
# them before solve() starts)
ITERATION = r"Iteration \d+ \(.*\), loss = "


def _start(tmp_path, extra=()):
    from poseidon.engine.io.datasets import make_digits_lmdb
    if not (tmp_path / "d" / "train").exists():
        make_digits_lmdb(str(tmp_path / "d"))
    (tmp_path / "net.prototxt").write_text(NET % (tmp_path / "d" / "train"))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 1000000\n'
        f'display: 100\nsnapshot_prefix: "{tmp_path / "snap"}"\nrandom_seed: 1\n')
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "poseidon.tools.cli", "train", "--solver",
                             str(tmp_path / "solver.prototxt"), "--no-progress", *extra],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    training = Training(proc)
    training.wait_for(ITERATION)
    return training


def _snapshots(tmp_path):
    return sorted(p.name for p in tmp_path.glob("snap_iter_*.manifest.json"))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="needs POSIX signals")
def test_sighup_snapshots_and_sigint_stops_with_a_final_snapshot(tmp_path):
    training = _start(tmp_path)
    proc = training.proc
    try:
        proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 30
        while not _snapshots(tmp_path) and time.time() < deadline:
            time.sleep(0.2)
        assert _snapshots(tmp_path), "SIGHUP should have written a snapshot"
        assert proc.poll() is None, "SIGHUP's default effect must not stop training"
        proc.send_signal(signal.SIGINT)
        output = training.output()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "Optimization stopped early." in output
    assert len(_snapshots(tmp_path)) == 2
    assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="needs POSIX signals")
def test_sigint_effect_none_ignores_ctrl_c(tmp_path):
    training = _start(tmp_path, ["--sigint_effect", "none"])
    proc = training.proc
    try:
        proc.send_signal(signal.SIGINT)
        sent = len(training.lines)
        # two more display lines: the second was certainly written after the signal arrived
        training.wait_for(ITERATION, after=training.wait_for(ITERATION, after=sent) + 1)
        assert proc.poll() is None
    finally:
        proc.kill()
        training.output()
