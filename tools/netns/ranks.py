"""One `poseidon train` job on emulated hosts: rank r in host r's namespace, started with the
documented multi-host flags.

Each rank runs `poseidon train --solver S --workers P1 --servers P2 --coordinator tcp://HOST:PORT
--rank R --keys FILE` inside its host's namespace, so the coordinator's HOST is host 0's address
and every pair of ranks talks across the bridge, as ranks on separate machines do. The key file
comes from `poseidon keys`. Why not the local launcher: it starts every process on its own host,
which is what the emulated hosts are there to avoid.

Used by the emulated-host tests (tests/hosts/jobs.py builds its job on HostJob) and by
`poseidon bench`'s part g (tools/bench/hosts_part.py).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PORT = 5555
KEYS_TIMEOUT_S = 60.0           # `poseidon keys` in a child
_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def environment(paths=(), threads=None):
    """This process's environment for a rank: unbuffered output, `paths` first on PYTHONPATH, no
    rank variables inherited from whatever started us (a rank would read its rank from them), and
    with `threads` BLAS's and the engine's own threads held to that count."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    if paths:
        env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [
            p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if threads:
        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "POSEIDON_THREADS"):
            env[name] = str(threads)
    return env


def cli(*args):
    """argv of `poseidon ARGS` in this interpreter (a plain `-m`: mpirun passes argv through a
    shell, where a multi-line `-c` bootstrap would not survive)."""
    return [sys.executable, "-m", "poseidon.tools.cli", *map(str, args)]


def make_key_file(path, env=None):
    """`poseidon keys FILE`; returns the path."""
    subprocess.run(cli("keys", path), env=env or environment(), check=True,
                   stdout=subprocess.DEVNULL, timeout=KEYS_TIMEOUT_S)
    return str(path)


def role_of(rank, workers):
    """('worker', i) or ('server', j) of a rank: workers first, as the launcher numbers them."""
    return ("worker", rank) if rank < workers else ("server", rank - workers)


class HostJob:
    """A job's ranks and files in `folder`: the key file, one log per rank, the --stats files.

    `flags` are the `poseidon train` flags every rank shares beyond the multi-host ones; the
    ranks run in `folder`, so relative paths among them (--stats) land there. `keys`: a key
    file to use (jobs run one after another may share one); by default a new one in `folder`."""

    def __init__(self, folder, solver, workers, servers, flags=(), paths=(), threads=None,
                 keys=None, colocate=False):
        self.folder = Path(folder)
        self.colocate = colocate
        self.folder.mkdir(parents=True, exist_ok=True)
        self.solver = solver
        self.workers, self.servers = workers, servers
        self.flags = [str(f) for f in flags]
        self.env = environment(paths, threads)
        self.keys = str(keys) if keys else make_key_file(self.folder / "job.keys", self.env)
        (self.folder / "logs").mkdir(exist_ok=True)

    @property
    def size(self):
        return self.workers + self.servers

    @property
    def hosts(self):
        """Hosts the job needs: one a rank, or with `colocate` one a worker, server j sharing
        worker j's host (every node both a worker and a server, as the paper's cost model has
        it)."""
        return max(self.workers, self.servers) if self.colocate else self.size

    def host_of(self, rank):
        if not self.colocate:
            return rank
        role, index = role_of(rank, self.workers)
        return index

    def coordinator(self, network):
        return f"tcp://{network.hosts[0].address}:{PORT}"

    def args(self, network, extra=()):
        """The `poseidon train` arguments every rank of the job shares (extra last: it may
        repeat a flag to override it)."""
        return ["train", "--solver", self.solver, "--workers", self.workers, "--servers",
                self.servers, "--coordinator", self.coordinator(network), "--keys", self.keys,
                "--no-progress", *self.flags, *extra]

    def log(self, rank, attempt=""):
        return self.folder / "logs" / f"rank-{rank}{attempt}.log"

    def start(self, network, extra=(), attempt=""):
        """Every rank on its host (host_of: rank r on host r unless colocated); {rank: Popen}."""
        return {r: network.spawn(network.hosts[self.host_of(r)], cli(*self.args(network, extra), "--rank", r),
                                 self.log(r, attempt), env=self.env, cwd=self.folder)
                for r in range(self.size)}

    def output(self, rank, attempt=""):
        path = self.log(rank, attempt)
        return path.read_text(errors="replace") if path.exists() else ""

    def finish(self, procs, timeout, attempt=""):
        """Wait (bounded) for every process: None when each ended with status 0, else what went
        wrong with the first that did not, and the tail of its log. A rank still running is
        left to the network's close()."""
        deadline = time.monotonic() + timeout
        for rank, proc in procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return (f"rank {rank} still running after {timeout:.0f} s:\n"
                        f"{self.output(rank, attempt)[-3000:]}")
            if proc.returncode != 0:
                return (f"rank {rank} exited with {proc.returncode}:\n"
                        f"{self.output(rank, attempt)[-3000:]}")
        return None

    def stats_path(self, role, index):
        return self.folder / f"stats.{role}-{index}.jsonl"

    def stats(self, role, index):
        """The --stats records of one process (one per iteration; [] before its first)."""
        path = self.stats_path(role, index)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def counted(self, rank, way):
        """What the job's --stats say rank sent ('sent') or received ('recv'): payload +
        message headers of every sync, summed over its iterations."""
        return sum(rec[f"{way}_payload"] + rec[f"{way}_header"]
                   for rec in self.stats(*role_of(rank, self.workers)))
