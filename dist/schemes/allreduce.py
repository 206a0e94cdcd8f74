"""Ring all-reduce as a scheme: the workers sum a layer's gradient among themselves, no servers.

Why: the parameter server sends every gradient through P2 server nodes, which become the busiest
nodes when P2 < P1 (2·M·N·(P1 + P2 − 2)/P2 floats); a ring moves 2·2·(P1 − 1)/P1 of the layer's
floats through every worker, whatever P1, and SFB's factors are only cheaper for fully connected
layers on small batches. BestScheme (best.py) takes whichever is cheapest per layer.

How: the layer's flat gradient (all its synced learnable blobs, in parameter order) is cut into P1
chunks, reduce-scattered then all-gathered around the ring of workers in rank order (ring.py has
the plan). Each chunk is further cut into pieces, and a piece is sent on to the right neighbour as
soon as it has been reduced (or, in the all-gather, received), so the steps pipeline: the right
neighbour works on piece 0 of a step while this worker still receives piece 1. Each chunk is
summed once, in one order, and its sum then copied to every worker, so every replica applies the
same bits; each worker then applies the solver's rule to the summed gradient with its own copy of
the layer's solver history (as SFB does), scaled like every scheme by the job's grad_scale.

Messages: one RING message per piece, keyed by (layer, slot) (ring.ring_key), checked on receipt
against the plan (dist/coord/checks.py: from the left neighbour only, the piece's exact length; the
transport keeps the first piece of a slot and refuses pieces far ahead of this worker's
iteration). Waits have the job's --timeout and name the layer, the piece and the awaited worker;
an abort of the job ends them as it ends any receive. A piece holding NaN/Inf stops the job before
it is added or passed on (`_take`): every worker checks its own gradient before sending, so such
a piece is a member's fault (or a sum that overflowed), and taking it would put NaN into every
replica with nothing to say where it came from.
"""
import math

import numpy
from poseidon.engine.solvers.health import all_finite

from ..cost.formulas import allreduce_cost
from ..errors import DistError
from ..transport import Msg
from .base import Scheme, register_scheme
from .ring import ALL_GATHER, MAX_LAYERS, REDUCE_SCATTER, layer_floats, ring_key, ring_plan

# The largest piece, in floats (1 MB of float32), unless the job gives --piece-bytes (the book then
# carries it in each layer's record as piece_floats). Small enough that a chunk of a large layer
# goes as several pieces that overlap their sends with the next pieces' sums; large enough that the
# fixed cost of a message (a header, a few thread hand-overs) is small against its bytes.
PIECE_FLOATS = 1 << 18


def plan_of(rec, workers):
    return ring_plan(layer_floats(rec), workers, rec.piece_floats or PIECE_FLOATS)


