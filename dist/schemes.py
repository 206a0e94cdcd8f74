"""Synchronisation schemes as strategy objects, and the registry the syncers pick them from.

A scheme has `cost(rec, P1, P2)` (floats per iteration on the busiest node, for the book), and per
iteration `send(it, stats)` then `receive(it, stats)`, which between them must leave the layer's
parameters at their new values on this worker. PSScheme (here) and SFBScheme (dist/sfb.py) are
the paper's two; a third (ring allreduce, say) is a new class decorated with @register_scheme, and
is chosen by `--sync NAME` or by extending BestScheme, with no change to the worker loop.
"""
from engine.solvers.solver import all_finite, param_label

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
                return f"{param_label(w.book.params[pid]['owner'][1])} gradient"
        return None


@register_scheme
class PSScheme(Scheme):
    """Push each KV pair of the layer's gradients to its server; pull the updated values back.

    The gradient frames are views of the diff (CPU) or of pinned buffers (GPU), sent zero-copy;
    the values arrive pair by pair and are copied straight into the parameter (or its pinned
    buffer, then one host-to-device copy per parameter)."""

    name = "ps"

    def __init__(self, syncer):
        super().__init__(syncer)
        w = self.worker
        self.params = []
        for pid in syncer.pids:
            blob = w.net.learnable_params[pid]
            pairs = w.book.pairs_of_param(pid)
            if not pairs:
                raise DistError(f"layer '{syncer.name}': parameter {pid} is synced by PS but the "
                                f"book places none of it on a server")
            self.params.append((pid, blob, pairs))
        self.receipts = []

    @staticmethod
    def cost(rec, P1, P2):
        return ps_cost(rec["M"], rec["N"], P1, P2)

    def send(self, it, stats):
        w, stage = self.worker, self.syncer.stage
        hosts = [stage.to_host(blob.diff, ("g", pid)) for pid, blob, _ in self.params]
        stage.synchronize()
        for (pid, blob, pairs), host in zip(self.params, hosts):
            flat = host.reshape(-1)
            for pair in pairs:
                off, n = pair["offset"], pair["length"]
                receipt = w.transport.send(w.server_rank(pair["server"]), Msg.KV_PUSH,
                                           iteration=it, key=pair["id"], arrays=[flat[off:off + n]])
                stats.sent(receipt)
                self.receipts.append(receipt)

    def receive(self, it, stats):
        w, stage = self.worker, self.syncer.stage
        for pid, blob, pairs in self.params:
            host = blob.data if not stage.on_gpu else stage.buffer(("v", pid), blob.data.shape,
                                                                   blob.data.dtype)
            flat = host.reshape(-1)
            for pair in pairs:
                server = w.server_rank(pair["server"])
                msg = w.transport.receive(
                    Msg.KV_VALUE, pair["id"], it, senders=[server],
                    what=f"the new values of KV pair {pair['id']} (layer '{self.syncer.name}', "
                         f"iteration {it})")[0]
                off, n = pair["offset"], pair["length"]
                flat[off:off + n] = msg.arrays[0]
                stats.received(msg)
                stats.reply_aux.append(msg.aux)
            if stage.on_gpu:
                stage.to_device(host, blob.data)
        for receipt in self.receipts:
            receipt.wait()
        self.receipts = []


def _register_sfb():
    from . import sfb  # noqa: F401  (registers SFBScheme)


_register_sfb()
