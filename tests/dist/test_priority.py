"""--comm-priority idle (dist/priority.py): which threads are lowered to SCHED_IDLE, and that a
real 1-worker + 1-server job runs with its sync path lowered and its compute threads not.

Run: python -m pytest tests/dist/test_priority.py -q
"""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from poseidon.dist import priority
from poseidon.dist.errors import DistError
from poseidon.dist.options import DistOptions

ROOT = Path(__file__).resolve().parents[2]

needs_linux = pytest.mark.skipif(not priority.supported(),
                                 reason="SCHED_IDLE and /proc/self/task are Linux-only")


def test_the_option_is_checked():
    with pytest.raises(DistError, match="--comm-priority takes normal or idle, got 'low'"):
        DistOptions(comm_priority="low")
    assert DistOptions().comm_priority == "normal"


@needs_linux
def test_idle_threads_lowers_all_but_the_kept_ones():
    ready, stop = threading.Event(), threading.Event()
    names = ("poseidon_7", "recv-3")
    threads = [threading.Thread(target=lambda: (ready.set(), stop.wait()), name=n, daemon=True)
               for n in names]
    for t in threads:
        t.start()
    try:
        keep = priority.compute_threads()
        by_name = {t.name: t.native_id for t in threads}
        assert threading.main_thread().native_id in keep and by_name["poseidon_7"] in keep
        assert by_name["recv-3"] not in keep
        # lower only the test's own thread here: the rest of this process keeps its policy
        everyone_else = {int(tid) for tid in os.listdir("/proc/self/task")} - {by_name["recv-3"]}
        assert priority.idle_threads(keep=everyone_else) == 1
        assert os.sched_getscheduler(by_name["recv-3"]) == os.SCHED_IDLE
        assert os.sched_getscheduler(by_name["poseidon_7"]) == os.SCHED_OTHER
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
    finally:
        stop.set()


JOB = r"""
import json, os, subprocess, sys, tempfile, pathlib, threading, logging
from poseidon import dist
from poseidon.dist.transport import free_port
from poseidon.engine.solvers import get_solver
from poseidon.engine.solvers import log_to_stderr
from poseidon.tools.bench import nets
log_to_stderr(logging.WARNING)
sp = nets.write_solver_files(nets.cifar10_quick(4), pathlib.Path(tempfile.mkdtemp()), 10 ** 6)
# each layer alone: the last sync runs on the main thread, the others on the pool's threads
options = dict(workers=1, servers=1, coordinator=f"tcp://127.0.0.1:{free_port()}", sync="ps",
               comm_priority="idle", bucket_bytes=0)
server = subprocess.Popen([sys.executable, "-c", "import json, sys; from poseidon import dist; "
                           "dist.init(**json.loads(sys.argv[1]))", json.dumps(dict(options, rank=1))])
session = dist.init(rank=0, **options)
solver = dist.DistributedSolver(get_solver(str(sp), **session.solver_kwargs()))
solver.step(3)
def policies(pid, names=None):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            name = (names or {}).get(int(tid)) or f.read().strip()
        out.setdefault(name, set()).add(os.sched_getscheduler(int(tid)))
    return {k: sorted(v) for k, v in out.items()}
names = {t.native_id: t.name for t in threading.enumerate()}
print(json.dumps({"worker": policies(os.getpid(), names), "server": policies(server.pid),
                  "iter": solver.iter}))
solver.finish()
server.wait(60)
"""


@needs_linux
def test_a_job_lowers_its_sync_path_and_keeps_its_compute(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               POSEIDON_THREADS="2")
    r = subprocess.run([sys.executable, "-c", JOB], cwd=tmp_path, env=env, timeout=300,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    idle, other = os.SCHED_IDLE, os.SCHED_OTHER
    worker, server = seen["worker"], seen["server"]
    assert seen["iter"] == 3
    assert worker["MainThread"] == [other]
    assert all(v == [other] for k, v in worker.items() if k.startswith("poseidon"))
    assert {"recv-0", "ZMQbg/IO/0"} <= set(worker) and any(k.startswith("sync") for k in worker)
    for name, kinds in worker.items():    # the sync path, also the threads made on first use
        if name != "MainThread" and not name.startswith(priority.COMPUTE_PREFIXES):
            assert kinds == [idle], (name, worker)
    assert all(v == [idle] for v in server.values()), server   # a server does no training