@register_scheme
class AllReduceScheme(Scheme):
    name = "allreduce"
    uses_servers = False
    bsp_only = True          # a chunk's sum needs every worker's piece of the iteration

    @staticmethod
    def applies_to(rec):
        """Every layer with parameters (the ring moves the gradient, whatever made it) whose index
        a piece's key can carry (ring.MAX_LAYERS)."""
        return rec.index < MAX_LAYERS

    @staticmethod
    def cost(rec, P1, P2):
        return allreduce_cost(layer_floats(rec), P1)

    @staticmethod
    def traffic(rec, P1, P2):
        """Per iteration on the busiest node: messages sent plus received (2·(P1 − 1) pieces per
        chunk step each way), floats sent plus received (the cost), and the reduction's adds on a
        worker ((P1 − 1)/P1 of the layer's floats)."""
        plan = plan_of(rec, max(P1, 1))
        return {"messages": 2 * plan.slots, "floats": allreduce_cost(plan.floats, P1),
                "flops": (P1 - 1) * plan.floats / P1 if P1 > 0 else 0.0}

    @staticmethod
    def ring_piece(rec, slot, workers, position):
        """Floats of piece `slot` of the layer's ring the worker at `position` may be sent, or
        None for a slot the ring does not have (dist/coord/checks.py)."""
        return plan_of(rec, workers).expected_length(slot, position)

    def __init__(self, syncer):
        super().__init__(syncer)
        ctx = self.ctx
        ring = ctx.roles.worker_ranks()
        self.position = ring.index(ctx.rank)
        self.left = ring[self.position - 1]
        self.right = ring[(self.position + 1) % len(ring)]
        params = ctx.net.learnable_params
        self.params, offset = [], 0                  # (param id, blob, start in the flat gradient)
        for pid in syncer.pids:
            self.params.append((pid, params[pid], offset))
            offset += params[pid].count
        # the ring of a bucket carries every member's parameters (floats as layer_floats counts)
        self.plan = ring_plan(sum(math.prod(params[pid].shape) for pid in syncer.pids), len(ring),
                              syncer.rec.piece_floats or PIECE_FLOATS)
        self.receipts = []
        self._own = None

    # ----- the flat gradient -----------------------------------------------------------------------
    def _own_gradient(self):
        """This worker's flat gradient on the host: the diff itself for a lone parameter on the CPU
        (no copy), else the diffs copied into one reused buffer."""
        stage = self.syncer.stage
        if len(self.params) == 1 and not stage.on_gpu:
            return self.params[0][1].diff.reshape(-1)
        blob0 = self.params[0][1]
        flat = stage.buffer("own", (self.plan.floats,), blob0.diff.dtype)
        for _, blob, start in self.params:
            part = flat[start:start + blob.count].reshape(blob.diff.shape)
            if stage.on_gpu:
                blob.diff.get(stream=stage.stream, out=part)
            else:
                numpy.copyto(part, blob.diff)
        return flat

    # ----- the ring ---------------------------------------------------------------------------------
    def _pass_on(self, it, phase, step, j, piece, stats):
        receipt = self.ctx.transport.send(
            self.right, Msg.RING, iteration=it, arrays=[piece],
            key=ring_key(self.syncer.li, self.plan.slot(phase, step, j)))
        stats.sent(receipt)
        self.receipts.append(receipt)

    def _take(self, it, phase, step, j, stats):
        plan, syncer = self.plan, self.syncer
        chunk = plan.received_chunk(phase, step, self.position)
        stage = "reduce-scatter" if phase == REDUCE_SCATTER else "all-gather"
        piece = (f"piece {j} of chunk {chunk} of layer '{syncer.name}' ({stage} step {step}, "
                 f"all-reduce ring)")
        msg = self.ctx.transport.receive(
            Msg.RING, ring_key(syncer.li, plan.slot(phase, step, j)), it, senders=[self.left],
            what=f"{piece} for iteration {it}")[0]
        stats.received(msg)
        if not all_finite(msg.arrays[0]):
            ctx = self.ctx
            raise DistError(f"{ctx.roles.name(ctx.rank)}: iteration {it}: {piece} from "
                            f"{ctx.roles.name(msg.sender)} holds NaN/Inf; stopping (its own "
                            f"gradient is checked before it is sent: a member sent a bad piece, "
                            f"or the partial sum overflowed)")
        return msg.arrays[0]

    def send(self, it, stats):
        """Step 0 of the reduce-scatter: this worker's own pieces of the chunk it starts."""
        own = self._own_gradient()
        self.syncer.stage.synchronize()
        self._own = own
        if self.plan.workers == 1:
            return
        chunk = self.plan.sent_chunk(REDUCE_SCATTER, 0, self.position)
        for j in range(self.plan.pieces):
            lo, hi = self.plan.piece(chunk, j)
            self._pass_on(it, REDUCE_SCATTER, 0, j, own[lo:hi], stats)

    def receive(self, it, stats):
        """The rest of the ring, piece by piece, then the solver's rule on the summed gradient.

        Every region of the buffers is written once per iteration (partial sums in `partial`,
        full sums in `total`), so a piece still being sent zero-copy is never overwritten; the
        sends are waited for before the next iteration writes them again."""
        plan, own = self.plan, self._own
        if plan.workers == 1:
            total = own
        else:
            stage = self.syncer.stage
            total = stage.buffer("total", own.shape, own.dtype)
            partial = stage.buffer("partial", own.shape, own.dtype)
            last = plan.workers - 2
            for step in range(plan.workers - 1):          # reduce-scatter
                chunk = plan.received_chunk(REDUCE_SCATTER, step, self.position)
                into = total if step == last else partial
                for j in range(plan.pieces):
                    lo, hi = plan.piece(chunk, j)
                    numpy.add(self._take(it, REDUCE_SCATTER, step, j, stats), own[lo:hi],
                              out=into[lo:hi])
                    if step < last:
                        self._pass_on(it, REDUCE_SCATTER, step + 1, j, into[lo:hi], stats)
                    else:                                  # the full sum of this worker's chunk
                        self._pass_on(it, ALL_GATHER, 0, j, into[lo:hi], stats)
            for step in range(plan.workers - 1):          # all-gather
                chunk = plan.received_chunk(ALL_GATHER, step, self.position)
                for j in range(plan.pieces):
                    lo, hi = plan.piece(chunk, j)
                    total[lo:hi] = self._take(it, ALL_GATHER, step, j, stats)
                    if step < last:
                        self._pass_on(it, ALL_GATHER, step + 1, j, total[lo:hi], stats)
        # The rule takes its gradient as scratch (engine/solvers/rules.py), and `total` holds the
        # chunk this worker summed, sent zero-copy to its right neighbour: the sends must be out
        # of the buffers before the rule writes them, or the neighbour may be sent a half-updated
        # sum (replicas that differ, run to run).
        for receipt in self.receipts:
            receipt.wait()
        self.receipts = []
        self._apply(total, it)
        self._own = None

    def _apply(self, total, it):
        """The solver's rule on each parameter, from its part of the summed gradient."""
        ctx, stage = self.ctx, self.syncer.stage
        for pid, blob, start in self.params:
            grad = total[start:start + blob.count]
            if stage.on_gpu:
                grad = stage.device_array(grad, ctx.net.xp)
            p = ctx.book.params[pid]
            ctx.rule.update(blob.data, grad.reshape(blob.data.shape), ctx.history[pid], it,
                            p.lr_mult, p.decay_mult, ctx.grad_scale)
