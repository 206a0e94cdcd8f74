"""Caffe's --sigint_effect / --sighup_effect on a real `poseidon train` process."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NET = """
name: "sig"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        transform_param { scale: 0.00390625 } data_param { source: "%s" batch_size: 16 backend: LMDB } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _start(tmp_path, extra=()):
    from poseidon.engine.io.datasets import make_digits_lmdb
    if not (tmp_path / "d" / "train").exists():
        make_digits_lmdb(str(tmp_path / "d"))
    (tmp_path / "net.prototxt").write_text(NET % (tmp_path / "d" / "train"))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 1000000\n'
        f'display: 0\nsnapshot_prefix: "{tmp_path / "snap"}"\nrandom_seed: 1\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "poseidon.tools.cli", "train", "--solver",
                             str(tmp_path / "solver.prototxt"), "--no-progress", *extra],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    time.sleep(4)
    return proc


def _snapshots(tmp_path):
    return sorted(p.name for p in tmp_path.glob("snap_iter_*.manifest.json"))


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="needs POSIX signals")
def test_sighup_snapshots_and_sigint_stops_with_a_final_snapshot(tmp_path):
    proc = _start(tmp_path)
    try:
        proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 30
        while not _snapshots(tmp_path) and time.time() < deadline:
            time.sleep(0.2)
        assert _snapshots(tmp_path), "SIGHUP should have written a snapshot"
        assert proc.poll() is None, "SIGHUP's default effect must not stop training"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "Optimization stopped early." in output
    assert len(_snapshots(tmp_path)) == 2
    assert "Traceback" not in output


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="needs POSIX signals")
def test_sigint_effect_none_ignores_ctrl_c(tmp_path):
    proc = _start(tmp_path, ["--sigint_effect", "none"])
    try:
        proc.send_signal(signal.SIGINT)
        time.sleep(2)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.communicate()
