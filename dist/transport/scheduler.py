"""The order in which a process hands its slices to one peer: lower layers first, with a window.

Why: wait-free backpropagation starts layer l's sync right after its backward, so a worker's syncs
are issued top layer first, while the next forward needs the bottom layers first. On a socket that
sends in arrival order a small bottom-layer message then waits behind every slice of a big
top-layer one. Here each peer (each outgoing socket) has one sender thread and a priority queue of
slices keyed by (priority, sequence): a message sent inside `at_priority(l)` (a sync of layer l;
lower = closer to the data) overtakes the untaken slices of any higher layer's message, at slice
boundaries only (a slice, once handed, goes whole). The sequence keeps one priority in arrival
order, so the slices of one message, and messages of one layer of successive iterations, never
swap. Messages sent outside any sync (control, start-up, snapshot) are URGENT: they are small or
someone waits on them alone, and they keep their order among themselves.

The window: at most `window` bytes of a peer's slices are "in flight" at once, a slice being in
flight from when it is handed to ZeroMQ until ZeroMQ releases its frame (its MessageTracker is done:
for TCP and Unix sockets, libzmq has written it to the kernel). Without the window every slice
would go to ZeroMQ's own unbounded queue at once (the sockets have no high-water mark) and the
order chosen here would be decided before the next message even arrived. The transport tracks
every frame of a scheduled socket, small ones included, so that each is counted (a frame with no
tracker would be out of our hands at once). A slice larger than the window goes alone once
nothing else is in flight, so the window never stops the queue.

Nothing here waits for ever: every wait is a slice of at most POLL_SECONDS that looks at the
scheduler's error, a peer that takes nothing for the transport's --timeout fails the queued
messages with a DeadlineError naming it, and `fail` (the transport's abort) reaches the sender
thread within one poll (or once the bandwidth cap has let the slice being sent go) and fails every
queued message with the abort's error.
"""
import heapq
import itertools
import threading
import time
from collections import deque
from contextlib import contextmanager

import zmq

from ..errors import DeadlineError, DistError

URGENT = -1                 # the priority of messages sent outside any layer's sync
POLL_SECONDS = 0.05         # the longest the sender thread waits without looking at its error
WINDOW_SLICES = 4           # the default window: this many slices in flight per peer

_thread = threading.local()


@contextmanager
def at_priority(level):
    """Messages this thread sends inside the block are queued at priority `level` (a layer
    index; None: URGENT). A context manager rather than an argument of send, so that whatever
    sends a layer's messages (a scheme, the KV client, a server's answer) need not carry it."""
    before = getattr(_thread, "level", None)
    _thread.level = level
    try:
        yield
    finally:
        _thread.level = before


def current_priority():
    """The priority a message sent now by this thread is queued at."""
    level = getattr(_thread, "level", None)
    return URGENT if level is None else int(level)


class Handover:
    """One message's way out: done once every slice was handed to ZeroMQ and ZeroMQ released
    them. It stands in a Receipt for a MessageTracker (`done`, `wait(timeout)` raising
    zmq.NotDone on a timeout), so that a caller waits for it as for a zero-copy frame; a message
    that could not be sent makes `wait` raise why."""

    def __init__(self, count):
        self._left = count
        self._trackers = []
        self._handed = threading.Event()
        self.error = None

    def _sent(self, trackers):
        self._trackers.extend(trackers)
        self._left -= 1
        if self._left <= 0:
            self._handed.set()

    def _fail(self, error):
        if not self._handed.is_set():
            self.error = error
            self._handed.set()

    @property
    def done(self):
        if not self._handed.is_set():
            return False
        return self.error is not None or all(t.done for t in self._trackers)

    def wait(self, timeout=-1):
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        if not self._handed.wait(None if deadline is None else timeout):
            raise zmq.NotDone
        if self.error is not None:
            raise self.error
        for t in self._trackers:
            t.wait(-1 if deadline is None else max(0.0, deadline - time.monotonic()))


class _Slice:
    __slots__ = ("header", "frames", "nbytes", "level", "handover", "mtype", "key",
                 "iteration", "index", "count")

    def __init__(self, header, frames, nbytes, level, handover, message, index, count):
        self.header, self.frames, self.nbytes, self.level = header, frames, nbytes, level
        self.handover, self.index, self.count = handover, index, count
        self.mtype, self.key, self.iteration = message


