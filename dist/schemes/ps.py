"""The sharded parameter server as a scheme: push the layer's gradient, pull its new values.

The KV pairs of the layer's parameters live on the servers (dist/kv/store.py), which average the
workers' gradients and apply the solver's rule; the KV client (dist/kv/client.py) carries the messages.
"""
import numpy

from ..cost.formulas import ps_cost
from ..errors import DistError
from ..kv.client import bundle_text
from .base import Scheme, register_scheme


@register_scheme
class PSScheme(Scheme):
    """Push the layer's gradients to the servers, one message per bundle of its KV pairs
    (dist/coord/placement.bundle_pairs); take the updated values back the same way.

    The gradient frames are views of the diff (CPU) or of pinned buffers (GPU), sent zero-copy;
    the values arrive bundle by bundle and are copied straight into the parameter (or its pinned
    buffer, then one host-to-device copy per parameter). To a server of this host that shares its
    memory (dist/transport/onehost/kvshm.py) the gradient is copied into this worker's region and
    the message is a header; the answer is a header too, and the values are copied from the
    server's memory. A parameter the worker placed in that memory (dist/worker/replicas.py) is
    copied neither way: its diff is the region, its data the server's values."""

    name = "ps"
    uses_servers = True
    bsp_only = False      # the servers' consistency policies handle late and early workers

    def __init__(self, syncer):
        super().__init__(syncer)
        ctx = self.ctx
        self.params = []
        where = {}                                  # pair id -> (param id, offset, length)
        for pid in syncer.pids:
            blob = ctx.net.learnable_params[pid]
            pairs = ctx.book.pairs_of_param(pid)
            if not pairs:
                raise DistError(f"layer '{syncer.name}': parameter {pid} is synced by PS but the "
                                f"book places none of it on a server")
            self.params.append((pid, blob))
            for pair in pairs:
                where[pair.id] = (pid, pair.offset, pair.length)
        self.bundles = [(b.id, ctx.kv.server_rank(b.server), [where[k] for k in b.pairs],
                         list(b.pairs)) for b in ctx.book.bundles_of_layer(syncer.li)]
        self.receipts = []
        self._shared = None                 # bundle id -> the server's kvshm.Segment or None
        self._in_place = set()              # bundles whose parameters are all placed there
        itemsize = int(ctx.book.data["itemsize"])
        self._bytes = {key: sum(n for _, _, n in parts) * itemsize
                       for key, _, parts, _ in self.bundles}

    @staticmethod
    def cost(rec, P1, P2):
        return ps_cost(rec.M, rec.N, P1, P2)

    @staticmethod
    def traffic(rec, P1, P2):
        """Messages as Table 1 counts floats: the busiest node (a worker beside a server) pushes
        to and hears back from the P2 - 1 remote servers, and its server hears from and answers
        the P1 - 1 remote workers (at least one round trip: P1 = P2 = 1 still crosses a socket).
        No arithmetic on the worker: the servers update."""
        return {"messages": max(2 * (P1 + P2 - 2), 2),
                "floats": ps_cost(rec.M, rec.N, P1, P2), "flops": 0.0}

    def _segments(self):
        """Each bundle's server memory, looked up at the first sync (after the start barrier and
        the placement); and the bundles that move nothing at all (`_in_place`): their sync then
        builds no views of the diffs or the data."""
        if self._shared is None:
            ctx = self.ctx
            self._shared = {key: ctx.transport.kv_segment(server)
                            for key, server, _, _ in self.bundles}
            self._in_place = {key for key, _, parts, _ in self.bundles
                              if self._shared[key] is not None
                              and all(pid in ctx.placed for pid, _, _ in parts)}
        return self._shared

    def _flat(self, which):
        """{param id: its diff ('g') or data ('v') on the host, flat}: views on the CPU, pinned
        buffers on a GPU (the diff copied in on the sync's stream; the data filled by receive)."""
        stage = self.syncer.stage
        if which == "g":
            return {pid: stage.to_host(blob.diff, ("g", pid)).reshape(-1)
                    for pid, blob in self.params}
        return {pid: (blob.data if not stage.on_gpu else
                      stage.buffer(("v", pid), blob.data.shape, blob.data.dtype)).reshape(-1)
                for pid, blob in self.params}

    def send(self, it, stats):
        ctx, stage = self.ctx, self.syncer.stage
        shared = self._segments()
        flat = None
        for key, server, parts, pair_ids in self.bundles:
            if key in self._in_place:           # the diffs are the region: a header alone
                receipt = ctx.kv.push(server, key, it, shared=True)
                receipt.payload_bytes = self._bytes[key]
                stats.sent(receipt)
                continue
            if flat is None:
                flat = self._flat("g")
                stage.synchronize()
            arrays = [flat[pid][off:off + n] for pid, off, n in parts]
            segment = shared[key]
            if segment is None:
                receipt = ctx.kv.push(server, key, it, arrays=arrays)
                self.receipts.append(receipt)
            else:
                for k, a, (pid, _, _) in zip(pair_ids, arrays, parts):
                    if pid not in ctx.placed:     # a placed diff is already there
                        numpy.copyto(segment.grads(ctx.rank, k), a)
                receipt = ctx.kv.push(server, key, it, shared=True)
                receipt.payload_bytes = self._bytes[key]
            stats.sent(receipt)

    def receive(self, it, stats):
        ctx, stage = self.ctx, self.syncer.stage
        shared = self._segments()
        flat = None
        for key, server, parts, pair_ids in self.bundles:
            msg = ctx.kv.pull(server, key, it, spin=self.syncer.spin,
                              what=f"the new values of {bundle_text(key, len(parts))} (layer "
                                   f"'{self.syncer.name}', iteration {it})")
            if msg.shared:
                segment = shared[key]
                if segment is None:
                    raise DistError(f"{ctx.name}: {bundle_text(key, len(parts))} came "
                                    f"back in shared memory, which this worker did not map")
                if key not in self._in_place:
                    if flat is None:
                        flat = self._flat("v")
                    for (pid, off, n), k in zip(parts, pair_ids):
                        if pid not in ctx.placed:     # a placed parameter is already updated
                            numpy.copyto(flat[pid][off:off + n], segment.values(k))
                stats.recv_payload += self._bytes[key]
            else:
                if flat is None:
                    flat = self._flat("v")
                for (pid, off, n), values in zip(parts, msg.arrays):
                    flat[pid][off:off + n] = values
            stats.received(msg)
            stats.reply_aux.append(msg.aux)
        if stage.on_gpu:
            if flat is None:
                flat = self._flat("v")
            for pid, blob in self.params:
                stage.to_device(flat[pid], blob.data)
        for receipt in self.receipts:
            receipt.wait()
        self.receipts = []
