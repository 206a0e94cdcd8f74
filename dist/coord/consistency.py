"""What a KV-store server does with pushes when BSP is relaxed: BSP with drop, and bounded staleness.

Why a module of its own: the BSP path in dist/kv/store.py stays exactly as it was (every pair waits
for all P1 pushes, sums in rank order; bitwise reproducible), and the two relaxed rules plug in
beside it as policies the server consults (`on_init`, `on_push`, `next_timeout`, `on_deadline`).

- DropPolicy (`--straggler-timeout S`, the Poseidon paper's BSP with drop): after the first push of
  iteration t reaches a pair, the server waits at most S seconds for the others; then it sums the
  pushes that came, in rank order, scales by 1/(arrived·iter_size) (the mean over the arrived
  count; `--sum-gradients`: their sum), applies the solver rule once and answers EVERY worker,
  the late one included, with the new values. A push for an iteration the pair has left is
  dropped and counted. Every worker receives the same values, so the replicas stay identical.
  When all P1 arrive in time the arithmetic is BSP's, bit for bit.
- StalePolicy (`--staleness s`, the 2015 design's SSP): each push is applied when it arrives
  (gradient scaled by 1/P1 and weight decay by 1/P1, so P1 arrivals add up to one BSP step), and
  the reply to worker r's push of iteration c is held until the slowest worker has pushed
  iteration c - s of that pair. A worker therefore starts iteration c + 1 with parameters that
  miss at most s iterations of the others' updates (its own are always in).
"""
import logging
import time

import numpy

from ..errors import DistError
from ..transport import Msg

log = logging.getLogger("poseidon")


def make_policy(server, options):
    """The policy the book's options ask for, or None for BSP (the unchanged path)."""
    if options.get("straggler_timeout") is not None:
        return DropPolicy(server, float(options["straggler_timeout"]))
    if int(options.get("staleness") or 0) > 0:
        return StalePolicy(server, int(options["staleness"]))
    return None


def _extra(st):
    extra = st.get("extra")
    if extra is None:
        extra = st["extra"] = {}
    return extra


def rank_order_sum(pair, ranks, out=None):
    """The gradients pushed to pair by `ranks` (ascending) summed in that order, into the first
    one's array (the receiver's own frame; a read-only one is copied first), or into `out`, so
    that no pushed array is written (a worker's gradient in shared memory); a single gradient is
    then returned as it is. The pair lets go of all its pushed arrays. BSP (dist/kv/store.py) sums
    every worker, the straggler policy those that arrived: the same order either way, so a full
    arrival is bitwise BSP."""
    grads, pair.grads = pair.grads, [None] * len(pair.grads)
    first, *rest = ranks
    acc = grads[first]
    if out is not None and rest:
        acc = numpy.add(acc, grads[rest.pop(0)], out=out)
    elif out is None and not acc.flags.writeable:
        acc = acc.copy()
    for r in rest:
        acc += grads[r]
    return acc


class _Policy:
    def __init__(self, server):
        if server.handler.name != "update":
            raise DistError(f"the '{server.handler.name}' KV handler works under BSP only")
        self.server = server
        self.workers = server.workers

    def _drop(self, msg, why):
        """A push out of step is dropped like any bad message (the server keeps serving)."""
        self.server.transport.drop(msg, why)

    def _name(self, rank):
        return self.server.roles.name(rank)

    def _count_bytes(self, st, msg):
        st["recv_payload"] += msg.payload_bytes
        st["recv_header"] += msg.header_bytes

    def _send(self, pair, worker, it, st, aux):
        receipt = self.server.transport.send(worker, Msg.KV_VALUE, iteration=it, key=pair.id,
                                             aux=aux, arrays=[pair.value])
        pair.receipts.append(receipt)
        st["sent_payload"] += receipt.payload_bytes
        st["sent_header"] += receipt.header_bytes

    def next_timeout(self):
        return None

    def on_deadline(self):
        pass

    def summary(self):
        return None


