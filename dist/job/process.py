"""One role of a job in this process: `python -m poseidon.dist.job.process --job JSON --rank R`.

The launcher (dist/job/launch.py) starts one of these per rank; a multi-host job runs `run_main` in
each `poseidon train --coordinator ... --rank R` process; tests call `run_role` in threads.

Why the care about exits: a rank that fails tells the coordinator (which stops the job with a
message naming it), and a rank told to stop leaves within a bounded time even when its main thread
is busy (a watchdog), so no process is left waiting for a peer that is gone. A child of the local
launcher also dies with the launcher (Linux parent-death signal), so none is orphaned.
"""
import argparse
import json
import logging
import os
import signal
import sys
import threading
import traceback

from poseidon.engine.errors import PoseidonError

from . import faults
from ..errors import AbortError
from .options import DistOptions
from .session import Session
from ..worker.timeline import role_path
from ..transport import Msg

ABORT_GRACE_S = 15.0


def _build_solver(job, session):
    from poseidon.engine.solvers import get_solver
    solver = get_solver(job["solver"], progress=False, devices=job.get("devices"),
                        **session.solver_kwargs())
    if job.get("weights") and session.rank == 0:      # the others get worker 0's weights
        for path in str(job["weights"]).split(","):
            solver.net.copy_from(path)
    return solver


def run_role(job, rank, in_thread=False, on_session=None):
    """Run rank `rank` of the job to the end. Returns the DistributedSolver (workers) or None.

    job: {"solver": path or SolverParameter, "weights", "snapshot", "options": DistOptions dict,
    "verdict_file": where worker 0's coordinator writes the cause of an abort (local launcher)}.
    snapshot "auto": worker 0 resumes the newest complete snapshot, if any, and tells the others
    (which read no snapshot file themselves: a multi-host job's snapshots are on worker 0's disk)."""
    from ..worker.hooks import DistributedSolver
    options = job["options"]
    if not isinstance(options, DistOptions):
        options = DistOptions(**options)
    log = logging.getLogger("poseidon")
    session = Session(options, rank, log=log.info, verdict_file=job.get("verdict_file"))
    if on_session is not None:
        on_session(session)
    if not in_thread:
        session.transport.on_abort.append(_watchdog(session))
    try:
        if session.is_server:
            path = (role_path(options.stats, "server", session.roles.index(rank))
                    if options.stats else None)
            session.serve(stats_path=path)
            session.close()
            return None
        solver = _build_solver(job, session)
        snapshot = job.get("snapshot")
        if snapshot == "auto" and rank == 0:
            snapshot = _newest_snapshot(solver.param.snapshot_prefix, session.roles.workers, log)
        ds = DistributedSolver(solver, session)
        if snapshot is None and job.get("snapshot") == "auto":
            for r in session.roles.worker_ranks()[1:]:       # they wait for a cursor: none
                session.transport.send(r, Msg.CURSOR, obj={"fresh": True, "iter": 0})
        ds.solve(resume_file=snapshot)
        return ds
    except AbortError:
        session.abort_close()
        raise
    except BaseException as e:
        reason = str(e) if isinstance(e, PoseidonError) else f"{type(e).__name__}: {e}"
        session.fail(reason)
        session.abort_close()
        raise


def _newest_snapshot(prefix, workers, log):
    from .resume import newest_complete
    state = newest_complete(prefix, workers, say=log.warning)
    log.info(f"--resume auto: resuming from {state}" if state else
             f"--resume auto: no complete snapshot under {prefix}_iter_*: starting from the "
             f"beginning")
    return state


def _signal_requests(job):
    """SIGINT / SIGHUP with Caffe's effects, SIGUSR1 (snapshot) and SIGUSR2 (stop) from the local
    launcher: the request goes to the coordinator, which has every worker act at one iteration.
    A second stop request stops this process at once."""
    effects = {signal.SIGUSR1: "snapshot", signal.SIGUSR2: "stop",
               signal.SIGINT: job.get("sigint_effect", "stop"),
               signal.SIGHUP: job.get("sighup_effect", "snapshot")}
    asked = set()

    def install(session):
        def handler(signum, frame):
            action = effects[signum]
            if action == "stop" and "stop" in asked:
                raise KeyboardInterrupt
            asked.add(action)
            sys.stderr.write(f"{session.name}: {signal.Signals(signum).name}: the job will "
                             f"{action} after the current iteration\n")
            if session.coordinator is not None:
                session.coordinator.request(action)
            else:                          # not in the handler: it may interrupt a send
                threading.Thread(target=session.client.request_action, args=(action,),
                                 daemon=True).start()

        for sig, action in effects.items():
            signal.signal(sig, signal.SIG_IGN if action == "none" else handler)
    return install


