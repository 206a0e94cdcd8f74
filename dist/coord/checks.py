"""What a decoded message must be for a process to accept it; anything else is dropped.

Why: a member of the job (it holds the job's keys) can still be buggy, and a process must never
crash, hang or take wrong numbers because of one bad message. The transport's receive thread
asks `WireRules.check(msg)` before filing a message; a reason string means "drop it, log one
line, count it". The checks are cheap (no copy of the payload) and come in three layers:
- structure: arrays and JSON object as the type needs them;
- roles: who may send a type and who receives it (a
  KV_PUSH comes from a worker to a server, a BOOK from the coordinator, ...); a sender outside the
  job or the process itself is refused;
- fields: the JSON object of a control message, field by field (dist/coord/control.py);
- the book (once the process has it): on a worker, the key, dtype and shape of KV values, snapshot
  replies, sufficient factors, ring pieces and initial weights, and the server a KV pair lives on. Servers check
  their own pairs in dist/kv/store.py, where the pair state is.
A transport made without the job's Roles (unit tests, tools) checks only the decoding.
Message types that are in `Msg` but have no rule here pass the role and structure checks (a rule
is one line in RULES), so a new type works before anyone writes its rule.
"""
from dataclasses import replace

import numpy

from .control import field_reason
from .placement import MAX_BUNDLE_ARRAYS
from ..job.roles import COORDINATOR
from ..schemes import Scheme, scheme_class
from ..schemes.ring import ring_address
from ..transport import Msg

ANY = (0, 64)   # arrays (besides the JSON object) a type may carry: (least, most)

# type: (who sends, who receives, (least, most) arrays, JSON fields it must carry)
RULES = {
    Msg.REGISTER: ("rank", "coordinator", (0, 0), ("rank", "address")),
    Msg.BARRIER: ("rank", "coordinator", (0, 0), ()),
    Msg.ALLREDUCE: ("worker", "coordinator", (1, 1), ()),
    Msg.GATHER: ("worker", "coordinator", (0, 0), ()),
    Msg.FAILED: ("rank", "coordinator", (0, 0), ()),
    Msg.DONE: ("rank", "coordinator", (0, 0), ()),
    Msg.QUERY: ("rank", "coordinator", (0, 0), ()),
    Msg.HEARTBEAT: ("anyone", "anyone", (0, 0), ()),
    Msg.BOOK: ("coordinator", "rank", (0, 0), ("workers", "pairs")),
    Msg.BARRIER_DONE: ("coordinator", "rank", (0, 0), ()),
    Msg.ALLREDUCE_DONE: ("coordinator", "worker", (1, 1), ()),
    Msg.GATHER_DONE: ("coordinator", "worker", (0, 0), ("items",)),
    Msg.QUERY_REPLY: ("coordinator", "rank", (0, 0), ()),
    Msg.ABORT: ("coordinator", "rank", (0, 0), ()),
    Msg.KV_INIT: ("worker0", "server", ANY, ()),
    Msg.KV_INIT_DONE: ("worker0", "server", (0, 0), ()),
    Msg.KV_GET: ("worker", "server", (0, 0), ()),     # snapshots; a layer's move off PS
    Msg.KV_SHUTDOWN: ("worker0", "server", (0, 0), ()),
    Msg.KV_PUSH: ("worker", "server", (1, MAX_BUNDLE_ARRAYS), ()),
    Msg.KV_VALUE: ("server", "worker", (1, MAX_BUNDLE_ARRAYS), ()),
    Msg.KV_GET_REPLY: ("server", "worker", ANY, ()),
    Msg.KV_INIT_ACK: ("server", "worker0", (0, 0), ()),
    Msg.SF: ("worker", "worker", (1, 16), ()),   # the layer's scheme checks the arrays
    Msg.RING: ("worker", "worker", (1, 1), ()),  # ... and the piece's length and sender
    Msg.WEIGHTS: ("worker0", "other worker", ANY, ()),
    Msg.CURSOR: ("worker0", "other worker", (0, 0), ("iter",)),
    Msg.ROUTES: ("worker0", "other worker", (0, 0), ("routes",)),
    Msg.PROBE: ("worker", "rank", (1, 1), ()),
    Msg.PROBE_ECHO: ("rank", "worker", (0, 0), ()),
    Msg.COSTS: ("worker", "coordinator", (0, 0), ()),   # its fields: the coordinator's handler
    Msg.SCHEMES: ("coordinator", "worker", (0, 0), ("choices",)),
}
JSON_ONLY_FOR = {Msg.ALLREDUCE, Msg.ALLREDUCE_DONE}    # their one array is a float64 vector
SHARED_TYPES = {Msg.KV_PUSH, Msg.KV_VALUE}            # may keep their arrays in shared memory


