"""`--comm-priority idle`: the sync path yields the cores to training (Linux SCHED_IDLE).

Why: when the processes of a job share their cores with training (one machine, CPU training),
every wake-up of a ZeroMQ I/O thread, a receive or sync thread or a KV server preempts a compute
thread in the middle of its cache-sized blocks, which then finds its block evicted and does the
same work in more CPU time (docs/performance.md, "The distributed path on one host"). Threads at
SCHED_IDLE run only on cores that nothing else wants: in the gaps of the step and at the barrier,
where the worker waits anyway.

What is lowered: in a worker, every thread but the main thread, the engine's compute pool
("poseidon...") and the data layers' prefetch threads ("prefetch-..."): ZeroMQ's own threads,
the receive, sync and coordinator threads and pyzmq's; in a KV server, the whole process.

Not the default: on several hosts, WFBP overlaps the network transfer of a layer with the
backward of the layers below, and a send that waits for an idle core loses that. Linux only
(elsewhere the option is refused).
"""
import os
import threading

from .errors import DistError

CHOICES = ("normal", "idle")

# Python threads of a worker that do the training's own work and keep their priority.
COMPUTE_PREFIXES = ("poseidon", "prefetch-")


def check(choice):
    if choice not in CHOICES:
        raise DistError(f"--comm-priority takes {' or '.join(CHOICES)}, got '{choice}'")
    if choice == "idle" and not supported():
        raise DistError("--comm-priority idle needs Linux (SCHED_IDLE and /proc/self/task) "
                        "and a process allowed to lower its threads' priority; leave it at "
                        "normal here")


_SUPPORTED = None


def supported():
    """Linux with SCHED_IDLE, /proc/self/task, and a thread allowed to lower itself (a strict
    seccomp profile may refuse it): probed once, on a short-lived thread."""
    global _SUPPORTED
    if _SUPPORTED is None:
        _SUPPORTED = (hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")
                      and os.path.isdir("/proc/self/task") and _probe())
    return _SUPPORTED


def _probe():
    result = []

    def lower():
        try:
            idle_this_thread()
            result.append(os.sched_getscheduler(0) == os.SCHED_IDLE)
        except OSError:
            result.append(False)

    t = threading.Thread(target=lower, name="comm-priority-probe", daemon=True)
    t.start()
    t.join()
    return bool(result and result[0])


def idle_this_thread():
    """SCHED_IDLE for the calling thread (and the threads it starts from now on)."""
    os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))


def compute_threads():
    """Native ids of this process's threads that keep their priority in a worker."""
    return {t.native_id for t in threading.enumerate()
            if t.native_id is not None and (t is threading.main_thread()
                                            or t.name.startswith(COMPUTE_PREFIXES))}


def idle_threads(keep=()):
    """SCHED_IDLE for every thread of this process except the native ids in `keep`; returns how
    many were lowered. Threads that end meanwhile are skipped."""
    lowered = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid in keep:
            continue
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            lowered += 1
        except (ProcessLookupError, PermissionError):
            pass
    return lowered
