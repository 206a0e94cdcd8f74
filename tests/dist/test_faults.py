"""Fault injection: SIGKILL of each role at named points of a run, and `--resume auto`.

Each chain below is one `poseidon train --workers 2 --servers 1 --resume auto` whose processes
SIGKILL themselves at a list of failpoints (dist/job/faults.py, each firing once); the launcher stops
everyone and restarts the job from the newest complete snapshot after each kill. For every kill
the test checks: every process of that attempt stopped (no hang) and none is left (pids and
process groups), every snapshot manifest verifies and no file under a final name is half-written,
and in the end the final .caffemodel is BITWISE equal to an uninterrupted run's (CPU, float32,
same seed). A table of kill point -> stop time, restarts, equal is printed.

Run: python -m pytest tests/dist/test_faults.py -q -s
"""
import glob
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy
import pytest

from poseidon.dist.transport import free_port
from poseidon.engine.io import caffemodel, manifest

from .helpers import conv_net, make_lmdb
from .test_processes import alive, cli, env, write_solver

ITERS = 12          # snapshots every 2 iterations, a test phase every 4
CHAINS = {          # kill points in the order they are reached across restarts
    "worker 0 (coordinator)": ["worker:0:register", "worker:0:init:0", "worker:0:forward:3",
                               "worker:0:test:4", "worker:0:snapshot-files:6",
                               "worker:0:barrier:9", "worker:0:snapshot-done:10"],
    "worker 1": ["worker:1:register", "worker:1:backward:2", "worker:1:init:2",
                 "worker:1:snapshot:4", "worker:1:barrier:7", "worker:1:test:8",
                 "worker:1:forward:11"],
    "server 0": ["server:0:register", "server:0:init:0", "server:0:push:1", "server:0:get",
                 "server:0:push:5", "server:0:push:10"],
}


