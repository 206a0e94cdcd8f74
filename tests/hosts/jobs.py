"""The tests' small training job on emulated hosts, and mpirun across the namespaces.

The ranks start as poseidon.tools.netns.ranks.HostJob starts them: `poseidon train --solver S
--workers P1 --servers P2 --coordinator tcp://HOST:PORT --rank R --keys FILE` inside host r's
namespace; or mpirun starts them (`Job.mpirun`). The net is the FC net of tests/dist (three
InnerProducts on a small LMDB): with P1 = 2 workers of batch 8 BestScheme sends ip1 and ip2 by SFB
and ip3 by PS, and `--sync ps` sends all three through the servers.
"""
import stat
import time
from pathlib import Path

import numpy
from google.protobuf import text_format

from poseidon.engine.io import caffemodel
from poseidon.tools.netns import ranks
from poseidon.tools.netns.ranks import cli  # noqa: F401  (the tests start other commands too)

from ..dist.helpers import fc_net, solver_param

ROOT = Path(__file__).resolve().parents[2]
BATCH = 8                       # per worker
HEARTBEAT_TIMEOUT_S = 3.0       # --heartbeat-timeout where a test measures the stop after a fault
# ... and where none is meant to happen: long enough that a loaded machine's pauses (a few seconds
# on the shared 2-core machines) are not taken for a lost host
CALM_HEARTBEAT_TIMEOUT_S = 10.0
WAIT_S = 120.0                  # the longest a test waits for a job to end


def environment():
    """A rank's environment (ranks.environment) with the source tree importable: the intruder
    runs as `python -m tests.hosts.intruder`."""
    return ranks.environment([ROOT])


def public_key(path):
    for line in Path(path).read_text().splitlines():
        if line.startswith("public"):
            return line.split("=", 1)[1].strip()
    raise ValueError(f"{path}: no public key")


class Job(ranks.HostJob):
    """The job's files in `folder`: the solver (net inline), the key file, logs, snapshots."""

    def __init__(self, folder, data, workers=2, servers=2, iters=12, snapshot=0, dtype="float32",
                 flags=(), heartbeat_timeout=CALM_HEARTBEAT_TIMEOUT_S):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.heartbeat_timeout = heartbeat_timeout
        self.iters, self.dtype = iters, dtype
        self.snapshot_prefix = folder / "snap" / "run"
        param = solver_param(fc_net(data, BATCH), max_iter=iters)
        param.snapshot = snapshot
        param.snapshot_prefix = str(self.snapshot_prefix)
        solver = folder / "solver.prototxt"
        solver.write_text(text_format.MessageToString(param))
        super().__init__(folder, solver, workers, servers, paths=[ROOT], flags=[
            "--dtype", dtype, "--heartbeat-timeout", heartbeat_timeout, "--timeout", 30,
            "--start-timeout", 60, *flags])

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
        return network.spawn(network.hosts[0], argv, self.log("mpirun"), env=self.env,
                             cwd=self.folder)

    def wait(self, procs, timeout=WAIT_S, attempt=""):
        """Wait (bounded) for every process; assert each ended with status 0."""
        failure = self.finish(procs, timeout, attempt)
        assert failure is None, failure

    def final_params(self):
        """The parameters in worker 0's last snapshot (float32 on disk, as Caffe's)."""
        path = Path(f"{self.snapshot_prefix}_iter_{self.iters}.caffemodel")
        assert path.exists(), f"no final snapshot {path}:\n{self.output(0)[-3000:]}"
        proto = caffemodel.read_net_proto(str(path))
        return [caffemodel.proto_to_array(b) for layer in proto.layer for b in layer.blobs]


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
