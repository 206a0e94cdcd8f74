"""The KV store: a server process holding a slice of the parameters and their solver state.

Why it is built this way (the paper's KV store, made exact):
- Pairs of at most 2 MB placed by greedy LPT (dist/placement.py), so bytes per server are even.
- Bulk synchronous: a pair keeps one slot per worker; when all P1 slots of an iteration are full it
  sums them IN RANK ORDER (not arrival order), so the result does not depend on timing and a
  resumed run is bitwise equal to an uninterrupted one; then it scales by 1/P1 (the mean: what one
  process computes on the combined batch; `--sum-gradients` keeps the paper's sum) and applies the
  solver's own update rule (engine.solvers.rules: learning-rate policy at the iteration the
  workers send, momentum and the other state kept per pair, lr_mult/decay_mult of the parameter).
  The rule is elementwise, so a slice updated here equals the same slice updated by one process.
- It answers every worker with the new values (push and pull of a pair are one round trip).
- INIT sets values (and history, on resume) from worker 0; GET returns values and history for
  snapshots. What happens when a pair is complete is a pluggable handler: `update` (the default
  above) or `average` (reply with the mean gradient, for schemes that update on the workers).
"""
import json
import time

import numpy

from .errors import DistError
from .transport import Msg


class PairState:
    __slots__ = ("id", "param", "offset", "length", "value", "state", "lr_mult", "decay_mult",
                 "slots", "have", "count", "iteration", "receipts")

    def __init__(self, rec, param, workers, dtype, rule):
        self.id, self.param = rec["id"], rec["param"]
        self.offset, self.length = rec["offset"], rec["length"]
        self.value = numpy.zeros(self.length, dtype)
        self.state = rule.init_state((self.length,), numpy, dtype)
        self.lr_mult, self.decay_mult = param["lr_mult"], param["decay_mult"]
        self.slots = numpy.zeros((workers, self.length), dtype)
        self.have = [False] * workers
        self.count = 0
        self.iteration = None
        self.receipts = []


class UpdateHandler:
    """Sum in rank order, scale, apply the solver rule, reply with the new values."""

    name = "update"

    def __init__(self, server):
        self.server = server

    def complete(self, pair, it):
        s = self.server
        acc = pair.slots[0]                  # summed in place: every slot is refilled next time
        for r in range(1, s.workers):
            acc += pair.slots[r]
        for receipt in pair.receipts:        # the last reply's frames may still be in flight
            receipt.wait()
        s.rule.update(pair.value, acc, pair.state, it, pair.lr_mult, pair.decay_mult,
                      s.grad_scale)
        return pair.value


class AverageHandler:
    """Sum in rank order and scale; reply with the combined gradient (workers update locally)."""

    name = "average"

    def __init__(self, server):
        self.server = server

    def complete(self, pair, it):
        s = self.server
        out = numpy.array(pair.slots[0])
        for r in range(1, s.workers):
            out += pair.slots[r]
        out *= out.dtype.type(s.grad_scale)
        return out


HANDLERS = {"update": UpdateHandler, "average": AverageHandler}


