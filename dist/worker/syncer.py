"""One Syncer per layer with parameters: Move, Send, Receive, Move back (Algorithm 2's sync(l)).
With --bucket-bytes, one Syncer serves a bucket of small PS layers, started after the lowest.

Why: the worker's hooks only know "after layer l's backward, run syncers[l].sync(it) on the pool";
everything scheme-specific (what is moved, to whom, how the update is made) lives in a Scheme
object (dist/schemes/) that the syncer picks each iteration from the book's BestScheme(l). Adding a
scheme touches neither this file nor the worker. A syncer and its schemes reach the worker only
through a SyncContext: what one layer's sync may read and use, and nothing of the loop.

Moves: on the CPU the parameter and factor arrays are already host memory, so "Move" hands out
views (no copy) and the frames go zero-copy from them. On a GPU, Move copies into pinned host buffers
that are allocated once and reused, on a CUDA stream taken from a pool for the duration of the
sync, so device-host copies of different layers run concurrently with the backward of lower layers.

Counters: every sync returns a LayerStats with the scheme, payload and header bytes sent and
received, and the time it took, which the worker writes per iteration (--stats) and draws in the
timeline (--timeline).
"""
import queue
import threading
import time

import numpy

from poseidon.engine import backend

from ..transport import at_priority


class LayerStats:
    __slots__ = ("layer", "name", "scheme", "sent_payload", "recv_payload", "sent_header",
                 "recv_header", "messages_sent", "messages_received", "start", "end", "thread",
                 "reply_aux")

    def __init__(self, layer, name, scheme):
        self.layer, self.name, self.scheme = layer, name, scheme
        self.reply_aux = []          # the servers' note on each reply (arrived count, or lead)
        self.sent_payload = self.recv_payload = self.sent_header = self.recv_header = 0
        self.messages_sent = self.messages_received = 0
        self.start = self.end = 0.0
        self.thread = threading.current_thread().name

    def sent(self, receipt):
        self.sent_payload += receipt.payload_bytes
        self.sent_header += receipt.header_bytes
        self.messages_sent += 1

    def received(self, msg):
        self.recv_payload += msg.payload_bytes
        self.recv_header += msg.header_bytes
        self.messages_received += 1

    @property
    def seconds(self):
        return self.end - self.start

    def as_dict(self):
        return {"layer": self.layer, "scheme": self.scheme, "sent_payload": self.sent_payload,
                "recv_payload": self.recv_payload, "sent_header": self.sent_header,
                "recv_header": self.recv_header, "messages_sent": self.messages_sent,
                "messages_received": self.messages_received, "sync_s": round(self.seconds, 6)}


class StreamPool:
    """CUDA streams handed to syncs for their moves (no-op streams on the CPU)."""

    def __init__(self, size):
        self._free = queue.SimpleQueue()
        for _ in range(max(1, size)):
            self._free.put(backend.new_stream())

    def acquire(self):
        return self._free.get()

    def release(self, stream):
        self._free.put(stream)


class Stage:
    """Host staging of one syncer: views on the CPU, reused pinned buffers on a GPU."""

    def __init__(self, xp):
        self.on_gpu = xp is not numpy
        self._buffers = {}
        self.stream = None

    def buffer(self, key, shape, dtype):
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype:
            buf = self._buffers[key] = backend.pinned_empty(tuple(shape), dtype)
        return buf

    def to_host(self, array, key):
        """A host array with array's content (the array itself on the CPU). Call synchronize()
        before reading it on a GPU."""
        if not self.on_gpu:
            return array
        buf = self.buffer(key, array.shape, array.dtype)
        array.get(stream=self.stream, out=buf)
        return buf

    def to_device(self, host, dest):
        """Copy host values into the device (or host) array dest."""
        if not self.on_gpu:
            if host is not dest:
                numpy.copyto(dest, host.reshape(dest.shape))
            return
        dest.set(host.reshape(dest.shape), stream=self.stream)

    def device_array(self, host, xp):
        """host -> an array on the net's module (the same object on the CPU)."""
        if not self.on_gpu:
            return host
        out = xp.empty(host.shape, host.dtype)
        out.set(host, stream=self.stream)
        return out

    def synchronize(self):
        if self.stream is not None:
            self.stream.synchronize()


