"""Synchronisation schemes as strategy objects, and the registry the syncers pick them from.

A scheme has `cost(rec, P1, P2)` (floats per iteration on the busiest node, for the book), and per
iteration `send(it, stats)` then `receive(it, stats)`, which between them must leave the layer's
parameters at their new values on this worker. PSScheme (here) and SFBScheme (dist/sfb.py) are
the paper's two; a third (ring allreduce, say) is a new class decorated with @register_scheme, and
is chosen by `--sync NAME` or by extending BestScheme, with no change to the worker loop.
"""
import numpy

from poseidon.engine.solvers.solver import all_finite, param_label

from .cost import ps_cost
from .errors import DistError
from .transport import Msg

SCHEMES = {}


def register_scheme(cls):
    SCHEMES[cls.name] = cls
    return cls


def make_scheme(name, syncer):
    try:
        cls = SCHEMES[name]
    except KeyError:
        raise DistError(f"unknown synchronisation scheme '{name}' (known: "
                        f"{', '.join(sorted(SCHEMES))})") from None
    return cls(syncer)


class Scheme:
    name = None
    defers_weight_grad = False      # True: the layer's own backward need not make its weight gradient

    def __init__(self, syncer):
        self.syncer = syncer
        self.worker = syncer.worker

    @staticmethod
    def cost(rec, P1, P2):
        raise NotImplementedError

    def send(self, it, stats):
        raise NotImplementedError

    def receive(self, it, stats):
        raise NotImplementedError

    def unwritten_params(self):
        """The parameters whose diff the layer's backward does not write under this scheme (the
        worker then skips clearing them: nothing reads them either)."""
        return ()

    def nonfinite(self):
        """What of this layer's gradient holds NaN/Inf ('weight gradient', ...), or None. Checked
        before anything is sent, so a bad gradient never leaves the worker."""
        w = self.worker
        for pid in self.syncer.pids:
            if not all_finite(w.net.learnable_params[pid].diff):
                li, bi = w.book.params[pid]["owner"]
                where = (f" (of layer '{w.net.layer_names[li]}')"
                         if len(self.syncer.members) > 1 else "")   # a bucket of several layers
                return f"{param_label(bi)} gradient{where}"
        return None


def bundle_text(key, count):
    """'KV pair 7', or 'KV pair 7 (+2 more in its message)', for waits and errors."""
    if count == 1:
        return f"KV pair {key}"
    return f"KV pair {key} (+{count - 1} more in its message)"


@register_scheme
class PSScheme(Scheme):
    """Push the layer's gradients to the servers, one message per bundle of its KV pairs
    (dist/placement.bundle_pairs); take the updated values back the same way.

    The gradient frames are views of the diff (CPU) or of pinned buffers (GPU), sent zero-copy;
    the values arrive bundle by bundle and are copied straight into the parameter (or its pinned
    buffer, then one host-to-device copy per parameter). To a server of this host that shares its
    memory (dist/transport/onehost/kvshm.py) the gradient is copied into this worker's region and
    the message is a header; the answer is a header too, and the values are copied from the
    server's memory.
    A parameter the worker placed in that memory (DistributedSolver._place_in_kv_memory) is
    copied neither way: its diff is the region, its data the server's values."""

    name = "ps"

    def __init__(self, syncer):
        super().__init__(syncer)
        w = self.worker
        self.params = []
        where = {}                                  # pair id -> (param id, offset, length)
        for pid in syncer.pids:
            blob = w.net.learnable_params[pid]
            pairs = w.book.pairs_of_param(pid)
            if not pairs:
                raise DistError(f"layer '{syncer.name}': parameter {pid} is synced by PS but the "
                                f"book places none of it on a server")
            self.params.append((pid, blob))
            for pair in pairs:
                where[pair["id"]] = (pid, pair["offset"], pair["length"])
        self.bundles = [(b["id"], w.server_rank(b["server"]), [where[k] for k in b["pairs"]],
                         b["pairs"]) for b in w.book.bundles_of_layer(syncer.li)]
        self.receipts = []
        self._shared = None                 # bundle id -> the server's kvshm.Segment or None
        self._in_place = set()              # bundles whose parameters are all placed there
        itemsize = int(w.book.data["itemsize"])
        self._bytes = {key: sum(n for _, _, n in parts) * itemsize
                       for key, _, parts, _ in self.bundles}

    @staticmethod
    def cost(rec, P1, P2):
        return ps_cost(rec["M"], rec["N"], P1, P2)

    def _segments(self):
        """Each bundle's server memory, looked up at the first sync (after the start barrier and
        the placement); and the bundles that move nothing at all (`_in_place`): their sync then
        builds no views of the diffs or the data."""
        if self._shared is None:
            w = self.worker
            self._shared = {key: w.transport.kv_segment(server)
                            for key, server, _, _ in self.bundles}
            self._in_place = {key for key, _, parts, _ in self.bundles
                              if self._shared[key] is not None
                              and all(pid in w.placed for pid, _, _ in parts)}
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
        w, stage = self.worker, self.syncer.stage
        shared = self._segments()
        flat = None
        for key, server, parts, pair_ids in self.bundles:
            if key in self._in_place:           # the diffs are the region: a header alone
                receipt = w.transport.send(server, Msg.KV_PUSH, iteration=it, key=key,
                                           shared=True)
                receipt.payload_bytes = self._bytes[key]
                stats.sent(receipt)
                continue
            if flat is None:
                flat = self._flat("g")
                stage.synchronize()
            arrays = [flat[pid][off:off + n] for pid, off, n in parts]
            segment = shared[key]
            if segment is None:
                receipt = w.transport.send(server, Msg.KV_PUSH, iteration=it, key=key,
                                           arrays=arrays)
                self.receipts.append(receipt)
            else:
                for k, a, (pid, _, _) in zip(pair_ids, arrays, parts):
                    if pid not in w.placed:     # a placed diff is already there
                        numpy.copyto(segment.grads(w.rank, k), a)
                receipt = w.transport.send(server, Msg.KV_PUSH, iteration=it, key=key,
                                           shared=True)
                receipt.payload_bytes = self._bytes[key]
            stats.sent(receipt)

    def receive(self, it, stats):
        w, stage = self.worker, self.syncer.stage
        shared = self._segments()
        flat = None
        for key, server, parts, pair_ids in self.bundles:
            msg = w.transport.receive(
                Msg.KV_VALUE, key, it, senders=[server],
                what=f"the new values of {bundle_text(key, len(parts))} (layer "
                     f"'{self.syncer.name}', iteration {it})", spin=self.syncer.spin)[0]
            if msg.shared:
                segment = shared[key]
                if segment is None:
                    raise DistError(f"{w.session.name}: {bundle_text(key, len(parts))} came "
                                    f"back in shared memory, which this worker did not map")
                if key not in self._in_place:
                    if flat is None:
                        flat = self._flat("v")
                    for (pid, off, n), k in zip(parts, pair_ids):
                        if pid not in w.placed:     # a placed parameter is already updated
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


def _register_sfb():
    from . import sfb  # noqa: F401  (registers SFBScheme)


_register_sfb()
