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

import numpy

from ..errors import DeadlineError
from ..job.roles import COORDINATOR
from .wire import Msg

MAX_FILED = 1 << 16    # messages waiting for a taker, in all: far more than a job's iteration has

# Bytes the messages waiting to be taken may hold: per sender, and of all senders together. Before
# the book is known, the floors; once it is (`size_for`), this many times the model's bytes where
# that is more. The most a member legitimately has waiting is about three times the model (worker
# 0's initial WEIGHTS, or a snapshot's KV_GET_REPLY: every parameter with up to two history
# arrays), so a job of any size fits, and one sender cannot hold more than a few times the model.
PEER_BYTES = 256 << 20
PEER_MODELS = 4
HELD_BYTES = 1 << 30
HELD_MODELS = 8

# Ring pieces and sufficient factors are exchanged every iteration under BSP only, and a worker is
# never more than two iterations behind a peer that sends it one (its peer cannot finish an
# iteration without what this worker sends after taking the one before). One for an iteration more
# than STEP_WINDOW ahead of the highest this process has taken of STEP_MARKS (its iteration) cannot
# be a member's: the transport refuses it at the door, and any filed before the first take are let
# go then. A KV value taken marks the iteration too, but KV values are not refused by it: under
# --staleness a worker may have several iterations' values on their way.
STEP_WINDOW = 4
STEP_TYPES = frozenset({Msg.RING, Msg.SF})
STEP_MARKS = STEP_TYPES | {Msg.KV_VALUE}
MAX_ORIGINS = 1 << 14     # where the ring pieces of recent iterations came from (for duplicates)

REPEATED = "a copy of a message that is still waiting to be taken (each comes once)"


class Refusal(str):
    """Why a message was refused, with the kind of refusal (`kind`) a sender is told of once:
    the transport logs the first of each kind per sender and counts the rest."""

    def __new__(cls, text, kind):
        self = super().__new__(cls, text)
        self.kind = kind
        return self


def _once(msg):
    return (msg.sender, msg.type, msg.key, msg.iteration)


def _mb(n):
    return f"{n / 1e6:.1f} MB"


