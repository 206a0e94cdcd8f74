"""Jobs started exactly as users start them (`poseidon train` processes), on Caffe's own
cifar10_quick layers over the digits LMDB, and what their snapshots hold: the weights, and the
digest of every worker's replica (each worker's cursor file carries it).

The convolution route is pinned (POSEIDON_CONV=im2col) for every process, the reference's too:
routes are chosen per input shape, so a worker on batch K and one process on batch P·K may take
different ones, and at a ReLU whose input is exactly zero (the digits' black background) the
routes' last-bit differences decide whether a gradient passes.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy

from poseidon.dist.worker.snapshots import params_digest
from poseidon.engine.io import caffemodel
from poseidon.engine.io.datasets import compute_mean, make_digits_lmdb
from poseidon.engine.proto import caffe_pb2

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT = 180


def env():
    """This environment for a test's child processes: the checkout first on the path, output
    unbuffered, no rank variables of an mpirun around the test."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in e.get("PYTHONPATH", "")
                                                     .split(os.pathsep) if p])
    e["PYTHONUNBUFFERED"] = "1"
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        e.pop(name, None)
    return e


def job_env():
    """The test processes' environment, with the convolution route pinned."""
    return dict(env(), POSEIDON_CONV="im2col")


class DigitsData:
    """The digits set as LMDBs and its mean image, made once per test module."""

    def __init__(self, folder):
        folder = Path(folder)
        paths = make_digits_lmdb(str(folder / "digits"))
        self.train, self.test = paths["train"], paths["test"]
        self.mean = str(folder / "mean.binaryproto")
        caffemodel.write_binaryproto(compute_mean(self.train), self.mean)


def cifar10_quick(models, data, batch):
    """Caffe's cifar10_quick_train_test.prototxt, unchanged but for its data paths and the
    training batch."""
    text = (Path(models) / "cifar10" / "cifar10_quick_train_test.prototxt").read_text()
    text = (text.replace("examples/cifar10/mean.binaryproto", data.mean)
            .replace("examples/cifar10/cifar10_train_lmdb", data.train)
            .replace("examples/cifar10/cifar10_test_lmdb", data.test))
    assert text.count("batch_size: 100") == 2
    return text.replace("batch_size: 100", f"batch_size: {batch}", 1)


def write_solver(folder, net_text, iterations, extra=""):
    """A solver in the spirit of Caffe's cifar10_quick_solver (momentum 0.9, weight decay
    0.004), a fixed seed, no testing, one snapshot at the end."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "net.prototxt").write_text(net_text)
    (folder / "solver.prototxt").write_text(f"""
net: "{folder / 'net.prototxt'}"
test_iter: 1
test_interval: 1000000
test_initialization: false
base_lr: 0.01
momentum: 0.9
weight_decay: 0.004
lr_policy: "fixed"
display: 10
max_iter: {iterations}
snapshot: {iterations}
snapshot_prefix: "{folder / 'snap'}"
random_seed: 7
{extra}
""")
    return str(folder / "solver.prototxt")


def train(solver, *flags, cwd=None):
    """`poseidon train --solver S --dtype float64 FLAGS`; the finished process (check=False)."""
    cmd = [sys.executable, "-m", "poseidon.tools.cli", "train", "--solver", solver,
           "--dtype", "float64", "--no-progress", *map(str, flags)]
    return subprocess.run(cmd, cwd=cwd or Path(solver).parent, env=job_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=JOB_TIMEOUT, stdin=subprocess.DEVNULL)


def snapshot_of(solver, iterations):
    return Path(solver).parent / f"snap_iter_{iterations}.caffemodel"


def weights(path):
    """{(layer, blob index): array} of a .caffemodel."""
    net = caffe_pb2.NetParameter()
    net.ParseFromString(Path(path).read_bytes())
    return {(layer.name, i): caffemodel.proto_to_array(b)
            for layer in net.layer for i, b in enumerate(layer.blobs)}


def worst_relative(got, want):
    """The largest max|got - want| / max|want| over the blobs, and the blob it is at."""
    assert got.keys() == want.keys(), f"blobs differ: {sorted(got)} vs {sorted(want)}"
    worst, where = 0.0, None
    for key, w in want.items():
        err = float(numpy.abs(got[key] - w).max() / max(float(numpy.abs(w).max()), 1e-300))
        if err > worst or where is None:
            worst, where = err, key
    return worst, where


def replica_digests(solver, iterations, workers):
    """{worker rank: params digest} of the workers other than 0, from their cursor files."""
    base = Path(solver).parent / f"snap_iter_{iterations}"
    out = {}
    for r in range(1, workers):
        state = json.loads(Path(f"{base}.cursors.worker-{r}.json").read_text())
        out[r] = state["params_sha256"]
    return out


def digest_of_snapshot(path):
    """The digest of the parameters a .caffemodel holds, as the workers compute theirs."""
    return params_digest(weights(path).values())
