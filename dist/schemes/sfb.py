"""Sufficient-factor broadcasting for InnerProduct layers.

Why: an M×N fully connected weight gradient on K samples is Gᵀ·X, with G the K×M top gradient and X
the K×N input. Sending (G, X) — K·(M + N) floats — to each peer instead of M·N floats through a
server is much cheaper when K is small against M and N (Algorithm 1 decides).

How: each worker sends its (G, X) and its bias gradient (M floats) to every peer, zero-copy (a
worker of several replicas sends theirs stacked, K·G rows, with G scaled by 1/G: engine/replicas.py), and
gathers theirs. It stacks all P1 factor sets IN RANK ORDER and rebuilds the combined weight gradient
with GEMMs on the stacked factors (`layer.weight_grad_from_factors(G_all, X_all)`; the released
Poseidon applied each peer's factors as a separate SGD step), sums the bias gradients in rank order,
and applies the solver's update rule with the 1/P1 scale and its own copy of the layer's solver
state. Every worker computes the same numbers in the same order, so the replicas stay bitwise
identical.

Cost: the layer's own backward skips its local weight gradient (the scheme is `factored`: the
worker's hooks tell the solver, whose backward of the layer then leaves the weight alone), and the rebuild and the update go together block by
block of weight rows (engine/solvers/factored.py, which the single-process solver uses too), so
each gradient block is updated while it is still in cache and no weight-sized gradient is ever
written to memory or allocated per iteration.
"""
import numpy

from poseidon.engine.parallel import WorkerBuffers
from poseidon.engine.solvers.factored import update_from_factors
from poseidon.engine.solvers.health import all_finite

from ..cost.formulas import sfb_cost
from ..errors import DistError
from ..transport import Msg
from .base import Scheme, register_scheme