class DropPolicy(_Policy):
    """BSP with drop (see the module docstring)."""

    def __init__(self, server, seconds):
        super().__init__(server)
        self.seconds = seconds
        self.deadlines = {}          # pair id -> monotonic time its iteration closes
        self.logged = {}             # iteration -> workers already named in a drop line
        self.dropped = 0             # (pair, iteration) gradients left out
        self.late = 0                # pushes that came after their iteration closed

    def on_init(self, pair):
        self.deadlines.pop(pair.id, None)

    def on_push(self, pair, msg):
        s, r = self.server, msg.sender
        it = pair.iteration
        if msg.iteration < it:                 # its iteration closed without it: drop, count
            self.late += 1
            st = s._stats(it)
            extra = _extra(st)
            extra["late_pushes"] = extra.get("late_pushes", 0) + 1
            return
        if msg.iteration > it:
            return self._drop(msg, f"{self._name(r)} pushed KV pair {pair.id} for iteration "
                                   f"{msg.iteration} but {self._name(s.transport.rank)} expects "
                                   f"iteration {it}")
        if pair.have[r]:
            return self._drop(msg, f"{self._name(r)} pushed KV pair {pair.id} twice in "
                                   f"iteration {it}")
        pair.grads[r] = msg.arrays[0]      # kept as it arrived (see dist/kv/store.py)
        pair.have[r] = True
        pair.count += 1
        self._count_bytes(s._stats(it), msg)
        if pair.count == 1:
            self.deadlines[pair.id] = time.monotonic() + self.seconds
        if pair.count == self.workers:
            self.complete(pair)

    def next_timeout(self):
        if not self.deadlines:
            return None
        return max(0.0, min(self.deadlines.values()) - time.monotonic())

    def on_deadline(self):
        now = time.monotonic()
        if not self.deadlines or min(self.deadlines.values()) > now:
            return
        for pid, deadline in sorted(self.deadlines.items(), key=lambda kv: kv[1]):
            if deadline <= now:
                self.complete(self.server.pairs[pid])

    def complete(self, pair):
        """Sum the arrived pushes in rank order, scale by the arrived count, update, answer all."""
        s = self.server
        self.deadlines.pop(pair.id, None)
        it = pair.iteration
        st = s._stats(it)
        arrived = [r for r in range(self.workers) if pair.have[r]]
        n = len(arrived)
        t0 = time.perf_counter()
        acc = rank_order_sum(pair, arrived)
        s.free_value(pair)                   # replies in flight keep the old buffer
        if n == self.workers or s.book.options.get("sum_gradients"):
            scale = s.grad_scale                 # BSP's own factor: bitwise BSP when all came
        else:
            scale = 1.0 / (n * s.book.data["iter_size"])
        s.rule.update(pair.value, acc, pair.state, it, pair.lr_mult, pair.decay_mult, scale)
        st["update_s"] += time.perf_counter() - t0
        if n < self.workers:
            self._record_drop(pair, it, st, arrived)
        s.answer([pair], it, st, [pair.value], aux=n)

    def _record_drop(self, pair, it, st, arrived):
        s = self.server
        missing = [r for r in range(self.workers) if r not in arrived]
        self.dropped += len(missing)
        extra = _extra(st)
        dropped = extra.setdefault("dropped", {})
        for r in missing:
            dropped[str(r)] = dropped.get(str(r), 0) + 1
        extra["pairs_short"] = extra.get("pairs_short", 0) + 1
        named = self.logged.setdefault(it, set())
        verb = "summed" if s.book.options.get("sum_gradients") else "averaged"
        for r in missing:
            if r not in named:
                named.add(r)
                log.warning(f"{s.roles.short(s.transport.rank)}: iteration {it}: {self._name(r)} "
                            f"(rank {r}) missed the {float(self.seconds)!r} s deadline; {verb} "
                            f"{len(arrived)} of {self.workers} gradients")
        for old in [k for k in self.logged if k < it - 2]:
            del self.logged[old]

    def summary(self):
        return (f"--straggler-timeout {float(self.seconds)!r} s: {self.dropped} KV-pair "
                f"gradient(s) left out, {self.late} late push(es) dropped")


class StalePolicy(_Policy):
    """Bounded staleness, SSP (see the module docstring)."""

    def __init__(self, server, staleness):
        super().__init__(server)
        self.staleness = staleness
        self.pushed = {}             # pair id -> last iteration each worker pushed
        self.held = {}               # pair id -> [(worker, iteration)] replies not yet sent
        self.max_lead = 0
        self.held_replies = 0

    def on_init(self, pair):
        self.pushed[pair.id] = [pair.iteration - 1] * self.workers
        self.held[pair.id] = []

    def on_push(self, pair, msg):
        s, r, c = self.server, msg.sender, msg.iteration
        pushed = self.pushed[pair.id]
        if c != pushed[r] + 1:
            return self._drop(msg, f"{self._name(r)} pushed KV pair {pair.id} for iteration {c} "
                                   f"but its last push was for iteration {pushed[r]}")
        grad = msg.arrays[0]
        st = s._stats(c)
        self._count_bytes(st, msg)
        t0 = time.perf_counter()
        acc = s.scratch(pair.length)
        numpy.copyto(acc, grad)
        s.free_value(pair)                   # replies in flight keep the old buffer
        s.rule.update(pair.value, acc, pair.state, c, pair.lr_mult,
                      pair.decay_mult / self.workers, s.grad_scale)
        st["update_s"] += time.perf_counter() - t0
        pushed[r] = c
        self.held[pair.id].append((r, c))
        self._release(pair)
        if (r, c) in self.held[pair.id]:     # r is more than `staleness` ahead: it waits
            self.held_replies += 1
            extra = _extra(st)
            extra["held_replies"] = extra.get("held_replies", 0) + 1

    def _release(self, pair):
        """Send every held reply whose iteration is within `staleness` of the slowest push."""
        s = self.server
        slowest = min(self.pushed[pair.id])
        keep = []
        for w, c in self.held[pair.id]:
            if c - self.staleness > slowest:
                keep.append((w, c))
                continue
            lead = c - slowest
            st = s._stats(c)
            extra = _extra(st)
            extra["max_lead"] = max(extra.get("max_lead", 0), lead)
            if w != self.pushed[pair.id].index(slowest) and lead > 0 and (w, c) != (w, slowest):
                pass
            self.max_lead = max(self.max_lead, lead)
            self._send(pair, w, c, st, aux=lead)
            st["replies"] = st.get("replies", 0) + 1
            if st["replies"] == self.workers * len(s.pairs):
                s._flush_stats(c)
        self.held[pair.id] = keep

    def summary(self):
        return (f"--staleness {self.staleness}: a worker ran at most {self.max_lead} "
                f"iteration(s) ahead of the slowest; {self.held_replies} repl(ies) held")