def _exit(status):
    """os._exit, after removing this process's Unix-socket folders (os._exit runs no atexit)."""
    from ..transport.onehost.localipc import remove_all
    remove_all()
    os._exit(status)


def _watchdog(session):
    """After an abort, leave even if the main thread is stuck in a long computation."""
    def arm(error):
        def fire():
            sys.stderr.write(f"{session.name}: still running {ABORT_GRACE_S:g} s after the job "
                             f"was stopped ({error}); exiting\n")
            sys.stderr.flush()
            _exit(1)
        timer = threading.Timer(ABORT_GRACE_S, fire)
        timer.daemon = True
        timer.start()
    return arm


def _die_with_parent(parent_pid):
    """Linux: SIGTERM this process when the launcher dies (no orphans even after its SIGKILL)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)                 # PR_SET_PDEATHSIG
    except Exception:
        pass
    if parent_pid and os.getppid() != parent_pid:     # the launcher died before prctl
        _exit(1)


def _on_sigterm(name, abort_file):
    def handler(signum, frame):
        reason = None
        if abort_file and os.path.exists(abort_file):
            try:
                with open(abort_file, "r", encoding="utf-8") as f:
                    reason = f.read().strip()
            except OSError:
                pass
        sys.stdout.flush()
        sys.stderr.write(f"{name}: stopping: {reason or 'stopped by signal ' + signal.Signals(signum).name}\n")
        sys.stderr.flush()
        _exit(128 + signum)
    return handler


def run_main(job, rank, parent_pid=None, abort_file=None, keys=None, verdict_file=None):
    """A role as a whole process: logging, GPU choice, signals, exit status. Returns the status.

    keys: the job's JobKeys when the launcher handed them over (else options name a file).
    verdict_file: where the coordinator (worker 0) writes why it stopped the job, for the local
    launcher."""
    from poseidon.engine import backend
    from poseidon.engine.solvers import final_accuracy_lines, log_to_stderr
    from poseidon.engine.replicas import plan_devices
    from .roles import Roles
    if keys is not None:
        job = dict(job, options=dict(job["options"], keys=keys))
    if verdict_file:
        job = dict(job, verdict_file=verdict_file)
    options = DistOptions(**job["options"])
    roles = Roles(options.workers, options.servers)
    name = roles.name(rank) if 0 <= rank < roles.size else f"rank {rank}"
    if parent_pid:
        _die_with_parent(parent_pid)
    signal.signal(signal.SIGTERM, _on_sigterm(name, abort_file))
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # a request before the session exists: dropped
        signal.signal(sig, signal.SIG_IGN)
    log_to_stderr()
    if roles.is_worker(rank) and rank != 0:
        logging.getLogger("poseidon").setLevel(logging.WARNING)   # worker 0 speaks for the job
    try:
        if roles.is_worker(rank) and job.get("gpu") is not None:
            # Caffe's meaning: every worker (node) runs one replica on each GPU of the list
            devices = plan_devices(job["gpu"], options.devices_per_node)
            backend.set_mode_from_flag(devices[0])
            job = dict(job, devices=devices)
        faults.arm(roles.role(rank), roles.index(rank))
        ds = run_role(job, rank, on_session=_signal_requests(job))
        if ds is not None and rank == 0:
            for line in final_accuracy_lines(ds.solver):
                print(line, flush=True)
    except AbortError as e:
        sys.stderr.write(f"{name}: stopping: {e}\n")
        return 1
    except PoseidonError as e:
        sys.stderr.write(f"{name}: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(f"{name}: interrupted\n")
        return 130
    except Exception:
        sys.stderr.write(f"{name}: failed:\n{traceback.format_exc()}")
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m poseidon.dist.job.process", description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True, help="the job as JSON (written by the launcher)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--parent-pid", type=int)
    ap.add_argument("--abort-file")
    ap.add_argument("--verdict-file", help="where the coordinator writes why it stopped the job")
    ap.add_argument("--keys-on-stdin", action="store_true",
                    help="read the job's key file text from standard input")
    args = ap.parse_args(argv)
    job = json.loads(args.job)
    keys = None
    if args.keys_on_stdin:
        from .security import parse_keys
        keys = parse_keys(sys.stdin.read(), "the launcher's keys")
    status = run_main(job, args.rank, args.parent_pid, args.abort_file, keys, args.verdict_file)
    sys.stdout.flush()
    sys.stderr.flush()
    _exit(status)        # do not wait on daemon threads (prefetch, zmq) that may linger


if __name__ == "__main__":
    main()
