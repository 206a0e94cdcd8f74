"""Where received messages wait for the threads that take them.

Why: each process has one receive thread (and, on one host, direct links read by the waiting thread
itself), but many takers: a sync thread per layer waiting for its KV answer or factors, the main
thread at a barrier, a server or the coordinator serving requests in arrival order. So messages are
filed by (type, key, iteration), and a taker waits on its own entry with a deadline: a lost or
diverging peer gives an error that names what was awaited and from whom, not a silent hang
(Horovod's most common complaint), and a stalled wait logs a line now and then saying the same.
"""
import logging
import threading
import time
from collections import defaultdict, deque

from ..errors import DeadlineError
from ..roles import COORDINATOR
from .wire import Msg

MAX_FILED = 1 << 16    # messages waiting for a taker, in all: far more than a job's iteration has

_REPEATED = "a copy of a message that is still waiting to be taken (each comes once)"


def _once(msg):
    return (msg.sender, msg.type, msg.key, msg.iteration)


class Mailbox:
    """Messages filed by (type, key, iteration) for the threads that wait on them; some types
    (the ones a server or the coordinator serves in arrival order) go to one FIFO queue instead.

    One lock, but a condition per awaited key: a message wakes only the thread waiting for its
    key (or the FIFO reader), not every sync thread of the worker (a notify_all on one shared
    condition woke all of them for each of the iteration's messages).

    Bounded: a message of (type, key, iteration) comes once from each sender, so a copy of one
    still waiting (a repeating member, a replay) is refused rather than filed, and no more than
    MAX_FILED messages wait in all; `put` says why it refused one, and the transport drops, logs
    and counts it as it does any bad message."""

    def __init__(self, namer):
        self._lock = threading.Lock()
        self._boxes = defaultdict(list)
        self._fifo = deque()
        self._fifo_types = frozenset()
        self._fifo_cond = threading.Condition(self._lock)
        self._queued = set()          # (sender, type, key, iteration) of the FIFO's messages
        self._filed = 0               # messages in the boxes and the FIFO
        self._waiting = {}            # key -> [condition, number of waiters]
        self._error = None
        self._namer = namer
        self.owner = None             # this process's name, for the stall inspector's lines
        self.stall_warning = 0.0      # seconds between stall lines (0: never); the session sets it

    def _wake_all(self):
        self._fifo_cond.notify_all()
        for cond, _ in self._waiting.values():
            cond.notify_all()

    def set_fifo(self, types):
        """Serve these types in arrival order (messages already filed move to the queue)."""
        with self._lock:
            self._fifo_types = frozenset(types)
            early = [m for k in list(self._boxes) if k[0] in self._fifo_types
                     for m in self._boxes.pop(k)]
            early.sort(key=lambda m: m.received_at)
            self._fifo.extend(early)
            self._queued.update(_once(m) for m in early)
            self._wake_all()

    def put(self, msg):
        """File msg for its taker; None, or why it was refused (a copy of a waiting message, or
        the mailbox is full)."""
        with self._lock:
            if self._filed >= MAX_FILED:
                return f"{MAX_FILED} messages already wait to be taken"
            if msg.type in self._fifo_types:
                once = _once(msg)
                if once in self._queued:
                    return _REPEATED
                self._queued.add(once)
                self._fifo.append(msg)
                self._fifo_cond.notify_all()
            else:
                k = (msg.type, msg.key, msg.iteration)
                box = self._boxes[k]
                if any(m.sender == msg.sender for m in box):
                    return _REPEATED
                box.append(msg)
                waiting = self._waiting.get(k)
                if waiting is not None:
                    waiting[0].notify_all()
            self._filed += 1
            return None

    def fail(self, error):
        with self._lock:
            if self._error is None:
                self._error = error
            self._wake_all()

    @property
    def error(self):
        return self._error

    def take(self, mtype, key, iteration, count=1, timeout=30.0, what=None, senders=None,
             pump=None):
        """Wait for `count` messages of (type, key, iteration); returns them sorted by sender.

        pump(seconds), when given, is how this thread waits instead of sleeping on a condition:
        it reads and files what arrives on a direct link (dist/transport/onehost/directlink.py)
        for at most that long, and returns False once the link is gone (the wait goes on as a
        plain one).

        On the deadline raises DeadlineError naming `what` and the senders that did not answer.
        Every `stall_warning` seconds of waiting (an attribute the session sets; 0: never) it logs
        one line naming what is awaited and from whom (the stall inspector)."""
        k = (mtype, key, iteration)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        stall = self.stall_warning or 0
        warn_at = start + stall

        def awaited(box):            # (what, from whom) for the deadline error and stall lines
            have = {m.sender for m in (box or [])}
            missing = [s for s in (senders or []) if s not in have]
            return (what or f"{Msg(mtype).name} key {key} iteration {iteration}",
                    ", ".join(self._namer(s) for s in missing) if missing
                    else f"{count - len(have)} sender(s)")

        with self._lock:
            cond = None
            try:
                while True:
                    if self._error is not None:
                        raise self._error
                    box = self._boxes.get(k)
                    if box is not None and len(box) >= count:
                        got = box[:count]
                        del box[:count]
                        self._filed -= count
                        if not box:
                            del self._boxes[k]
                        got.sort(key=lambda m: m.sender)
                        return got
                    now = time.monotonic()
                    left = None if deadline is None else deadline - now
                    if left is not None and left <= 0:
                        label, source = awaited(box)
                        raise DeadlineError(f"timed out after {timeout:g} s waiting for {label} "
                                            f"from {source} (raise --timeout if the peers are "
                                            f"just slow)")
                    if stall and now >= warn_at:
                        warn_at = now + stall
                        where = ("" if COORDINATOR in (senders or [])
                                 else f"iteration {iteration}: ")
                        got = f"; got {len(box or [])} of {count}" if count > 1 else ""
                        label, source = awaited(box)
                        logging.getLogger("poseidon").warning(
                            f"{self.owner or 'this process'}: {where}waiting "
                            f"{now - start:.0f} s for {label} from {source}{got}")
                    if pump is not None:
                        self._lock.release()
                        try:
                            if not pump(0.1 if left is None else min(left, 0.1)):
                                pump = None
                        finally:
                            self._lock.acquire()
                        continue
                    if cond is None:          # register as a waiter for k (put wakes only us)
                        waiting = self._waiting.get(k)
                        if waiting is None:
                            waiting = self._waiting[k] = [threading.Condition(self._lock), 0]
                        waiting[1] += 1
                        cond = waiting[0]
                    cond.wait(1.0 if left is None else min(left, 1.0))
            finally:
                if cond is not None:
                    waiting = self._waiting[k]
                    waiting[1] -= 1
                    if not waiting[1]:
                        del self._waiting[k]

    def next(self, timeout=None):
        """The next FIFO message, or None after `timeout` seconds (None: wait for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._error is not None:
                    raise self._error
                if self._fifo:
                    msg = self._fifo.popleft()
                    self._queued.discard(_once(msg))
                    self._filed -= 1
                    return msg
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._fifo_cond.wait(1.0 if left is None else min(left, 1.0))

