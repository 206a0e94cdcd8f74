"""Weight updates made from sufficient factors, block by block, with the gradient never in memory.

Why: an InnerProduct layer's weight gradient on K samples is Gᵀ·X
(engine/layers/inner_product.py). Written out as a weight-sized array and read back by the
update, it costs two more passes over the weight in main memory; with few samples the GEMM that
makes it is itself bound by memory, so for a large weight (AlexNet's fc6: 151 MB) those passes
cost about as much again. Made instead in blocks of rows that fit a core's L2 cache, each block
is updated while it is still there.
Each thread takes one range of rows and runs its own GEMMs and its own part of the rule, so no block
waits on another thread. Every element gets the same dot product and the same elementwise rule as
in the whole-array path, so the parameters come out the same.

Two callers: the single-process solver (engine/solvers/solver.py), for each InnerProduct layer
that alone owns its weight (with iter_size 1 and no clip_gradients, which need the whole
gradient first); and any caller that holds the factors of several processes, e.g. a
sufficient-factor scheme, which passes them stacked in rank order.
On a GPU the whole weight is one block.
"""
import numpy

from .. import parallel as threads
from ..parallel import WorkerBuffers, block_rows, parallel


def update_from_factors(layer, rule, value, state, G, X, it, lr_mult, decay_mult, grad_scale,
                        rate, buffers):
    """Update the weight `value` (and its rule `state`) of InnerProduct `layer` by the gradient
    Gᵀ·X (Xᵀ·G for `transpose: true`), made block by block of rows.

    `buffers`: a WorkerBuffers kept by the caller across iterations (one block per thread)."""
    xp = layer.xp
    rows = value.shape[0]
    row_len = value.size // max(rows, 1)
    if xp is not numpy:
        grad = layer.weight_grad_from_factors(G, X, out=buffers(0).get(
            f"grad{value.shape}", value.shape, value.dtype, xp))
        rule.update(value, grad, state, it, lr_mult, decay_mult, grad_scale, rate=rate)
        return
    step = block_rows(rows, row_len, value.itemsize, factor_rows=G.shape[0])

    def work(worker, lo, hi):
        # rows an odd number of cache lines apart, so the GEMM's rows do not evict each other
        # from the cache (engine/gemm.py)
        buf = buffers(worker).get_rows(f"grad{step}x{row_len}", step, row_len, value.dtype, xp,
                                       pad=value.size >= threads.PADDED_ROWS_MIN)
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            grad = layer.weight_grad_from_factors(G, X, out=buf[:b - a], rows=(a, b), split=False)
            rule.update(value[a:b], grad.reshape(value[a:b].shape), [s[a:b] for s in state], it,
                        lr_mult, decay_mult, grad_scale, rate=rate, split=False)

    parallel().run(work, rows, xp, min_per_worker=step)


class FactoredWeights:
    """Which weights of a net the single-process solver updates from factors, and their buffers.

    A weight qualifies when its layer can give sufficient factors and runs backward, the layer
    alone uses it (a shared weight adds several layers' gradients) and it is learned
    (lr_mult != 0). Per iteration the solver asks `active()`: none while iter_size > 1 (the
    factors of one pass are not the iteration's gradient) or clip_gradients is set (its norm
    needs every gradient before any update), and none on a GPU, where there is no cache to keep
    the blocks in."""

    def __init__(self, net, replicas=None):
        self.net = net
        self.replicas = replicas              # a ReplicaGroup: the factors are all its replicas'
        self.entries = []                     # (param id, layer index, layer)
        index = {id(blob): pid for pid, blob in enumerate(net.learnable_params)}
        sole = net.sole_params()
        for li, layer in enumerate(net.layers):
            if not getattr(layer, "has_sufficient_factors", False) or not layer.blobs:
                continue
            weight = layer.blobs[0]
            pid = index.get(id(weight))
            if (pid is not None and id(weight) in sole and layer.param_propagate_down[0]
                    and net.layer_need_backward[li]):
                self.entries.append((pid, li, layer))
        self.buffers = WorkerBuffers()

    def entries_for(self, layers):
        """The entries of the layers (indices) a caller makes weight gradients for from factors;
        a layer that cannot is refused."""
        mine = {li: (pid, li, layer) for pid, li, layer in self.entries}
        ok = [mine[li] for li in sorted(layers) if li in mine]
        if len(ok) != len(set(layers)):
            bad = sorted(set(layers) - set(mine))
            raise ValueError(f"layers {bad} cannot have their weight gradient made from "
                             f"sufficient factors (not an InnerProduct that alone owns a learned "
                             f"weight and runs backward)")
        return ok

    def active(self, solver_param):
        if (solver_param.iter_size > 1 or solver_param.clip_gradients >= 0
                or self.net.xp is not numpy):
            return []
        return self.entries

    def factors(self, li, layer):
        """(G, X) of layer li: the net's own, or every replica's stacked (engine/replicas.py)."""
        if self.replicas is not None:
            return self.replicas.factors(li, layer)
        net = self.net
        return layer.sufficient_factors(net.bottom_vecs[li], net.top_vecs[li])