class PeerScheduler:
    """The slices waiting to go to one peer, and the thread that hands them to its socket.

    put(slice) -> trackers: sends one slice (its .header, .frames, .nbytes, .mtype, .key: the
    transport's socket send, which also takes the bandwidth cap's tokens). ordered: by priority, else in arrival order (--priority
    off, for comparison). on_slice(slice, start, end), when given, is told of every slice sent
    (the timeline). `timeout`: seconds the peer may take nothing before the queue fails."""

    def __init__(self, put, window, ordered=True, timeout=30.0, name="this process",
                 peer="its peer", on_slice=None):
        self._put = put
        self.window = int(window)
        self.ordered = ordered
        self.timeout = float(timeout)
        self.name, self.peer = name, peer
        self.on_slice = on_slice
        self._heap = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._inflight = deque()          # [bytes, trackers] of slices ZeroMQ has not released
        self.inflight_bytes = 0
        self.peak_inflight = 0            # the most bytes in flight at once (tests, counters)
        self._error = None
        self._closing = False
        self._busy = False                # a slice taken from the heap and not yet handed
        self._thread = None

    def submit(self, level, parts, message=(0, 0, 0)):
        """Queue one message's slices [(header, frames, bytes)] at priority `level`; its
        Handover. `message`: its (type, key, iteration), for the socket's errors and the
        timeline. Raises at once what already stopped the queue (an abort, a dead peer)."""
        handover = Handover(len(parts))
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._closing:
                raise DistError(f"{self.name} is closing: nothing more goes to {self.peer}")
            for i, (header, frames, nbytes) in enumerate(parts):
                item = _Slice(header, frames, nbytes, level, handover, message, i, len(parts))
                seq = next(self._seq)
                heapq.heappush(self._heap, (level if self.ordered else 0, seq, item))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"send-{self.peer}")
                self._thread.start()
            self._cond.notify()
        return handover

    def pending(self):
        """Slices queued and not yet handed (for tests and counters)."""
        with self._cond:
            return len(self._heap) + self._busy

    def fail(self, error):
        """Fail every queued message with `error` and stop the sender thread (within one poll)."""
        with self._cond:
            if self._error is None:
                self._error = error
            dropped, self._heap = self._heap, []
            self._cond.notify_all()
        for _, _, item in dropped:
            item.handover._fail(error)

    def close(self, linger=1.0):
        """Let what is queued go for at most `linger` seconds, then stop; what is left fails."""
        deadline = time.monotonic() + max(0.0, linger)
        with self._cond:
            self._closing = True
            while (self._heap or self._busy) and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, POLL_SECONDS))
        self.fail(DistError(f"{self.name} closed with messages to {self.peer} still queued"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    # ----- the sender thread ---------------------------------------------------------------------
    def _take(self):
        """The next slice to send, or None once the queue has failed or closed empty."""
        with self._cond:
            while not self._heap:
                if self._error is not None or self._closing:
                    return None
                self._cond.wait(POLL_SECONDS)
            if self._error is not None:
                return None
            self._busy = True
            return heapq.heappop(self._heap)[2]

    def _reap(self):
        """Give back the credit of every slice ZeroMQ has released (not only the oldest's: a
        later, smaller one may be written first)."""
        for entry in [e for e in self._inflight if all(t.done for t in e[1])]:
            self._inflight.remove(entry)
            self.inflight_bytes -= entry[0]

    def _wait_for_room(self, nbytes):
        """Wait until `nbytes` more fit in the window (or nothing is in flight); False when the
        queue failed meanwhile."""
        deadline = time.monotonic() + self.timeout
        while True:
            self._reap()
            if not self._inflight or self.inflight_bytes + nbytes <= self.window:
                return True
            if self._error is not None:
                return False
            if time.monotonic() > deadline:
                self.fail(DeadlineError(f"{self.name} could not send to {self.peer} within "
                                        f"{self.timeout:g} s ({self.inflight_bytes} bytes not "
                                        f"taken): is it still running?"))
                return False
            oldest = next((t for t in self._inflight[0][1] if not t.done), None)
            if oldest is None:               # released since the reap above
                continue
            try:
                oldest.wait(POLL_SECONDS)
            except (zmq.NotDone, TimeoutError):
                pass

    def _run(self):
        while True:
            item = self._take()
            if item is None:
                return
            try:
                if not self._wait_for_room(item.nbytes):
                    item.handover._fail(self._error)
                    continue
                start = time.time()
                try:
                    trackers = list(self._put(item))
                except Exception as e:     # the socket refused it: nothing after it can go
                    item.handover._fail(e)
                    self.fail(e)
                    continue
                end = time.time()
                if trackers:
                    self._inflight.append([item.nbytes, trackers])
                    self.inflight_bytes += item.nbytes
                    self.peak_inflight = max(self.peak_inflight, self.inflight_bytes)
                item.handover._sent(trackers)
                if self.on_slice is not None:
                    try:
                        self.on_slice(item, start, end)
                    except Exception:   # pragma: no cover - a record must not stop the sending
                        self.on_slice = None
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
