"""A small training job and its ranks, started on emulated hosts with the multi-host flags.

Each rank runs `poseidon train --solver S --workers P1 --servers P2 --coordinator tcp://HOST:PORT
--rank R --keys FILE` inside its host's namespace (rank r on host r, so the coordinator's HOST is
host 0's address), or mpirun starts them (`Job.mpirun`). The net is the FC net of tests/dist (three
InnerProducts on a small LMDB): with P1 = 2 workers of batch 8 BestScheme sends ip1 and ip2 by SFB
and ip3 by PS, and `--sync ps` sends all three through the servers.
"""
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy
from google.protobuf import text_format

from poseidon.engine.io import caffemodel

from ..dist.helpers import fc_net, solver_param

ROOT = Path(__file__).resolve().parents[2]
PORT = 5555
BATCH = 8                       # per worker
HEARTBEAT_TIMEOUT_S = 3.0       # --heartbeat-timeout where a test measures the stop after a fault
# ... and where none is meant to happen: long enough that a loaded machine's pauses (a few seconds
# on the shared 2-core machines) are not taken for a lost host
CALM_HEARTBEAT_TIMEOUT_S = 10.0
WAIT_S = 120.0                  # the longest a test waits for a job to end
_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def environment():
    """This environment for a rank: unbuffered output, the source tree importable, and no rank
    variables inherited from whatever started the tests."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    return env


def cli(*args):
    return [sys.executable, "-m", "poseidon.tools.cli", *map(str, args)]


def make_key_file(path):
    """`poseidon keys FILE`; returns the path."""
    subprocess.run(cli("keys", path), env=environment(), check=True, stdout=subprocess.DEVNULL,
                   timeout=60)
    return str(path)


def public_key(path):
    for line in Path(path).read_text().splitlines():
        if line.startswith("public"):
            return line.split("=", 1)[1].strip()
    raise ValueError(f"{path}: no public key")


class Job:
    """The job's files in `folder`: the solver (net inline), the key file, logs, snapshots."""

    def __init__(self, folder, data, workers=2, servers=2, iters=12, snapshot=0, dtype="float32",
                 flags=(), heartbeat_timeout=CALM_HEARTBEAT_TIMEOUT_S):
        self.folder = Path(folder)
        self.heartbeat_timeout = heartbeat_timeout
        self.folder.mkdir(parents=True, exist_ok=True)
        self.workers, self.servers, self.iters, self.dtype = workers, servers, iters, dtype
        self.flags = [str(f) for f in flags]
        self.snapshot_prefix = self.folder / "snap" / "run"
        param = solver_param(fc_net(data, BATCH), max_iter=iters)
        param.snapshot = snapshot
        param.snapshot_prefix = str(self.snapshot_prefix)
        self.solver = self.folder / "solver.prototxt"
        self.solver.write_text(text_format.MessageToString(param))
        self.keys = make_key_file(self.folder / "job.keys")
        (self.folder / "logs").mkdir(exist_ok=True)

    @property
    def size(self):
        return self.workers + self.servers

    def coordinator(self, network):
        return f"tcp://{network.hosts[0].address}:{PORT}"

    def args(self, network, extra=()):
        """The `poseidon train` arguments every rank of the job shares."""
        return ["train", "--solver", self.solver, "--workers", self.workers, "--servers",
                self.servers, "--coordinator", self.coordinator(network), "--keys", self.keys,
                "--dtype", self.dtype, "--heartbeat-timeout", self.heartbeat_timeout,
                "--timeout", 30, "--start-timeout", 60, "--no-progress", *self.flags, *extra]

    def log(self, rank, attempt=""):
        return self.folder / "logs" / f"rank-{rank}{attempt}.log"

    def start(self, network, extra=(), attempt=""):
        """Every rank on its own host (rank r on host r); {rank: Popen}."""
        return {r: network.spawn(network.hosts[r], cli(*self.args(network, extra), "--rank", r),
                                 self.log(r, attempt), env=environment(), cwd=self.folder)
                for r in range(self.size)}

    def mpirun(self, network, extra=()):
        """mpirun in host 0's namespace starts the ranks on hosts 0..size-1 (one per host,
        `--map-by node`), reaching the others through an rsh agent that enters their namespace;
        each rank reads its rank from OMPI_COMM_WORLD_RANK. Returns mpirun's Popen."""
        hostfile = self.folder / "hostfile"
        hostfile.write_text("".join(f"{h.name} slots=1\n" for h in network.hosts[:self.size]))
        agent = self.folder / "netns-rsh"
        agent.write_text('#!/bin/sh\n# mpirun\'s "remote shell": the host is a network namespace\n'
                         'host=$1; shift; exec ip netns exec "$host" sh -c "$*"\n')
        agent.chmod(agent.stat().st_mode | stat.S_IXUSR)
        argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", self.size,
                "--hostfile", hostfile, "--map-by", "node", "--mca", "plm_rsh_agent", agent,
                "--mca", "plm_rsh_no_tree_spawn", "1", "-x", "PYTHONPATH", "-x",
                "PYTHONUNBUFFERED", *cli(*self.args(network, extra))]
        return network.spawn(network.hosts[0], argv, self.log("mpirun"), env=environment(),
                             cwd=self.folder)

    def output(self, rank, attempt=""):
        path = self.log(rank, attempt)
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, procs, timeout=WAIT_S, attempt=""):
        """Wait (bounded) for every process; assert each ended with status 0."""
        deadline = time.monotonic() + timeout
        for rank, proc in procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} still running after {timeout:.0f} s:\n"
                                     f"{self.output(rank, attempt)[-3000:]}")
            assert proc.returncode == 0, (f"rank {rank} exited with {proc.returncode}:\n"
                                          f"{self.output(rank, attempt)[-3000:]}")

    def final_params(self):
        """The parameters in worker 0's last snapshot (float32 on disk, as Caffe's)."""
        path = Path(f"{self.snapshot_prefix}_iter_{self.iters}.caffemodel")
        assert path.exists(), f"no final snapshot {path}:\n{self.output(0)[-3000:]}"
        proto = caffemodel.read_net_proto(str(path))
        return [caffemodel.proto_to_array(b) for layer in proto.layer for b in layer.blobs]

    def stats(self, role, index):
        """The --stats records of one process (one per iteration)."""
        path = self.folder / f"stats.{role}-{index}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, timeout, what, procs=()):
    """Poll predicate (bounded); fail naming `what`, or a process of procs that ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        ended = [r for r, p in dict(procs).items() if p.poll() is not None]
        assert not ended, f"ranks {ended} ended while waiting for {what}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


def assert_bitwise_equal(got, want, label):
    assert len(got) == len(want), label
    for i, (a, b) in enumerate(zip(got, want)):
        assert numpy.array_equal(a, b), f"{label}: parameter {i} differs from the reference run"
