"""The event loop and the queued resources of `poseidon simulate` (dist/sim/simulate.py).

Why apart: the model of an iteration (which job goes where) reads better without the mechanics of
time. A resource serves one job at a time; waiting jobs go in arrival order, or, when the resource
is made with `prioritized=True`, lowest priority number first (a layer's index: lower layers first,
so the next forward can start while upper layers still sync). Neither preempts a running job: a
message is cut into chunks upstream, which is where a lower layer can overtake.
"""
import heapq
import math


class EventQueue:
    """Timed actions in time order (ties in the order they were scheduled)."""

    def __init__(self):
        self.now = 0.0
        self._heap = []
        self._seq = 0
        self.count = 0

    def at(self, t, action):
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, action))

    def run(self):
        while self._heap:
            t, _, action = heapq.heappop(self._heap)
            self.now = t
            self.count += 1
            action()


class Fifo:
    """One resource. A job gives finish(start) -> finish time, done() and optionally
    on_start(start, end); `priority` orders waiting jobs when the resource is prioritized."""

    def __init__(self, events, name, prioritized=False):
        self.events, self.name, self.prioritized = events, name, prioritized
        self._waiting = []
        self._seq = 0
        self._done = None
        self.busy = False

    def submit(self, finish, done, on_start=None, priority=0):
        self._seq += 1
        key = priority if self.prioritized else 0
        heapq.heappush(self._waiting, (key, self._seq, finish, done, on_start))
        if not self.busy:
            self._next()

    def _next(self):
        if not self._waiting:
            self.busy = False
            return
        _, _, finish, done, on_start = heapq.heappop(self._waiting)
        self.busy = True
        start = self.events.now
        end = finish(start)
        if on_start:
            on_start(start, end)
        self._done = done
        self.events.at(end, self._complete)

    def _complete(self):
        done, self._done = self._done, None
        done()
        self._next()


def after(seconds):
    """A job's finish function for a fixed duration."""
    return lambda start: start + seconds


def seconds(nbytes, rate):
    """Time to move or process nbytes at rate (0 for nothing, or for an unlimited rate)."""
    return 0.0 if nbytes == 0 or rate == math.inf else nbytes / rate
