"""P workers of batch K train as one process of batch P·K: `poseidon train` processes on Caffe's
cifar10_quick (float64, the default piece and slice sizes; its layers' float counts are not all
multiples of 3 or 4), weights compared from the snapshots, every worker's replica compared by
digest, and one job run twice for bitwise-identical snapshots.

The whole matrix (--sync ps, sfb, allreduce, hybrid, ps+sfb × P1 2..4 × P2 1..2 × overlap on/off
× --ipc auto/off: 120 jobs) runs under CI=true or POSEIDON_JOB_MATRIX=all; otherwise a covering
part of it runs, in which every value of every factor appears.

Run: python -m pytest tests/dist/test_train_equivalence.py -q
"""
import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import IN_CI, require_caffe_models

from .jobs import (DigitsData, cifar10_quick, digest_of_snapshot, replica_digests, snapshot_of,
                   train, weights, worst_relative, write_solver)

BATCH = 8            # per worker
ITERATIONS = 6       # the momentum history and the ring's buffers in use from the second on
JOBS_AT_ONCE = 2
TOLERANCE = 1e-6     # relative, per blob, against one process on the combined batch

SYNCS = ("ps", "sfb", "allreduce", "hybrid", "ps+sfb")
WORKERS = (2, 3, 4)
SERVERS = (1, 2)
OVERLAP = ("overlap", "no-overlap")
IPC = ("auto", "off")

FULL = IN_CI or os.environ.get("POSEIDON_JOB_MATRIX", "").strip().lower() == "all"

# The part run by default: every sync, worker count, server count, overlap and ipc value at least
# once, the default hybrid at 3 and 4 workers (where it picks the ring), the ring on both paths.
COVERING = [("allreduce", 3, 1, "overlap", "auto"), ("hybrid", 4, 2, "overlap", "auto"),
            ("ps", 2, 2, "no-overlap", "off"), ("sfb", 4, 1, "no-overlap", "auto"),
            ("ps+sfb", 3, 2, "overlap", "off"), ("allreduce", 4, 1, "no-overlap", "off"),
            ("hybrid", 3, 1, "no-overlap", "off")]

CELLS = list(itertools.product(SYNCS, WORKERS, SERVERS, OVERLAP, IPC)) if FULL else COVERING


def cell_id(cell):
    sync, p1, p2, overlap, ipc = cell
    return f"{sync}-w{p1}-s{p2}-{overlap}-ipc_{ipc}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    models = require_caffe_models()
    folder = tmp_path_factory.mktemp("equivalence")
    return models, DigitsData(folder), folder


def flags_of(cell):
    sync, workers, servers, overlap, ipc = cell
    flags = ["--workers", workers, "--servers", servers, "--sync", sync, "--ipc", ipc]
    return flags + (["--no-overlap"] if overlap == "no-overlap" else [])


@pytest.fixture(scope="module")
def jobs(setup):
    """Every job of this module run once, JOBS_AT_ONCE at a time (a job's processes leave a core
    idle while they start, register and stop), before any cell is checked: {name: (solver,
    finished process)}, the one-process references under ("one", P1)."""
    models, data, folder = setup
    todo = {("one", p1): (cifar10_quick(models, data, p1 * BATCH), [])
            for p1 in sorted({cell[1] for cell in CELLS})}
    todo.update({cell_id(cell): (cifar10_quick(models, data, BATCH), flags_of(cell))
                 for cell in CELLS})
    for name in ("twice-a", "twice-b"):
        todo[name] = (cifar10_quick(models, data, BATCH), ["--workers", 4, "--servers", 2])

    def run(name):
        net, flags = todo[name]
        label = name if isinstance(name, str) else f"one-{name[1]}"
        solver = write_solver(folder / label, net, ITERATIONS)
        return solver, train(solver, *flags)
    with ThreadPoolExecutor(JOBS_AT_ONCE) as pool:
        return dict(zip(todo, pool.map(run, todo)))


def finished(jobs, name):
    """The job's solver path, after checking it ended well and named no replica that drifted."""
    solver, done = jobs[name]
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}"
    drifted = [line for line in done.stdout.splitlines() if "differ from worker 0's" in line]
    assert not drifted, f"{name}: {drifted[0]}"
    return solver


def check_replicas(solver, workers):
    """Every worker's parameters at the snapshot are worker 0's, bit for bit."""
    want = digest_of_snapshot(snapshot_of(solver, ITERATIONS))
    got = replica_digests(solver, ITERATIONS, workers)
    assert set(got) == set(range(1, workers))
    wrong = {r: d for r, d in got.items() if d != want}
    assert not wrong, f"replicas of workers {sorted(wrong)} differ from worker 0's snapshot"


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_workers_train_as_one_process_on_the_combined_batch(jobs, cell):
    workers = cell[1]
    solver = finished(jobs, cell_id(cell))
    want = weights(snapshot_of(finished(jobs, ("one", workers)), ITERATIONS))
    err, where = worst_relative(weights(snapshot_of(solver, ITERATIONS)), want)
    assert err <= TOLERANCE, (f"{cell_id(cell)}: blob {where} differs from one process on batch "
                              f"{workers * BATCH} by {err:.3g} (relative)")
    check_replicas(solver, workers)


@pytest.mark.slow
def test_the_same_job_twice_gives_bitwise_identical_snapshots(jobs):
    """The default hybrid at 4 workers and 2 servers (the ring for most layers) run twice."""
    first, second = finished(jobs, "twice-a"), finished(jobs, "twice-b")
    a = snapshot_of(first, ITERATIONS).read_bytes()
    b = snapshot_of(second, ITERATIONS).read_bytes()
    assert a == b, "two runs of one job wrote different caffemodels"
    check_replicas(first, 4)
