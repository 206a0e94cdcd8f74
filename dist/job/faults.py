"""Failpoints: a test hook that makes one process SIGKILL itself at a named point of a run.

    POSEIDON_FAILPOINT="worker:1:barrier:5,server:0:push:3"   role:index:point[:iteration]
    POSEIDON_FAILPOINT_ONCE=/some/folder                       each failpoint fires at most once
    POSEIDON_FAILPOINT_SIGNAL=SIGSTOP                          send this signal instead of SIGKILL

Why: the fault-injection tests need a kill at an exact place (inside the BSP barrier of iteration
5, between a snapshot's files and its manifest) that an outside `kill` can only hit by luck. A
failpoint whose iteration is left out or `*` fires the first time the point is reached. With
POSEIDON_FAILPOINT_ONCE a failpoint leaves a marker file there when it fires and never fires
again, so a job restarted by `--resume auto` runs past it; without it a failpoint fires on every
attempt (to exhaust `--max-restarts`). POSEIDON_FAILPOINT_SIGNAL=SIGSTOP makes the process stop
itself instead: alive, but silent, as a hung or suspended process is (after a SIGCONT it goes on
from the point).

Points: register (any role, before registering with the coordinator); init (worker 0 between the
servers' INIT and the weights to the other workers, other workers before receiving them, a
server on INIT); forward, backward (after the first layer's sync was handed to the pool), barrier
(in before_update, where the BSP barrier waits under --no-overlap), test (after the test forwards, before their allreduce), snapshot (a
worker entering a snapshot), snapshot-files (worker 0: every snapshot file written, the manifest
not yet), snapshot-done (after the snapshot barrier); push and get (a server receiving a push of
that iteration, or the n-th snapshot read).

With POSEIDON_FAILPOINT unset, `arm` keeps nothing and `point` returns at its first test.
"""
import os
import signal
import sys

_armed = ()            # (point, iteration or None, marker path or None) of this process
_signal = signal.SIGKILL


def parse(text):
    """'worker:1:barrier:5,server:0:push' -> [(role, index, point, iteration or None)]."""
    specs = []
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        parts = item.split(":")
        if len(parts) not in (3, 4) or parts[0] not in ("worker", "server"):
            raise ValueError(f"POSEIDON_FAILPOINT item '{item}' is not role:index:point[:iteration] "
                             f"(role worker or server)")
        it = parts[3] if len(parts) == 4 and parts[3] not in ("", "*") else None
        specs.append((parts[0], int(parts[1]), parts[2], None if it is None else int(it)))
    return specs


def arm(role, index, environ=None):
    """Keep the failpoints of POSEIDON_FAILPOINT that name this process (role, index in role)."""
    global _armed, _signal
    environ = os.environ if environ is None else environ
    text = environ.get("POSEIDON_FAILPOINT")
    if not text:
        _armed = ()
        return
    _signal = parse_signal(environ.get("POSEIDON_FAILPOINT_SIGNAL"))
    once = environ.get("POSEIDON_FAILPOINT_ONCE")
    _armed = tuple((point, it, os.path.join(once, f"{r}-{i}-{point}-{'any' if it is None else it}")
                    if once else None)
                   for r, i, point, it in parse(text) if r == role and i == index)


def parse_signal(text):
    """'SIGSTOP', 'STOP' or '19' -> signal.SIGSTOP; empty -> SIGKILL."""
    if not text:
        return signal.SIGKILL
    text = text.strip().upper()
    try:
        return signal.Signals(int(text)) if text.isdigit() else signal.Signals[
            text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise ValueError(f"POSEIDON_FAILPOINT_SIGNAL '{text}' is not a signal (give e.g. "
                         f"SIGSTOP)") from None


def point(name, iteration=None):
    """SIGKILL this process here (or send it POSEIDON_FAILPOINT_SIGNAL) if a failpoint names this
    point (and iteration)."""
    if not _armed:
        return
    for point_name, it, marker in _armed:
        if point_name == name and (it is None or it == iteration):
            if marker is not None:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    continue
            sys.stdout.flush()
            sys.stderr.write(f"failpoint {name}" + (f" at iteration {iteration}"
                                                    if iteration is not None else "")
                             + f": {_signal.name}\n")
            sys.stderr.flush()
            os.kill(os.getpid(), _signal)


def watch_server(transport):
    """A server's failpoints (init, push, get) on the messages it serves (from the queue or by a
    receive-thread handler); nothing when unarmed."""
    if not _armed:
        return
    from ..transport import Msg
    points = {Msg.KV_INIT: "init", Msg.KV_PUSH: "push", Msg.KV_GET: "get"}
    take = transport.next

    def next_with_failpoints(timeout=None):
        msg = take(timeout)
        if msg is not None and msg.type in points:
            point(points[msg.type], msg.iteration)
        return msg
    transport.next = next_with_failpoints
    handle = transport.handle

    def handle_with_failpoints(mtype, fn):      # the KV server serves on the receive thread
        if mtype in points:
            def served(msg):
                point(points[msg.type], msg.iteration)
                return fn(msg)
            return handle(mtype, served)
        return handle(mtype, fn)
    transport.handle = handle_with_failpoints