@register_scheme
class SFBScheme(Scheme):
    name = "sfb"
    factored = True                 # the layer's backward skips its weight gradient (rebuilt here)
    sends_bottom_data = True        # X, zero-copy on the CPU

    @staticmethod
    def applies_to(rec):
        """InnerProduct layers that alone own a learned weight, with iter_size 1 (the book's 'sfb'
        flag: the factors of one pass are the iteration's gradient)."""
        return bool(rec.sfb) and rec.weight_grad is not False

    @staticmethod
    def peer_arrays(rec, arrays):
        """G (K×M), X (K×N) and, with a bias, its gradient (M)."""
        expected = f"[{rec.K}, {rec.M}], [{rec.K}, {rec.N}], [{rec.M}]"
        if not 2 <= len(arrays) <= 3:
            return None, expected
        rows = arrays[0].shape[0] if arrays[0].ndim == 2 else -1
        want = [(rows, rec.M), (rows, rec.N)] + [(rec.M,)] * (len(arrays) - 2)
        if rows != rec.K:
            want[0] = want[1] = None
        return want, expected

    def __init__(self, syncer):
        super().__init__(syncer)
        ctx = self.ctx
        layer = syncer.layer
        if not layer.has_sufficient_factors:
            raise DistError(f"layer '{syncer.name}' ({layer.type}) cannot give sufficient "
                            f"factors; it must be synced by PS")
        self.layer = layer
        self.weight = self.bias = None
        for pid in syncer.pids:
            li, bi = ctx.book.params[pid].owner
            if bi == 0:
                self.weight = pid
            elif bi == 1:
                self.bias = pid
        if self.weight is None:
            raise DistError(f"layer '{syncer.name}': SFB needs its weight to be learnable")
        self.peers = [r for r in ctx.roles.worker_ranks() if r != ctx.rank]
        self.receipts = []
        self._own = None
        self._buffers = WorkerBuffers()         # the rebuilt gradient blocks, reused

    @staticmethod
    def cost(rec, P1, P2):
        return sfb_cost(rec.M, rec.N, rec.K, P1)

    @staticmethod
    def traffic(rec, P1, P2):
        """Its factors to and from each of the P1 - 1 peers; the rebuild of the weight gradient
        from all P1 workers' factors, a GEMM of 2·K·P1·M·N flops, on every worker (all of it is
        counted: it runs inside the sync, whose observed time the prediction is compared with)."""
        M, N, K = rec.M, rec.N, rec.K
        return {"messages": 2 * max(P1 - 1, 0), "floats": sfb_cost(M, N, K, P1),
                "flops": 2.0 * K * P1 * M * N}

    def _factors(self):
        net, li = self.ctx.net, self.syncer.li
        G, X = self.ctx.factors(li, self.layer)         # K·G rows on a worker of G replicas
        arrays = [G, X]
        if self.bias is not None:
            arrays.append(net.learnable_params[self.bias].diff)
        return arrays

    def unwritten_params(self):
        return (self.weight,)                   # defers_weight_grad: rebuilt here, never stored

    def nonfinite(self):
        """NaN/Inf in the factors (G, X) or the bias gradient: the weight gradient is built from
        them, and here is where it would leave."""
        for i, a in enumerate(self._factors()):
            if not all_finite(a):
                return "bias gradient" if i == 2 else "weight gradient"
        return None

    def send(self, it, stats):
        ctx, stage = self.ctx, self.syncer.stage
        own = [stage.to_host(a, ("f", i)) for i, a in enumerate(self._factors())]
        stage.synchronize()
        self._own = own
        for peer in self.peers:
            receipt = ctx.transport.send(peer, Msg.SF, iteration=it, key=self.syncer.li, arrays=own)
            stats.sent(receipt)
            self.receipts.append(receipt)

    def receive(self, it, stats):
        ctx, stage, syncer = self.ctx, self.syncer.stage, self.syncer
        msgs = []
        if self.peers:
            msgs = ctx.transport.receive(
                Msg.SF, syncer.li, it, count=len(self.peers), senders=self.peers,
                what=f"the sufficient factors of layer '{syncer.name}' for iteration {it}")
        for m in msgs:
            stats.received(m)
        by_rank = {m.sender: m.arrays for m in msgs}
        by_rank[ctx.rank] = self._own
        sets = [by_rank[r] for r in ctx.roles.worker_ranks()]   # rank order
        k_total = sum(s[0].shape[0] for s in sets)
        G0, X0 = self._own[0], self._own[1]
        g_all = stage.buffer("G_all", (k_total, G0.shape[1]), G0.dtype)
        x_all = stage.buffer("X_all", (k_total, X0.shape[1]), X0.dtype)
        row = 0
        for s in sets:
            k = s[0].shape[0]
            if s[0].shape[1] != G0.shape[1] or s[1].shape[1] != X0.shape[1]:
                raise DistError(f"layer '{syncer.name}': factors of shapes {s[0].shape}, "
                                f"{s[1].shape} from a peer do not fit {G0.shape}, {X0.shape}")
            g_all[row:row + k] = s[0]
            x_all[row:row + k] = s[1]
            row += k
        xp = ctx.net.xp
        self._rebuild_and_update(stage.device_array(g_all, xp), stage.device_array(x_all, xp), it)
        if self.bias is not None:
            b = stage.buffer("b_sum", sets[0][2].shape, sets[0][2].dtype)
            numpy.copyto(b, sets[0][2])
            for s in sets[1:]:
                b += s[2]
            self._apply(self.bias, stage.device_array(b, xp) if stage.on_gpu else b, it)
        for receipt in self.receipts:
            receipt.wait()
        self.receipts = []
        self._own = None

    def _rebuild_and_update(self, g_all, x_all, it):
        """The weight's update from the stacked factors, block of rows by block of rows."""
        ctx = self.ctx
        p = ctx.book.params[self.weight]
        update_from_factors(self.layer, ctx.rule, ctx.net.learnable_params[self.weight].data,
                            ctx.history[self.weight], g_all, x_all, it, p.lr_mult,
                            p.decay_mult, ctx.grad_scale, ctx.rule.rate(it), self._buffers)

    def _apply(self, pid, grad, it):
        ctx = self.ctx
        p = ctx.book.params[pid]
        blob = ctx.net.learnable_params[pid]
        ctx.rule.update(blob.data, grad.reshape(blob.data.shape), ctx.history[pid], it, p.lr_mult,
                      p.decay_mult, ctx.grad_scale)