class Mailbox:
    """Messages filed by (type, key, iteration) for the threads that wait on them; some types
    (the ones a server or the coordinator serves in arrival order) go to one FIFO queue instead.

    One lock, but a condition per awaited key: a message wakes only the thread waiting for its
    key (or the FIFO reader), not every sync thread of the worker (a notify_all on one shared
    condition woke all of them for each of the iteration's messages).

    Bounded: a message of (type, key, iteration) comes once from each sender, so a copy of one
    still waiting (a repeating member, a replay) is refused rather than filed; no more than
    MAX_FILED messages wait in all, and their payload bytes are bounded per sender (`peer_limit`)
    and in all (`held_limit`). `put` says why it refused one, and the transport drops, logs and
    counts it as it does any bad message.

    It also keeps this process's iteration as its takes say it (`step`: STEP_WINDOW), which the
    transport's door reads, and lets go of ring pieces and factors filed beyond that window before
    the iteration was known (`on_evict` is told of them)."""

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
        self._held = 0                # payload bytes of the messages in the boxes and the FIFO
        self._held_by = {}            # sender -> its share of them
        self.peer_limit = PEER_BYTES
        self.held_limit = HELD_BYTES
        self.sized_for = None         # the book the limits were worked out from
        self.step = None              # the highest iteration taken of STEP_MARKS
        self._step_far = None         # the highest iteration of a STEP_TYPES message filed
        self.on_evict = None          # fn([messages], why): let go of ('window' or 'room')
        self.refused = {}             # Refusal kind -> messages refused so far
        self._told = set()            # (sender, kind) of the refusals already logged
        self._origins = {}            # (key, iteration) of a ring piece -> where it came from

    # ----- bytes ----------------------------------------------------------------------------------
    def size_for(self, book):
        """Derive the byte limits from the model the book describes (see PEER_MODELS)."""
        model = (sum(int(p.count) for p in book.params)
                 * numpy.dtype(book.data["dtype"]).itemsize)
        with self._lock:
            self.peer_limit = max(PEER_BYTES, PEER_MODELS * model)
            self.held_limit = max(HELD_BYTES, HELD_MODELS * model, self.peer_limit)
            self.sized_for = book

    def held_bytes(self, sender=None):
        """Payload bytes waiting to be taken (of one sender, or of all)."""
        with self._lock:
            return self._held if sender is None else self._held_by.get(sender, 0)

    def _release(self, msgs):
        for m in msgs:
            n = m.payload_bytes
            self._held -= n
            left = self._held_by.get(m.sender, 0) - n
            if left > 0:
                self._held_by[m.sender] = left
            else:                              # nothing of it waits (or only messages of 0 bytes)
                self._held_by.pop(m.sender, None)

    def first_refusal(self, sender, kind):
        """Count a refusal of this kind; True for the first of its sender (the one to log)."""
        with self._lock:
            self.refused[kind] = self.refused.get(kind, 0) + 1
            if (sender, kind) in self._told or len(self._told) >= MAX_ORIGINS:
                return False
            self._told.add((sender, kind))
            return True

    # ----- where ring pieces came from ------------------------------------------------------------
    def note_origin(self, msg, origin):
        """Remember where the ring piece kept for (key, iteration) came from."""
        if origin is not None:
            with self._lock:
                if len(self._origins) < MAX_ORIGINS:
                    self._origins.setdefault((msg.key, msg.iteration), origin)

    def origin_of(self, key, iteration):
        with self._lock:
            return self._origins.get((key, iteration))

    # ----- the iteration --------------------------------------------------------------------------
    def _stepped(self, mtype, iteration):
        """After a take: raise `step`; the messages beyond the new window, to let go of."""
        if mtype not in STEP_MARKS or (self.step is not None and iteration <= self.step):
            return ()
        self.step = iteration
        if self._origins:
            old = [k for k in self._origins if k[1] < iteration - 1]
            for k in old:
                del self._origins[k]
        edge = iteration + STEP_WINDOW
        if self._step_far is None or self._step_far <= edge:
            return ()
        self._step_far = edge
        gone = []
        for k in [k for k in self._boxes if k[0] in STEP_TYPES and k[2] > edge]:
            gone.extend(self._boxes.pop(k))
        self._filed -= len(gone)
        self._release(gone)
        return gone

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
        the mailbox is full: in messages, in its sender's bytes or in all bytes).

        A ring piece or factors that would not fit make room by letting go of ones of later
        iterations (of its sender for the sender's limit), farthest first, where that is enough:
        a member's are for the nearest iterations, so a flood of far ones cannot keep them out
        (`on_evict` is told of those let go)."""
        reason, gone = self._put(msg)
        if gone and self.on_evict is not None:
            self.on_evict(gone, "room")
        return reason

    def _put(self, msg):
        n = msg.payload_bytes
        sender = msg.sender
        gone = ()
        with self._lock:
            if self._filed >= MAX_FILED:
                return Refusal(f"{MAX_FILED} messages already wait to be taken", "full"), gone
            fifo = msg.type in self._fifo_types
            if fifo:
                once = _once(msg)
                if once in self._queued:
                    return REPEATED, gone
            else:
                k = (msg.type, msg.key, msg.iteration)
                if any(m.sender == sender for m in self._boxes.get(k, ())):
                    return REPEATED, gone
            mine = self._held_by.get(sender, 0)
            if mine + n > self.peer_limit:
                gone = self._room(msg, mine + n - self.peer_limit, sender)
                if gone is None:
                    return Refusal(
                        f"{msg.type.name} of {_mb(n)}: the messages of {self._namer(sender)} "
                        f"waiting to be taken already hold {_mb(mine)}, and one sender may have "
                        f"at most {_mb(self.peer_limit)} waiting", "sender bytes"), ()
                mine = self._held_by.get(sender, 0)
            if self._held + n > self.held_limit:
                more = self._room(msg, self._held + n - self.held_limit)
                if more is None:
                    return Refusal(
                        f"{msg.type.name} of {_mb(n)}: the messages waiting to be taken already "
                        f"hold {_mb(self._held)}, at most {_mb(self.held_limit)} in all",
                        "all bytes"), gone
                gone = list(gone) + more
                mine = self._held_by.get(sender, 0)
            if fifo:
                self._queued.add(once)
                self._fifo.append(msg)
                self._fifo_cond.notify_all()
            else:
                self._boxes[k].append(msg)
                waiting = self._waiting.get(k)
                if waiting is not None:
                    waiting[0].notify_all()
                if msg.type in STEP_TYPES and (self._step_far is None
                                               or msg.iteration > self._step_far):
                    self._step_far = msg.iteration
            self._filed += 1
            self._held += n
            if mine + n:
                self._held_by[sender] = mine + n
            return None, gone

    def _room(self, msg, need, sender=None):
        """Let go of filed ring pieces and factors of iterations after msg's (of `sender` only,
        unless None), farthest first, until `need` bytes are free: the list, or None (and nothing
        let go of) when they would not be enough."""
        if (msg.type not in STEP_TYPES or self._step_far is None
                or msg.iteration >= self._step_far):
            return None
        later = sorted(((k, m) for k, box in self._boxes.items()
                        if k[0] in STEP_TYPES and k[2] > msg.iteration
                        for m in box if sender is None or m.sender == sender),
                       key=lambda km: -km[0][2])
        chosen, free = [], 0
        for k, m in later:
            if free >= need:
                break
            chosen.append((k, m))
            free += m.payload_bytes
        if free < need:
            return None
        for k, m in chosen:
            box = self._boxes[k]
            box.remove(m)
            if not box:
                del self._boxes[k]
        gone = [m for _, m in chosen]
        self._filed -= len(gone)
        self._release(gone)
        return gone

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
        got, gone = self._take(mtype, key, iteration, count, timeout, what, senders, pump)
        if gone and self.on_evict is not None:
            self.on_evict(gone, "window")
        return got

    def _take(self, mtype, key, iteration, count, timeout, what, senders, pump):
        """take's wait: (the messages, those let go of as beyond the window its take opened)."""
        k = (mtype, key, iteration)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        stall = self.stall_warning or 0
        warn_at = start + stall
        with self._lock:
            cond = None
            try:
                while True:
                    if self._error is not None:
                        raise self._error
                    box = self._boxes.get(k)
                    if box is not None and len(box) >= count:
                        return self._pop(k, count), self._stepped(mtype, iteration)
                    now = time.monotonic()
                    left = None if deadline is None else deadline - now
                    if left is not None and left <= 0:
                        label, source = self._awaited(k, count, what, senders, box)
                        raise DeadlineError(f"timed out after {timeout:g} s waiting for {label} "
                                            f"from {source} (raise --timeout if the peers are "
                                            f"just slow)")
                    if stall and now >= warn_at:
                        warn_at = now + stall
                        self._warn_stalled(k, count, what, senders, box, now - start)
                    if pump is not None:
                        self._lock.release()
                        try:
                            if not pump(0.1 if left is None else min(left, 0.1)):
                                pump = None
                        finally:
                            self._lock.acquire()
                        continue
                    if cond is None:          # register as a waiter for k (put wakes only us)
                        cond = self._add_waiter(k)
                    cond.wait(1.0 if left is None else min(left, 1.0))
            finally:
                if cond is not None:
                    self._remove_waiter(k)

    # the helpers of _take run with the lock held
    def _pop(self, k, count):
        """The first `count` messages filed under k, by sender, no longer held."""
        box = self._boxes[k]
        got = box[:count]
        del box[:count]
        self._filed -= count
        self._release(got)
        if not box:
            del self._boxes[k]
        got.sort(key=lambda m: m.sender)
        return got

    def _awaited(self, k, count, what, senders, box):
        """(what, from whom) a wait for k is waiting for: its deadline error and stall lines."""
        mtype, key, iteration = k
        have = {m.sender for m in (box or [])}
        missing = [s for s in (senders or []) if s not in have]
        return (what or f"{Msg(mtype).name} key {key} iteration {iteration}",
                ", ".join(self._namer(s) for s in missing) if missing
                else f"{count - len(have)} sender(s)")

    def _warn_stalled(self, k, count, what, senders, box, waited):
        """Log that a wait for k is still waiting, for what and from whom."""
        where = "" if COORDINATOR in (senders or []) else f"iteration {k[2]}: "
        got = f"; got {len(box or [])} of {count}" if count > 1 else ""
        label, source = self._awaited(k, count, what, senders, box)
        logging.getLogger("poseidon").warning(
            f"{self.owner or 'this process'}: {where}waiting "
            f"{waited:.0f} s for {label} from {source}{got}")

    def _add_waiter(self, k):
        """The condition a taker of k sleeps on, counting it as one more waiter (put wakes only
        the waiters of the key it files)."""
        waiting = self._waiting.get(k)
        if waiting is None:
            waiting = self._waiting[k] = [threading.Condition(self._lock), 0]
        waiting[1] += 1
        return waiting[0]

    def _remove_waiter(self, k):
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
                    self._release((msg,))
                    return msg
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._fifo_cond.wait(1.0 if left is None else min(left, 1.0))

