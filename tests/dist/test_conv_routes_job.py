"""Convolution routes measured where they run, in a job and across a resume: with POSEIDON_CONV=auto
worker 0 alone times the routes and every replica runs its choice; a snapshot records the routes, so
a resume computes with the ones the run had even where a new timing would choose others."""
import json
import threading

import numpy
import pytest

from poseidon.engine.layers.conv import measure, routes
from poseidon.engine.solvers import get_solver

from .helpers import (assert_params_close, conv_net, make_lmdb, params_of, run_processes,
                      run_threads, solver_param)

pytestmark = pytest.mark.measures_conv_routes


class PerThread(dict):
    """A process's route decisions kept apart per thread, as if each role were its own process."""

    def get(self, key, default=None):
        return super().get((threading.current_thread().name, key), default)

    def __setitem__(self, key, value):
        super().__setitem__((threading.current_thread().name, key), value)


@pytest.fixture
def timing(monkeypatch, tmp_path):
    """Measuring on, every shape timed anew (no cache read), each thread deciding for itself; the
    timing faked so that each thread would choose differently: worker 0's thread (and the main
    one) finds 'fourier' fastest, every other 'im2col'. Yields {thread name: shapes it timed}."""
    monkeypatch.delenv("POSEIDON_CONV", raising=False)
    monkeypatch.setenv("POSEIDON_CONV_MEASURE", "1")
    monkeypatch.setenv("POSEIDON_CONV_REFRESH", "1")
    monkeypatch.setenv("POSEIDON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(routes, "_DECIDED", PerThread())
    timed = {}

    def fake(shape, make_core, candidates, xp):
        me = threading.current_thread().name
        timed[me] = timed.get(me, 0) + 1
        best = "fourier" if me in ("role-0", "MainThread") else "im2col"
        return {r: (0.5 if r == best else 1.0) for r in candidates}

    monkeypatch.setattr(measure, "time_routes", fake)
    routes.forget_decisions()
    yield timed
    routes.forget_decisions()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


@pytest.mark.slow
def test_worker_0_measures_and_every_replica_runs_its_routes(timing, data):
    solvers = run_threads(solver_param(conv_net(data, 2), max_iter=3), 2, 1)
    chosen = [s.net.conv_routes() for s in solvers]
    assert chosen[0] == chosen[1]
    assert "fourier" in chosen[0].values()                 # worker 0's timing decided
    assert timing.get("role-0") and not timing.get("role-1")
    assert_params_close(params_of(solvers[1]), params_of(solvers[0]), rtol=0)


@pytest.mark.slow
def test_processes_run_the_routes_worker_0_measured(data, tmp_path):
    """As `poseidon train` processes, with the routes really timed (POSEIDON_CONV=auto, a fresh
    cache): each worker's cursor file names worker 0's routes, and every replica is bitwise
    worker 0's. (Which route each process would time fastest cannot be forced across processes,
    so this checks the handing over, not a disagreement it settles.)"""
    env = {"POSEIDON_CONV": "auto", "POSEIDON_CONV_MEASURE": "1", "POSEIDON_CONV_REFRESH": "1",
           "POSEIDON_CACHE_DIR": str(tmp_path / "cache")}
    run_processes(solver_param(conv_net(data, 2), max_iter=3), 2, 1, tmp_path, env=env)
    folder = tmp_path / "process-job"
    routes = [json.loads((folder / name).read_text())["conv_routes"]
              for name in ("snap_iter_3.cursors.json", "snap_iter_3.cursors.worker-1.json")]
    assert routes[0] and routes[0] == routes[1]


def test_a_resume_takes_the_snapshot_routes(timing, data, tmp_path):
    param = solver_param(conv_net(data, 2), max_iter=4)
    param.snapshot_prefix = str(tmp_path / "run")
    first = get_solver(param, dtype=numpy.float64)
    first.step(2)
    saved = first.net.conv_routes()
    state = first.snapshot()
    first.step(2)
    assert "fourier" in saved.values()
    routes.forget_decisions()
    timing.clear()

    def other_machine(shape, make_core, candidates, xp):        # would pick im2col everywhere
        timing["again"] = timing.get("again", 0) + 1
        return {r: (0.5 if r == "im2col" else 1.0) for r in candidates}

    measure.time_routes = other_machine                           # restored by the fixture
    again = get_solver(param, dtype=numpy.float64)
    again.restore(state)
    assert again.net.conv_routes() == saved
    again.step(2)
    assert not timing.get("again")
    for a, b in zip(params_of(again), params_of(first)):
        assert numpy.array_equal(a, b)                            # bitwise the uninterrupted run