class KVServer:
    """One server rank: serves its pairs until worker 0 sends SHUTDOWN (or the job aborts)."""

    MESSAGES = (Msg.KV_INIT, Msg.KV_INIT_DONE, Msg.KV_PUSH, Msg.KV_GET, Msg.KV_SHUTDOWN)

    def __init__(self, transport, book, roles, rule, stats_path=None, handler="update", log=None):
        self.transport = transport
        self.book = book
        self.roles = roles
        self.rule = rule
        self.workers = roles.workers
        self.index = roles.index(transport.rank)
        self.dtype = numpy.dtype(book.data["dtype"])
        self.grad_scale = book.data["grad_scale"]
        self.log = log or (lambda line: None)
        params = {p["id"]: p for p in book.params}
        self.pairs = {rec["id"]: PairState(rec, params[rec["param"]], self.workers, self.dtype, rule)
                      for rec in book.pairs_on_server(self.index)}
        self.handler = HANDLERS[handler](self)
        self._scratch = None
        self.stats_path = stats_path
        self._stats_file = open(stats_path, "w", encoding="utf-8") if stats_path else None
        self._iter_stats = {}
        self.running = True
        transport.set_fifo(self.MESSAGES)

    def scratch(self, n):
        if self._scratch is None or self._scratch.size < n:
            self._scratch = numpy.empty(n, self.dtype)
        return self._scratch[:n]

    def bytes_held(self):
        return sum(p.length for p in self.pairs.values()) * self.dtype.itemsize

    # ----- the loop --------------------------------------------------------------------------------
    def run(self):
        handlers = {Msg.KV_INIT: self.on_init, Msg.KV_INIT_DONE: self.on_init_done,
                    Msg.KV_PUSH: self.on_push, Msg.KV_GET: self.on_get,
                    Msg.KV_SHUTDOWN: self.on_shutdown}
        try:
            while self.running:
                msg = self.transport.next(timeout=None)
                handlers[msg.type](msg)
        finally:
            if self._stats_file:
                self._stats_file.close()

    def _pair(self, msg):
        try:
            return self.pairs[msg.key]
        except KeyError:
            raise DistError(f"{self.roles.name(self.transport.rank)} got KV pair {msg.key} from "
                            f"{self.roles.name(msg.sender)}, but the book places it elsewhere: "
                            f"the processes disagree about the placement") from None

    def on_init(self, msg):
        pair = self._pair(msg)
        values = msg.arrays
        if values[0].size != pair.length:
            raise DistError(f"INIT of KV pair {pair.id} carries {values[0].size} values, the "
                            f"pair holds {pair.length}")
        numpy.copyto(pair.value, values[0])
        history = values[1:]
        for k, state in enumerate(pair.state):
            if k < len(history):
                numpy.copyto(state, history[k])
            else:
                state[...] = 0
        pair.iteration = msg.iteration
        pair.count = 0
        pair.have = [False] * self.workers

    def on_init_done(self, msg):
        missing = [p.id for p in self.pairs.values() if p.iteration is None]
        if missing:
            raise DistError(f"{self.roles.name(self.transport.rank)}: worker 0 finished INIT but "
                            f"pairs {missing[:5]} were not initialised")
        self.transport.send(msg.sender, Msg.KV_INIT_ACK, iteration=msg.iteration, key=self.index)

    def on_push(self, msg):
        pair = self._pair(msg)
        r = msg.sender
        if pair.iteration is None:
            raise DistError(f"{self.roles.name(r)} pushed KV pair {pair.id} before worker 0 "
                            f"initialised the servers")
        if msg.iteration != pair.iteration:
            raise DistError(f"{self.roles.name(r)} pushed KV pair {pair.id} for iteration "
                            f"{msg.iteration} but {self.roles.name(self.transport.rank)} expects "
                            f"iteration {pair.iteration}: the workers are not in step")
        if pair.have[r]:
            raise DistError(f"{self.roles.name(r)} pushed KV pair {pair.id} twice in iteration "
                            f"{msg.iteration}")
        grad = msg.arrays[0]
        if grad.size != pair.length:
            raise DistError(f"{self.roles.name(r)} pushed {grad.size} values for KV pair "
                            f"{pair.id}, which holds {pair.length}")
        numpy.copyto(pair.slots[r], grad)
        pair.have[r] = True
        pair.count += 1
        st = self._stats(msg.iteration)
        st["recv_payload"] += msg.payload_bytes
        st["recv_header"] += msg.header_bytes
        if pair.count < self.workers:
            return
        t0 = time.perf_counter()
        it = pair.iteration
        out = self.handler.complete(pair, it)
        st["update_s"] += time.perf_counter() - t0
        pair.receipts = []
        for w in range(self.workers):
            receipt = self.transport.send(w, Msg.KV_VALUE, iteration=it, key=pair.id, arrays=[out])
            pair.receipts.append(receipt)
            st["sent_payload"] += receipt.payload_bytes
            st["sent_header"] += receipt.header_bytes
        pair.count = 0
        pair.have = [False] * self.workers
        pair.iteration = it + 1
        st["pairs_done"] += 1
        if st["pairs_done"] == len(self.pairs):
            self._flush_stats(it)

    def on_get(self, msg):
        pair = self._pair(msg)
        for receipt in pair.receipts:
            receipt.wait()
        self.transport.send(msg.sender, Msg.KV_GET_REPLY, iteration=msg.iteration, key=pair.id,
                            arrays=[pair.value.copy()] + [s.copy() for s in pair.state])

    def on_shutdown(self, msg):
        self.running = False

    # ----- statistics --------------------------------------------------------------------------------
    def _stats(self, it):
        st = self._iter_stats.get(it)
        if st is None:
            st = self._iter_stats[it] = {"recv_payload": 0, "recv_header": 0, "sent_payload": 0,
                                         "sent_header": 0, "update_s": 0.0, "pairs_done": 0,
                                         "start": time.time()}
        return st

    def _flush_stats(self, it):
        st = self._iter_stats.pop(it)
        if self._stats_file:
            record = {"iter": it, "role": "server", "rank": self.transport.rank,
                      "server": self.index, "pairs": len(self.pairs),
                      "bytes_held": self.bytes_held(), "time": time.time(),
                      "recv_payload": st["recv_payload"], "recv_header": st["recv_header"],
                      "sent_payload": st["sent_payload"], "sent_header": st["sent_header"],
                      "update_s": round(st["update_s"], 6)}
            self._stats_file.write(json.dumps(record) + "\n")
            self._stats_file.flush()
