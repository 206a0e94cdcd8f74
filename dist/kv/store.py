"""The KV store: a server process holding a slice of the parameters and their solver state.

Why it is built this way (the paper's KV store, made exact):
- Pairs of at most 2 MB placed by greedy LPT (dist/coord/placement.py), so bytes per server are even.
- Bulk synchronous: a pair keeps each worker's pushed gradient of the iteration; when all P1 have
  come it sums them IN RANK ORDER (not arrival order), so the result does not depend on timing and a
  resumed run is bitwise equal to an uninterrupted one; then it scales by 1/P1 (the mean: what one
  process computes on the combined batch; `--sum-gradients` keeps the paper's sum) and applies the
  solver's own update rule (engine.solvers.rules: learning-rate policy at the iteration the
  workers send, momentum and the other state kept per pair, lr_mult/decay_mult of the parameter).
  The rule is elementwise, so a slice updated here equals the same slice updated by one process.
- A push's array is kept as it arrived, not copied into a slot: over TCP ZeroMQ hands this process
  a buffer of its own (decrypted, under CURVE), so the rank-order sum goes into the first worker's
  array in place. That is one copy of every pair per worker and iteration less (the KV store is
  CPU-bound under CURVE on few cores), and the server holds no P1 copies of its slice.
- It answers every worker with the new values (push and pull of a pair are one round trip).
- A layer's pairs on this server come in one message (a bundle, dist/coord/placement.bundle_pairs) and
  go back in one: all its pairs complete together, since they are only ever pushed together.
- INIT sets values (and history, on resume) from worker 0; GET returns values and history for
  snapshots. What happens when a pair is complete is a pluggable handler: `update` (the default
  above) or `average` (reply with the mean gradient, for schemes that update on the workers).
- `--straggler-timeout` and `--staleness` relax BSP through a policy (dist/coord/consistency.py) that
  takes over pushes; with neither, `self.policy` is None and the path above is untouched.
- On one host (`--ipc auto`, BSP, the update handler) the values live in the server's shared
  memory (dist/transport/onehost/kvshm.py) beside a gradient region per worker: a worker that
  mapped it pushes a header alone, its gradient already in its region, and is answered with a
  header alone, the values updated in place. Others push and are answered with arrays, as
  before; one pair may have both kinds of worker.
"""
import json
import threading
import time

import numpy

from ..coord.consistency import make_policy, rank_order_sum
from ..errors import DistError
from ..transport import Msg, at_priority
from ..transport.onehost import kvshm


class PairState:
    __slots__ = ("id", "param", "offset", "length", "value", "state", "lr_mult", "decay_mult",
                 "grads", "have", "count", "iteration", "receipts", "shared")

    def __init__(self, rec, param, workers, dtype, rule):
        self.id, self.param = rec.id, rec.param
        self.offset, self.length = rec.offset, rec.length
        self.value = numpy.zeros(self.length, dtype)
        self.state = rule.init_state((self.length,), numpy, dtype)
        self.lr_mult, self.decay_mult = param.lr_mult, param.decay_mult
        self.grads = [None] * workers         # each worker's pushed array of the iteration
        self.have = [False] * workers
        self.count = 0
        self.iteration = None
        self.receipts = []
        self.shared = [False] * workers       # whether each worker's push came in shared memory


class UpdateHandler:
    """Sum in rank order, scale, apply the solver rule, reply with the new values."""

    name = "update"

    def __init__(self, server):
        self.server = server

    def complete(self, pair, it):
        s = self.server
        acc, live = s.gradient_sum(pair)     # the rule takes it as scratch unless it is live
        s.free_value(pair)                   # the last reply's frames may still be in flight
        s.rule.update(pair.value, acc, pair.state, it, pair.lr_mult, pair.decay_mult,
                      s.grad_scale, keep_grad=live)
        return pair.value


class AverageHandler:
    """Sum in rank order and scale; reply with the combined gradient (workers update locally)."""

    name = "average"

    def __init__(self, server):
        self.server = server

    def complete(self, pair, it):
        s = self.server
        out = rank_order_sum(pair, range(s.workers))
        out *= out.dtype.type(s.grad_scale)
        return out