class SyncContext:
    """What a sync may use of its worker: the replica (net, rule, history, grad_scale), the job
    (name, rank, roles, book), the wire (transport, kv: the KV client), the CUDA streams, the
    parameters kept in a server's shared memory (`placed`), and the verdicts on NaN/Inf.
    factors(li, layer): a layer's sufficient factors for the worker as a whole (with several
    replicas, theirs stacked: engine/replicas.py); None: the net's own."""

    def __init__(self, *, name, rank, roles, book, net, rule, history, grad_scale, transport, kv,
                 streams, placed, verdicts, factors=None):
        self.name, self.rank, self.roles, self.book = name, rank, roles, book
        self.net, self.rule, self.history, self.grad_scale = net, rule, history, grad_scale
        self.transport, self.kv, self.streams = transport, kv, streams
        self.placed, self.verdicts = placed, verdicts
        self.factors = factors or (lambda li, layer: layer.sufficient_factors(
            net.bottom_vecs[li], net.top_vecs[li]))


class Syncer:
    """Synchronises the parameters of one layer, with the scheme the book picks each iteration."""

    def __init__(self, ctx, li):
        from ..schemes import make_scheme
        self.ctx = ctx
        self.li = li
        book = ctx.book
        self.rec = book.layer(li)
        self.members = book.group_members(li)      # li, or its bucket in backward order
        self.name = "+".join(book.layer(m).name for m in self.members)
        self.layer = ctx.net.layers[li]
        self.pids = [p for m in self.members for p in book.layer(m).params]
        # on the wire, the sync goes at its lowest layer's priority (a bucket's lowest member
        # too): lower layers are needed first by the next forward (transport/scheduler.py)
        self.priority = min(self.members)
        self.stage = Stage(ctx.net.xp)
        self._make = make_scheme
        self._schemes = {}
        self._plan = (None, None)                     # (iteration, scheme) fixed by prepare()
        self.spin = 0.0          # seconds its wait for answers may spin (dist/worker/hooks.spin_seconds)

    def scheme(self, name):
        s = self._schemes.get(name)
        if s is None:
            s = self._schemes[name] = self._make(name, self)
        return s

    def prepare(self, it):
        """Before the backward of iteration it: fix its scheme (once per iteration). Returns whether
        the scheme makes the layer's weight gradient from its sufficient factors (the layer's own
        backward must then leave it alone)."""
        if self._plan[0] != it:
            self._plan = (it, self.ctx.book.best_scheme(self.li, it))   # per layer, iteration
        return self.scheme(self._plan[1]).factored

    def sync(self, it, ready=None):
        """Algorithm 2's SYNC(l): stream, Move, BestScheme, Send, Receive, Move back. `ready`: the
        event after layer l's backward (GPU), which the moves wait for."""
        ctx = self.ctx
        name = self._plan[1] if self._plan[0] == it else ctx.book.best_scheme(self.li, it)
        stats = LayerStats(self.li, self.name, name)
        stats.start = time.time()
        stream = ctx.streams.acquire()
        self.stage.stream = stream if self.stage.on_gpu else None
        try:
            if ready is not None:
                stream.wait_event(ready)
            with stream, at_priority(self.priority):
                scheme = self.scheme(name)
                bad = scheme.nonfinite()                # one reduction per parameter or factor
                ctx.verdicts.record(it, self.li, bad)
                if bad:
                    raise ctx.verdicts.error(it, self.name, bad)
                scheme.send(it, stats)
                scheme.receive(it, stats)
                self.stage.synchronize()
        finally:
            self.stage.stream = None
            ctx.streams.release(stream)
        stats.end = time.time()
        return stats