BOOK_SIZED = {Msg.KV_VALUE, Msg.KV_GET_REPLY, Msg.SF, Msg.RING, Msg.WEIGHTS}   # the book fixes their shapes


class _Described:
    """A message known by its arrays' descriptions only (zero-stride arrays of those shapes)."""

    shared = False

    def __init__(self, mtype, sender, key, arrays):
        self.type, self.sender, self.key, self.arrays = mtype, sender, key, arrays


def _is(role, rank, roles):
    if role == "anyone":
        return rank == COORDINATOR or 0 <= rank < roles.size
    if role == "coordinator":
        return rank == COORDINATOR
    if role == "rank":
        return 0 <= rank < roles.size
    if role == "worker":
        return roles.is_worker(rank)
    if role == "worker0":
        return rank == 0
    if role == "other worker":
        return roles.is_worker(rank) and rank != 0
    if role == "server":
        return roles.is_server(rank)
    return False


ROLE_WORDS = {"rank": "workers and servers", "worker": "workers", "worker0": "worker 0",
              "other worker": "workers other than 0", "server": "servers",
              "coordinator": "coordinator"}


def _spec(a):
    return f"{a.dtype.name}{list(a.shape)}"


class WireRules:
    """The checks of one process (rank, or COORDINATOR); `roles` and `book` may come later."""

    def __init__(self, rank, roles=None, namer=None):
        self.rank = rank
        self.roles = roles
        self.namer = namer or (lambda r: f"rank {r}")
        self.book = None
        self._pairs = {}
        self._peer = self._ring = {}  # layer -> its book record, for layers synced peer to peer
        self._dtype = None
        self._verdicts = {}          # (type, sender) -> the role check's verdict (see _roles_say)
        self._verdicts_for = None    # the roles those verdicts were reached with
        self._values = {}            # message key -> (server rank, shapes) of its KV_VALUE arrays

    def set_book(self, book):
        """Learn the shapes a worker expects (KV pairs, SFB layers, parameters)."""
        self._dtype = numpy.dtype(book.data["dtype"])
        self._pairs = {p.id: p for p in book.pairs}
        # a layer the measured model may move to a peer scheme too (its own scheme first: the
        # one whose SF messages or ring pieces it checks)
        self._peer = self._layers_taking(book, "peer_arrays")
        self._ring = self._layers_taking(book, "ring_piece")
        self._values = ({} if self.roles is None else
                        {b.id: (self.roles.server_rank(b.server),
                                [(self._pairs[k].length,) for k in b.pairs])
                         for b in book.bundles})
        self.book = book

    @staticmethod
    def _layers_taking(book, method):
        """{layer index: its record, scheme = the first of its schemes (its own, then the measured
        model's candidates) that defines `method`: takes peer-to-peer messages of that kind}."""
        out = {}
        for rec in book.layers:
            names = [rec.scheme] + list(rec.candidates or ())
            takers = [n for n in names if n and not scheme_class(n).uses_servers
                      and getattr(scheme_class(n), method) is not getattr(Scheme, method)]
            if takers:
                out[rec.index] = replace(rec, scheme=takers[0])
        return out

    # ----- the check -----------------------------------------------------------------------------
    def check(self, msg):
        """None if msg may be filed, else why not (one line)."""
        rule = RULES.get(msg.type)
        if rule is None or self.roles is None:    # a bare transport (no job) checks decoding only
            return None
        senders, receivers, (least, most), fields = rule
        name = msg.type.name
        if msg.obj is not None and not isinstance(msg.obj, dict):
            return f"{name} carries a JSON {type(msg.obj).__name__}, not an object"
        for f in fields:
            if not isinstance(msg.obj, dict) or f not in msg.obj:
                return f"{name} lacks the field '{f}'"
        if msg.shared:                         # arrays in the server's shared memory (kvshm)
            if msg.type not in SHARED_TYPES:
                return f"{name} cannot keep its arrays in shared memory"
            least = most = 0
        if not least <= len(msg.arrays) <= most:
            return (f"{name} carries {len(msg.arrays)} arrays, expected "
                    f"{least if least == most else f'{least} to {most}'}")
        if msg.type in JSON_ONLY_FOR:
            a = msg.arrays[0]
            if a.dtype != numpy.float64 or a.ndim != 1:
                return f"{name} carries {_spec(a)}, expected a float64 vector"
        reason = self._roles_say(msg.type, msg.sender, name) or field_reason(msg, self.roles)
        if reason is not None:
            return reason
        if self.book is not None:
            if msg.type == Msg.KV_VALUE:       # the common case, checked without building lists
                server, shapes = self._values.get(msg.key, (None, ()))
                dtype, arrays = self._dtype, msg.arrays
                if (msg.sender == server and len(arrays) == len(shapes)
                        and all(a.dtype == dtype and a.shape == shape
                                for a, shape in zip(arrays, shapes))):
                    return None
            return self._check_shapes(msg, name)
        return None

    def check_specs(self, mtype, sender, key, specs):
        """Why a message of these (dtype, shape) arrays (the JSON object's left out) from sender
        cannot be a member's, or None. Asked of a sliced message's first slice, before its whole
        is allocated: the count and role checks, and the book's shapes where it fixes them, so a
        whole is never sized by what a sender claims beyond what the job allows."""
        rule = RULES.get(mtype)
        if rule is None or self.roles is None:
            return None
        name = mtype.name
        least, most = rule[2]
        if not least <= len(specs) <= most:
            return (f"{name} declares {len(specs)} arrays, expected "
                    f"{least if least == most else f'{least} to {most}'}")
        reason = self._roles_say(mtype, sender, name)
        if reason is not None or self.book is None or mtype not in BOOK_SIZED:
            return reason
        arrays = [numpy.lib.stride_tricks.as_strided(numpy.zeros(1, dtype), shape,
                                                     (0,) * len(shape)) for dtype, shape in specs]
        return self._check_shapes(_Described(mtype, sender, key, arrays), name)

    def _roles_say(self, mtype, sender, name):
        """The sender/receiver check, which depends only on (type, sender) once the roles are
        known: worked out once per pair and then looked up, since a job's messages repeat the
        same few pairs."""
        roles = self.roles
        if self._verdicts_for is not roles:
            self._verdicts, self._verdicts_for = {}, roles
        k = (mtype, sender)
        try:
            return self._verdicts[k]
        except KeyError:
            pass
        reason = self._role_reason(mtype, sender, name)
        if len(self._verdicts) < 4096:        # bounded: a sender cannot make it grow for ever
            self._verdicts[k] = reason
        return reason

    def _role_reason(self, mtype, sender, name):
        senders, receivers = RULES[mtype][:2]
        roles = self.roles
        if sender == self.rank:
            return f"{name} claims to come from this process itself"
        if not _is("anyone", sender, roles):
            return f"{name} from rank {sender}, which is not a member of this job"
        if not _is(senders, sender, roles):
            return (f"{name} may come only from the {ROLE_WORDS[senders]}, not from "
                    f"{self.namer(sender)}")
        if not _is(receivers, self.rank, roles):
            return f"{name} is not a message {self.namer(self.rank)} takes"
        return None

    def _check_shapes(self, msg, name):
        if msg.type == Msg.KV_VALUE:
            if msg.key not in self._values:
                why = ("is not the first pair of a message" if msg.key in self._pairs else
                       "the book does not have")
                return f"{name} for KV pair {msg.key}, which {why}"
            server, shapes = self._values[msg.key]
            if msg.sender != server:
                return (f"{name} for KV pair {msg.key} from {self.namer(msg.sender)}, but the pair "
                        f"lives on {self.namer(server)}")
            if msg.shared:                     # the values are in the server's memory (kvshm)
                return None
            if len(msg.arrays) != len(shapes):
                return (f"{name} for KV pair {msg.key} carries {len(msg.arrays)} arrays, its "
                        f"message holds {len(shapes)} pairs")
            return self._arrays_are(msg, name, shapes, f"KV pair {msg.key}")
        if msg.type == Msg.KV_GET_REPLY:
            pair = self._pairs.get(msg.key)
            if pair is None:
                return f"{name} for KV pair {msg.key}, which the book does not have"
            server = self.roles.server_rank(pair.server)
            if msg.sender != server:
                return (f"{name} for KV pair {msg.key} from {self.namer(msg.sender)}, but the pair "
                        f"lives on {self.namer(server)}")
            return self._arrays_are(msg, name, [(pair.length,)] * len(msg.arrays),
                                    f"KV pair {msg.key}")
        if msg.type == Msg.SF:
            rec = self._peer.get(msg.key)
            if rec is None:
                return f"SF for layer {msg.key}, which the book does not sync peer to peer"
            want, expected = scheme_class(rec.scheme).peer_arrays(rec, msg.arrays)
            if want is None:
                return (f"{name} for layer '{rec.name}' from {self.namer(msg.sender)}: "
                        f"{len(msg.arrays)} arrays, {self.namer(self.rank)} expects {expected}")
            return self._arrays_are(msg, name, want, f"layer '{rec.name}'", expected)
        if msg.type == Msg.RING:
            return self._ring_reason(msg, name)
        if msg.type == Msg.WEIGHTS:
            if not 0 <= msg.key < len(self.book.params):
                return f"WEIGHTS for parameter {msg.key}, which the book does not have"
            count = self.book.params[msg.key].count
            return self._arrays_are(msg, name, [(count,)] * len(msg.arrays),
                                    f"parameter '{self.book.params[msg.key].name}'")
        return None

    def ring_label(self, key):
        """'slot 3 of layer 'ip1'' for a ring piece's key (the layer's index where the book has
        no such layer), for the lines that name a piece."""
        li, slot = ring_address(key)
        rec = self._ring.get(li)
        return f"slot {slot} of layer " + (f"'{rec.name}'" if rec else str(li))

    def _ring_reason(self, msg, name):
        """A ring piece comes from this worker's left neighbour, for a layer the book syncs peer to
        peer, at a slot the layer's ring has, with exactly that piece's length."""
        li, slot = ring_address(msg.key)
        rec = self._ring.get(li)
        if rec is None:
            return f"{name} for layer {li}, which the book does not sync peer to peer"
        ring = self.roles.worker_ranks()
        position = ring.index(self.rank)
        left = ring[position - 1]
        if msg.sender != left:
            return (f"{name} for layer '{rec.name}' from {self.namer(msg.sender)}, but "
                    f"{self.namer(self.rank)} takes the ring's pieces from {self.namer(left)}")
        length = scheme_class(rec.scheme).ring_piece(rec, slot, len(ring), position)
        if length is None:
            return (f"{name} for layer '{rec.name}' (synced by {rec.scheme}): piece {slot} "
                    f"is none that {self.namer(self.rank)} takes")
        return self._arrays_are(msg, name, [(length,)], f"layer '{rec.name}' (piece {slot})")

    def _arrays_are(self, msg, name, shapes, what, expected=None):
        for i, (a, shape) in enumerate(zip(msg.arrays, shapes)):
            if a.dtype != self._dtype or shape is None or a.shape != tuple(shape):
                want = expected or f"{list(shape)}"
                return (f"{name} for {what} from {self.namer(msg.sender)}: array {i} is "
                        f"{_spec(a)}, {self.namer(self.rank)} expects {self._dtype.name} {want}")
        return None
