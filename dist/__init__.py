"""Poseidon's distributed training for the engine: WFBP, hybrid PS/SFB, KV store, coordinator.

    from poseidon import dist
    from poseidon.engine.solvers import get_solver
    session = dist.init()                     # rank, coordinator, P1/P2 (a server rank serves here)
    solver = dist.DistributedSolver(get_solver("solver.prototxt", **session.solver_kwargs()))
    solver.solve()

The command line does the same: `poseidon train --solver S --workers 4 --servers 2`. A scheme of
your own is a class registered with `@dist.register_scheme` (dist/schemes/base.py says what it
provides); BestScheme then compares it with the others. See docs/distributed.md for the design and
the module docstrings for the reasons.
"""
from .errors import AbortError, DeadlineError, DistError  # noqa: F401
from .job.options import DistOptions, add_dist_options  # noqa: F401
from .schemes import Scheme, register_scheme  # noqa: F401
from .job.session import Session, current, init  # noqa: F401
from .worker.hooks import DistributedSolver, WorkerHooks  # noqa: F401