HANDLERS = {"update": UpdateHandler, "average": AverageHandler}


class KVServer:
    """One server rank: serves its pairs until worker 0 sends SHUTDOWN (or the job aborts)."""

    MESSAGES = (Msg.KV_INIT, Msg.KV_INIT_DONE, Msg.KV_PUSH, Msg.KV_GET, Msg.KV_SHUTDOWN)

    def __init__(self, transport, book, roles, rule, stats_path=None, handler="update", log=None,
                 memory=None):
        self.transport = transport
        self.book = book
        self.roles = roles
        self.rule = rule
        self.workers = roles.workers
        self.index = roles.index(transport.rank)
        self.dtype = numpy.dtype(book.data["dtype"])
        self.grad_scale = book.data["grad_scale"]
        self.log = log or (lambda line: None)
        params = {p.id: p for p in book.params}
        self.pairs = {rec.id: PairState(rec, params[rec.param], self.workers, self.dtype, rule)
                      for rec in book.pairs_on_server(self.index)}
        self.bundles = {b.id: [self.pairs[k] for k in b.pairs]
                        for b in book.bundles_on_server(self.index)}
        self.handler = HANDLERS[handler](self)
        # an answer goes out at the priority of the sync it answers (transport/scheduler.py)
        self.priority = {b.id: b.layer for b in book.bundles_on_server(self.index)}
        self.policy = make_policy(self, book.options)
        self.segment = None                   # kvshm.Segment: values and gradients, shared
        if memory is not None and self.policy is None and self.handler.name == "update":
            self.segment = memory.allocate(kvshm.Layout(book, self.index, self.workers))
        self._shared_grads = {}                # (worker, message id) -> its region's views
        if self.segment is not None:
            for pair in self.pairs.values():
                pair.value = self.segment.values(pair.id)
            self._shared_grads = {(w, key): [self.segment.grads(w, pair.id) for pair in pairs]
                                  for w in range(self.workers)
                                  for key, pairs in self.bundles.items()}
        self._scratch = None
        self.stats_path = stats_path
        self._stats_file = open(stats_path, "w", encoding="utf-8") if stats_path else None
        self._iter_stats = {}
        self.running = True
        self._lock = threading.Lock()         # the receive thread serves, this one keeps the clock
        self._wake = threading.Event()
        self._handlers = {}
        self._suspects = {}                 # (pair, worker) -> (since, why): see _bad_push
        self.report_after = getattr(transport, "timeout", 30.0) / 2
        transport.set_fifo(self.MESSAGES)

    def scratch(self, n):
        if self._scratch is None or self._scratch.size < n:
            self._scratch = numpy.empty(n, self.dtype)
        return self._scratch[:n]

    def gradient_sum(self, pair):
        """The pair's pushed gradients summed in rank order, and whether the result is a
        worker's live buffer. A gradient in shared memory may be the worker's diff itself
        (dist/worker/replicas.py places parameters there), so it is never written: with one worker it is
        the sum as it is, which the rule must keep; with several the sum goes into scratch."""
        if not any(pair.shared):
            return rank_order_sum(pair, range(self.workers)), False
        return (rank_order_sum(pair, range(self.workers), out=self.scratch(pair.length)),
                self.workers == 1)

    def free_value(self, pair):
        """Make pair.value safe to overwrite in place, without waiting: when a reply that reads it
        is still queued (a slow, stopped or lost worker has not taken it), the pair goes on in a
        copy and the queued reply keeps the old buffer until ZeroMQ lets it go.

        Why never wait: this runs on the receive thread under the server's lock, and a wait for
        a worker that does not read (SIGSTOP, a dead host) would stop the heartbeats, the ABORT
        handling and every other worker's answers with it. Values in shared memory are never
        copied away (the workers read them there); their replies carry copies instead (replies)."""
        if pair.receipts and not all(r.done() for r in pair.receipts):
            pair.value = pair.value.copy()
        pair.receipts = []

    def reply_arrays(self, outs):
        """The arrays a reply to a worker without the shared memory sends, and whether their
        receipts must be kept: values in shared memory go as copies (see free_value)."""
        if self.segment is not None:
            return [numpy.array(o) for o in outs], False
        return outs, True

    def bytes_held(self):
        return sum(p.length for p in self.pairs.values()) * self.dtype.itemsize

    # ----- the loop --------------------------------------------------------------------------------
    def run(self):
        """Serve until SHUTDOWN (or the job aborts).

        The messages are served on the transport's receive thread (handlers), not handed to this
        thread through the mailbox: the hand-off (file, wake this thread, take) cost more CPU than
        serving most pushes. This thread keeps the clock: the disagreement and straggler deadlines,
        and the job's errors. One lock keeps the two threads' work on the pairs apart; messages
        queued before the handlers were set are served first, in arrival order."""
        self._handlers = {Msg.KV_INIT: self.on_init, Msg.KV_INIT_DONE: self.on_init_done,
                          Msg.KV_PUSH: self.on_push, Msg.KV_GET: self.on_get,
                          Msg.KV_SHUTDOWN: self.on_shutdown}
        t = self.transport
        t.on_abort.append(lambda error: self._wake.set())
        try:
            with self._lock:
                for mtype in self.MESSAGES:
                    t.handle(mtype, self._on_message)
            while self.running:
                self._wake.clear()
                with self._lock:
                    self._serve_queued()
                    self._keep_deadlines()
                    due = self._wait()
                if t.error is not None:
                    raise t.error
                if self.running:
                    self._wake.wait(due)
            if t.error is not None:
                raise t.error
        finally:
            if self._stats_file:
                self._stats_file.close()

    def _on_message(self, msg):
        """On the receive thread: serve msg (after anything queued before the handlers were set)."""
        with self._lock:
            if not self.running:
                return
            self._serve_queued()
            self._serve(msg)
            self._keep_deadlines()
            if self.policy is not None:
                self._wake.set()              # its next deadline may be earlier now
        if not self.running:
            self._wake.set()

    def _keep_deadlines(self):
        """Stop the job on a disagreement past its grace; let the straggler policy act on its
        deadlines (both threads call this after serving, under the lock)."""
        self._check_disagreements()
        if self.policy is not None:
            self.policy.on_deadline()

    def _serve_queued(self):
        while self.running:
            msg = self.transport.next(timeout=0)
            if msg is None:
                return
            self._serve(msg)

    def _serve(self, msg):
        handler = self._handlers.get(msg.type)
        if handler is None:
            self.transport.drop(msg, f"{msg.type.name} is not a message a server takes")
        else:
            handler(msg)

    def _wait(self):
        """How long the loop may block: a second under BSP (to look at suspected disagreements),
        less when the straggler policy has an earlier deadline."""
        due = None if self.policy is None else self.policy.next_timeout()
        return 1.0 if due is None else min(1.0, due)

    # ----- validation: a bad message is dropped (logged, counted); the server keeps serving ------
    def _pair(self, msg):
        """The pair msg names, or None after dropping msg (a key this server does not hold)."""
        pair = self.pairs.get(msg.key)
        if pair is None:
            self.transport.drop(msg, f"{msg.type.name} for KV pair {msg.key}, which the book "
                                     f"does not place on {self.roles.name(self.transport.rank)}")
        return pair

    def _bundle(self, msg):
        """The pairs of the message msg names (its first pair's id), or None after dropping msg."""
        pairs = self.bundles.get(msg.key)
        if pairs is None:
            where = ("is not the first pair of a message" if msg.key in self.pairs else
                     f"the book does not place on {self.roles.name(self.transport.rank)}")
            self.transport.drop(msg, f"{msg.type.name} for KV pair {msg.key}, which {where}")
        return pairs

    def _bad_arrays(self, msg, pair, arrays):
        """Why arrays cannot be values of pair (dtype, shape), or None."""
        for i, a in enumerate(arrays):
            if a.dtype != self.dtype or a.shape != (pair.length,):
                return (f"{msg.type.name} of KV pair {pair.id} from {self.roles.name(msg.sender)}: "
                        f"array {i} is {a.dtype.name}{list(a.shape)}, the pair is "
                        f"{self.dtype.name}[{pair.length}]")
        return None

    def _pushed_arrays(self, msg, pairs):
        """The gradients a push brings: its arrays, or for a push in shared memory the views of
        the sender's region (None when this server has no shared memory or no such worker)."""
        if not msg.shared:
            return msg.arrays
        return self._shared_grads.get((msg.sender, pairs[0].id))

    def _bad_push(self, msg, pairs, arrays):
        """Why a push cannot be taken now, or None (it is taken or dropped whole). A push of the
        pairs' current iteration from a worker that has not pushed them yet, with a wrong shape or
        dtype, is remembered: if that worker sends nothing valid for the pair within half of
        --timeout, the ranks really disagree and the server stops the job naming both."""
        r = msg.sender
        first = pairs[0]
        if not 0 <= r < self.workers:
            return f"KV_PUSH of KV pair {first.id} from {self.roles.name(r)}, which is not a worker"
        if arrays is None:
            return (f"KV_PUSH of KV pair {first.id} from {self.roles.name(r)} says its gradient "
                    f"is in shared memory, but {self.roles.name(self.transport.rank)} offers none")
        if len(arrays) != len(pairs):
            return (f"KV_PUSH of KV pair {first.id} from {self.roles.name(r)} carries "
                    f"{len(arrays)} arrays, its message holds {len(pairs)} pairs in the book")
        if first.iteration is None:
            return (f"{self.roles.name(r)} pushed KV pair {first.id} before worker 0 initialised "
                    f"the servers")
        if self.policy is None and msg.iteration != first.iteration:
            return (f"{self.roles.name(r)} pushed KV pair {first.id} for iteration "
                    f"{msg.iteration}, the pair is at iteration {first.iteration}")
        if self.policy is None and first.have[r]:
            return f"{self.roles.name(r)} pushed KV pair {first.id} twice in iteration {msg.iteration}"
        for pair, array in zip(pairs, () if msg.shared else arrays):   # views of the layout
            bad = self._bad_arrays(msg, pair, [array])                  # fit by construction
            if bad is not None:
                others = [w for w in range(self.workers) if pair.have[w]]
                ref = (f"{self.roles.name(others[0])} pushed {self.dtype.name}[{pair.length}]"
                       if others else
                       f"the book (worker 0's net) says {self.dtype.name}[{pair.length}]")
                other = self.roles.name(others[0]) if others else "worker 0's net"
                self._suspects.setdefault((pair.id, r), (time.monotonic(), f"{bad}; {ref}",
                                                         pair.iteration, other))
                return bad
        return None

    def _check_disagreements(self):
        if not self._suspects:
            return
        now = time.monotonic()
        for (pid, r), (since, why, it, other) in list(self._suspects.items()):
            pair = self.pairs[pid]
            if pair.have[r] or pair.iteration != it:
                del self._suspects[(pid, r)]
            elif now - since > self.report_after:
                param = self.book.params[pair.param].name
                raise DistError(f"{self.roles.name(r)} and {other} disagree about KV pair {pid} "
                                f"(parameter '{param}'): {why}; nothing valid came "
                                f"from {self.roles.name(r)} for {self.report_after:g} s "
                                f"(do all ranks run the same net and --dtype?)")

    # ----- handlers --------------------------------------------------------------------------------
    def on_init(self, msg):
        pair = self._pair(msg)
        if pair is None:
            return
        values = msg.arrays
        bad = (self._bad_arrays(msg, pair, values) or
               (f"INIT of KV pair {pair.id} carries {len(values) - 1} history arrays, the rule "
                f"keeps {len(pair.state)}" if len(values) - 1 > len(pair.state) else None) or
               (f"INIT of KV pair {pair.id} for iteration {msg.iteration}"
                if msg.iteration < 0 else None))
        if bad is not None:
            return self.transport.drop(msg, bad)
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
        pair.grads = [None] * self.workers
        if self.policy is not None:
            self.policy.on_init(pair)

    def on_init_done(self, msg):
        missing = [p.id for p in self.pairs.values() if p.iteration is None]
        if missing:
            return self.transport.drop(msg, f"INIT_DONE from {self.roles.name(msg.sender)} but "
                                            f"pairs {missing[:5]} were not initialised")
        self.transport.send(msg.sender, Msg.KV_INIT_ACK, iteration=msg.iteration, key=self.index)

    def on_push(self, msg):
        pairs = self._bundle(msg)
        if pairs is None:
            return
        arrays = self._pushed_arrays(msg, pairs)
        bad = self._bad_push(msg, pairs, arrays)
        if bad is not None:
            return self.transport.drop(msg, bad)
        r = msg.sender
        if self.policy is not None:          # relaxed consistency: one pair per message (book)
            return self.policy.on_push(pairs[0], msg)
        for pair, array in zip(pairs, arrays):
            self._suspects.pop((pair.id, r), None)
            pair.grads[r] = array
            pair.have[r] = True
            pair.shared[r] = msg.shared
            pair.count += 1
        st = self._stats(msg.iteration)
        st["recv_payload"] += (msg.payload_bytes if not msg.shared else
                               sum(a.nbytes for a in arrays))
        st["recv_header"] += msg.header_bytes
        if pairs[0].count < self.workers:     # a message's pairs are pushed, so complete, together
            return
        t0 = time.perf_counter()
        it = pairs[0].iteration
        outs = [self.handler.complete(pair, it) for pair in pairs]
        st["update_s"] += time.perf_counter() - t0
        self.answer(pairs, it, st, outs)

    def answer(self, pairs, it, st, outs, aux=0):
        """Send every worker the results of iteration it of one message's pairs, in one message,
        and open their next iteration (BSP here, and the straggler policy once its deadline has
        passed). Each pair keeps the receipts: its value is not overwritten while they are in flight
        (free_value)."""
        with at_priority(self.priority.get(pairs[0].id)):
            receipts = self._send_answers(pairs, it, st, outs, aux)
        for pair in pairs:
            pair.receipts = receipts
            pair.count = 0
            pair.have = [False] * self.workers
            pair.shared = [False] * self.workers
            pair.iteration = it + 1
        st["pairs_done"] += len(pairs)
        if st["pairs_done"] == len(self.pairs) or (self.book.measured and not any(
                p.iteration == it for p in self.pairs.values())):
            self._flush_stats(it)      # (measured cost model: pairs of layers now off PS idle)

    def _send_answers(self, pairs, it, st, outs, aux):
        """The answer to every worker; the receipts that keep the pairs' values in flight."""
        receipts = []
        shared = pairs[0].shared
        copies = None
        for w in range(self.workers):
            if shared[w]:                     # the values are in place in the shared memory
                receipt = self.transport.send(w, Msg.KV_VALUE, iteration=it, key=pairs[0].id,
                                              aux=aux, shared=True)
                st["sent_payload"] += sum(a.nbytes for a in outs)
            else:
                if copies is None:
                    copies, keep = self.reply_arrays(outs)
                receipt = self.transport.send(w, Msg.KV_VALUE, iteration=it, key=pairs[0].id,
                                              aux=aux, arrays=copies)
                if keep:
                    receipts.append(receipt)
                st["sent_payload"] += receipt.payload_bytes
            st["sent_header"] += receipt.header_bytes
        return receipts

    def on_get(self, msg):
        pair = self._pair(msg)
        if pair is None:
            return
        self.transport.send(msg.sender, Msg.KV_GET_REPLY, iteration=msg.iteration, key=pair.id,
                            arrays=[pair.value.copy()] + [s.copy() for s in pair.state])

    def on_shutdown(self, msg):
        self.running = False
        summary = self.policy.summary() if self.policy is not None else None
        if summary:
            self.log(f"{self.roles.name(self.transport.rank)}: {summary}")

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
            record.update(st.get("extra") or {})
            self._stats_file.write(json.dumps(record) + "\n")
            self._stats_file.flush()
