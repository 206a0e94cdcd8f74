"""NaN and Inf in a distributed iteration: each sync's verdict, and the error the job stops with.

Each sync checks its layer's gradient (or its sufficient factors) with one reduction before anything
is sent, so a bad gradient never leaves a worker. When one is bad the iteration's barrier fails; the
job then stops naming the iteration, the worker and the first bad layer in backward order (not the
first sync to fail, which depends on thread timing), and the last good snapshot to resume from.
"""
import threading

from ..errors import DistError


class NonFiniteGradient(DistError):
    """A synced layer's gradient holds NaN or Inf (raised by its sync before anything is sent)."""


class Verdicts:
    def __init__(self, name):
        self.name = name                        # the worker's, for messages
        self.last_snapshot = None
        self._cond = threading.Condition()
        self._checks = {}           # iteration -> {layer: what is not finite (None: all good)}

    def stop_line(self):
        return f"stopping (last good snapshot: {self.last_snapshot or 'none written yet'})"

    def begin(self, it):
        """A new iteration: forget older verdicts, but not the last iteration's, whose syncs may
        still be in flight while this one's forward runs (dist/worker/layerwait.py)."""
        with self._cond:
            self._checks = {i: c for i, c in self._checks.items() if i == it - 1}
            self._checks[it] = {}

    def record(self, it, layer, bad):
        """A sync's verdict for its layer (called on its thread before it sends anything)."""
        with self._cond:
            checks = self._checks.get(it)
            if checks is not None:
                checks[layer] = bad
                self._cond.notify_all()

    def error(self, it, layer_name, what):
        return NonFiniteGradient(f"{self.name}: iteration {it}: layer '{layer_name}' {what} has "
                                 f"NaN/Inf; {self.stop_line()}")

    def first_bad(self, it, syncers, wait_s=5.0):
        """After a sync failed: the NonFiniteGradient of the highest bad layer (the first in
        backward order) once every sync of the iteration has given its verdict; else None."""
        with self._cond:
            checks = self._checks.get(it, {})
            if not any(checks.values()):
                return None
            self._cond.wait_for(lambda: len(checks) >= len(syncers), wait_s)
            bad = {li: what for li, what in checks.items() if what}
        li = max(bad, key=lambda i: max(syncers[i].members))   # a bucket: its top layer
        return self.error(it, syncers[li].name, bad[li])