@pytest.fixture(scope="module")
def net_text(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faultdb")
    train = make_lmdb(folder / "train", n=64)
    test = make_lmdb(folder / "test", n=32, seed=1)
    return conv_net(train, 4, test_source=test, test_batch=4)


def job_folder(root, net_text):
    return write_solver(root, net_text, ITERS, snapshot=2, extra="test_interval: 4\ntest_iter: 2\n")


def train(solver, cwd, *extra, failpoints=None, once=None, timeout=120):
    e = env()
    if failpoints:
        e["POSEIDON_FAILPOINT"] = ",".join(failpoints)
    if once:
        e["POSEIDON_FAILPOINT_ONCE"] = str(once)
    args = ["--solver", solver, "--workers", 2, "--servers", 1, "--no-progress",
            "--timeout", 20, *extra]       # the launcher sees a death at once: no heartbeat needed
    r = subprocess.run(cli(*args), env=e, cwd=cwd, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=timeout)
    return r.returncode, r.stdout.decode()


def final_blobs(snap_folder):
    proto = caffemodel.read_net_proto(str(Path(snap_folder) / f"run_iter_{ITERS}.caffemodel"))
    return [caffemodel.proto_to_array(b) for lp in proto.layer for b in lp.blobs]


@pytest.fixture(scope="module")
def reference(net_text, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    code, out = train(job_folder(root / "job", net_text), root)
    assert code == 0, out[-3000:]
    return final_blobs(root / "job" / "snap")


def attempts(out):
    """The launcher's lines and every process's stop or error line, over all attempts: why each
    attempt ended, when a chain ends other than planned."""
    keep = [line for line in out.splitlines() if line.startswith("poseidon:")
            or re.search(r"\] (failpoint |\S+ \d+: (stopping|error))", line)]
    return "\n".join(keep) + "\n----- the last lines:\n"


def launched_pids(out):
    return [int(p) for line in re.findall(r"^poseidon: worker 0 pid .*$", out, re.M)
            for p in re.findall(r"pid (\d+)", line)]


def group_exists(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def check_snapshots(folder):
    """Every manifest verifies; every file under a final name reads whole. Returns (complete
    snapshots, final-named files without a manifest, leftover temporary files)."""
    manifests = glob.glob(str(Path(folder) / "run_iter_*.manifest.json"))
    listed = set()
    for m in manifests:
        manifest.verify_manifest(m)
        with open(m, encoding="utf-8") as f:
            listed |= {os.path.join(folder, e["file"]) for e in json.load(f)["files"]}
    for path in glob.glob(str(Path(folder) / "run_iter_*")):
        if path.endswith(".caffemodel"):
            caffemodel.read_net_proto(path)
        elif path.endswith(".solverstate"):
            caffemodel.read_solverstate(path)
        elif path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                json.load(f)
    unlisted = [p for p in glob.glob(str(Path(folder) / "run_iter_*"))
                if p not in listed and not p.endswith(".manifest.json")]
    temporary = glob.glob(str(Path(folder) / ".*.tmp"))
    return len(manifests), unlisted, temporary


@pytest.mark.slow
@pytest.mark.parametrize("victim", list(CHAINS))
def test_kill_chain_resumes_bitwise(victim, net_text, reference, tmp_path):
    points = CHAINS[victim]
    once = tmp_path / "fired"
    once.mkdir()
    solver = job_folder(tmp_path / "job", net_text)
    t0 = time.monotonic()
    code, out = train(solver, tmp_path, "--resume", "auto", "--max-restarts", len(points),
                      failpoints=points, once=once, timeout=240)
    wall = time.monotonic() - t0
    assert code == 0, attempts(out) + out[-3000:]
    assert "poseidon: all processes finished" in out
    assert "Traceback" not in out, out[-4000:]

    # every failpoint fired once, in order, and each kill was followed by one restart
    fired = re.findall(r"^\[(worker \d|server \d)\] failpoint (\S+)(?: at iteration (\d+))?: "
                       r"SIGKILL$", out, re.M)
    assert len(fired) == len(points), out[-4000:]
    for (who, name, it), spec in zip(fired, points):
        role, index, point = spec.split(":")[:3]
        assert (who, name) == (f"{role} {index}", point)
    stops = [float(s) for s in re.findall(r"every process stopped ([0-9.]+) s after", out)]
    restarts = re.findall(r"^poseidon: restart (\d+) of", out, re.M)
    assert len(stops) == len(points) and len(restarts) == len(points), out[-4000:]
    assert all(s < 15 for s in stops), stops              # no hang: SETTLE + GRACE bound everyone

    # no process left: every pid and process group of every attempt is gone
    pids = launched_pids(out)
    assert len(pids) == 3 * (len(points) + 1)
    assert not [p for p in pids if alive(p) or group_exists(p)]

    # no torn snapshot; a kill between a snapshot's files and its manifest was skipped on resume
    folder = tmp_path / "job" / "snap"
    complete, unlisted, temporary = check_snapshots(folder)
    assert complete >= ITERS // 2 and not temporary
    if "worker:0:snapshot-files:6" in points:
        assert "skipping the snapshot of iteration 6: it has no manifest" in out

    got = final_blobs(folder)
    equal = len(got) == len(reference) and all(
        g.dtype == w.dtype == numpy.float32 and numpy.array_equal(g, w)
        for g, w in zip(got, reference))
    starts = re.findall(r"^poseidon: (?:resuming from the newest complete snapshot \S+_iter_(\d+)"
                        r"|no complete snapshot)", out, re.M)
    assert len(starts) == len(points) + 1
    print(f"\n{victim}: {len(points)} kills, {len(restarts)} restarts, {complete} complete "
          f"snapshots, {len(unlisted)} final-named files outside a manifest, {wall:.1f} s; final "
          f"parameters bitwise equal to the uninterrupted run: {'yes' if equal else 'NO'}")
    print(f"  {'kill point':28s} {'all stopped after':>17s}  {'restarted from':>14s}")
    for spec, stop, start in zip(points, stops, starts[1:]):
        print(f"  {spec:28s} {stop:15.1f} s  {'iteration ' + start if start else 'the start':>14s}")
    assert equal, "the resumed run's final parameters differ from the uninterrupted run's"


@pytest.mark.slow
def test_max_restarts_then_fails_naming_the_cause_and_a_rerun_resumes(net_text, reference,
                                                                       tmp_path):
    """A failpoint that fires on every attempt: after --max-restarts 1 the launcher gives up
    naming the lost process; re-running the same command (no failpoint) with --resume auto
    resumes from the newest complete snapshot at start-up and finishes bitwise equal."""
    solver = job_folder(tmp_path / "job", net_text)
    code, out = train(solver, tmp_path, "--resume", "auto", "--max-restarts", 1,
                      failpoints=["worker:1:barrier:5"])
    assert code != 0
    m = re.search(r"^poseidon: the job failed after 1 restart\(s\) \(--max-restarts 1\): "
                  r"worker 1 \(pid \d+\) was killed by SIGKILL$", out, re.M)
    assert m, out[-3000:]
    assert not [p for p in launched_pids(out) if alive(p)]
    code, out = train(solver, tmp_path, "--resume", "auto")
    assert code == 0, out[-3000:]
    assert re.search(r"resuming from the newest complete snapshot \S+run_iter_4\.solverstate", out)
    got = final_blobs(tmp_path / "job" / "snap")
    assert all(numpy.array_equal(g, w) for g, w in zip(got, reference))


@pytest.mark.slow
def test_multi_host_job_killed_then_rerun_with_resume_auto(net_text, reference, tmp_path):
    """No launcher: worker 1 dies inside the BSP barrier of iteration 7; the others notice by
    heartbeat and stop; the scheduler re-runs the same commands, and worker 0 (rank 0, the one
    that reads the snapshot) resumes the newest complete one and hands the others their state."""
    solver = job_folder(tmp_path / "job", net_text)

    def start_all(failpoints=None):
        e = env()
        if failpoints:
            e["POSEIDON_FAILPOINT"] = failpoints
        address = f"tcp://127.0.0.1:{free_port()}"
        return [subprocess.Popen(cli("--solver", solver, "--workers", 2, "--servers", 1,
                                     "--coordinator", address, "--rank", r, "--resume", "auto",
                                     "--heartbeat-timeout", 3, "--timeout", 20, "--no-progress"),
                                 env=e, cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
                for r in range(3)]

    procs = start_all("worker:1:barrier:7")
    try:
        procs[1].wait(60)
        t0 = time.monotonic()                # worker 1 is dead: how long until the others stop
        while any(p.poll() is None for p in procs) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        stopped = time.monotonic() - t0
        outs = [p.communicate(timeout=30)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == -signal.SIGKILL
    assert "no complete snapshot" in outs[0] and "starting from the beginning" in outs[0]
    for r in (0, 2):
        assert procs[r].returncode != 0 and "worker 1" in outs[r], outs[r][-2000:]
    assert stopped < 25, f"the others took {stopped:.1f} s to stop"   # no hang: heartbeat 3 s
    procs = start_all()
    outs = [p.communicate(timeout=60)[0].decode() for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, outs[r][-3000:]
    assert re.search(r"--resume auto: resuming from \S+run_iter_6\.solverstate", outs[0])
    got = final_blobs(tmp_path / "job" / "snap")
    equal = all(numpy.array_equal(g, w) for g, w in zip(got, reference))
    print(f"\nmulti-host: worker 1 killed in the barrier of iteration 7, the others stopped "
          f"{stopped:.1f} s later; the re-run resumed from iteration 6; bitwise equal: "
          f"{'yes' if equal else 'NO'}")
    assert equal


def test_newest_complete_skips_torn_and_foreign_snapshots(tmp_path):
    """The newest snapshot whose manifest verifies and which has every worker's cursor file wins;
    newer ones without a manifest, with an altered file, or from another worker count are
    skipped, each with a line saying why."""
    from poseidon.dist.job.resume import newest_complete
    prefix = str(tmp_path / "run")

    def snapshot(it, workers=2):
        files = []
        for suffix in [".caffemodel", ".solverstate", ".cursors.json"] + [
                f".cursors.worker-{r}.json" for r in range(1, workers)]:
            path = f"{prefix}_iter_{it}{suffix}"
            Path(path).write_bytes(f"{it}{suffix}".encode())
            files.append(path)
        manifest.write_manifest(f"{prefix}_iter_{it}.manifest.json", files, {"iter": it})

    lines = []
    assert newest_complete(prefix, 2, say=lines.append) is None and lines == []
    snapshot(2)
    snapshot(4)
    snapshot(6)
    Path(f"{prefix}_iter_6.solverstate").write_bytes(b"cut")            # altered after the fact
    snapshot(8, workers=3)                                               # another worker count
    Path(f"{prefix}_iter_10.caffemodel").write_bytes(b"half")            # no manifest yet
    Path(f"{prefix}_iter_4x.caffemodel").write_bytes(b"not a snapshot of this prefix")
    assert newest_complete(prefix, 2, say=lines.append) == f"{prefix}_iter_4.solverstate"
    assert len(lines) == 3
    assert lines[0] == "skipping the snapshot of iteration 10: it has no manifest (a crash while " \
                       "it was being written)"
    assert lines[1].startswith("skipping the snapshot of iteration 8") and lines[1].endswith(
        "written by a run of 3 worker(s), this one has 2")
    assert "iteration 6" in lines[2] and "does not match its checksum" in lines[2]
    lines.clear()
    assert newest_complete(prefix, 3, say=lines.append) == f"{prefix}_iter_8.solverstate"
    assert newest_complete(prefix, None, say=lines.append) == f"{prefix}_iter_8.solverstate"
    assert newest_complete(prefix, 1, say=lines.append) is None       # every one has cursors


@pytest.mark.slow
def test_single_process_resume_auto(tmp_path):
    """`poseidon train --resume auto` on one process: the newest complete snapshot, a torn newer
    one skipped; with none, from the beginning."""
    data = make_lmdb(tmp_path / "db", n=32)
    from .helpers import fc_net
    solver = write_solver(tmp_path / "job", fc_net(data, 4), 4, snapshot=2)
    run = lambda: subprocess.run(cli("--solver", solver, "--resume", "auto", "--no-progress"),
                                 env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, timeout=60)
    r = run()
    out = r.stdout.decode()
    assert r.returncode == 0 and "no complete snapshot yet: starting from the beginning" in out
    snap = tmp_path / "job" / "snap"
    (snap / "run_iter_6.caffemodel").write_bytes(b"torn")
    text = Path(solver).read_text().replace("max_iter: 4", "max_iter: 8")
    Path(solver).write_text(text)
    r = run()
    out = r.stdout.decode()
    assert r.returncode == 0, out[-2000:]
    assert "skipping the snapshot of iteration 6: it has no manifest" in out
    assert re.search(r"resuming from \S+run_iter_4\.solverstate", out)
    manifest.verify_manifest(str(snap / "run_iter_8.manifest.json"))
