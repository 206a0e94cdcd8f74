"""Algorithm 2 of the Poseidon paper: wait-free backpropagation over one worker's syncers.

    begin_iteration(it)          BestScheme(l) for every synced layer (Syncer.prepare)
    backward_done(it, l, event)  right after BackwardThrough(l): sync(l) starts on the pool, so
                                 layer l's communication overlaps the backward of the layers
                                 below (with overlap off: every sync once layer 0 is done)
    before_forward(l)            the next forward of layer l waits for the syncs it depends on
                                 (its own parameters, and any sync still sending a blob it
                                 overwrites: dist/worker/layerwait.py), not for all of them
    wait_all()                   every sync in flight done (BSP's barrier, a test, a snapshot)

The last sync to start has nothing left to overlap with: it runs on the calling thread instead of
waking a pool thread and waiting to be woken by it. Timing and statistics are not kept here
(dist/worker/iterrecord.py records them from what wait_all returns).
"""
import time
from concurrent.futures import Future

from .layerwait import PendingSyncs


class WaitFreeBackprop:
    """The sync schedule of one worker. syncers: {layer: Syncer}; forward_waits: {layer: keys of
    the syncs forward(layer) must see done}; inline_layer: the sync run on the calling thread;
    on_error(it, errors): called (and must raise) when a waited sync failed."""

    def __init__(self, syncers, pool, overlap, forward_waits, inline_layer, on_error):
        self.syncers, self.pool, self.overlap = syncers, pool, overlap
        self.forward_waits, self.inline_layer = forward_waits, inline_layer
        self.pending = PendingSyncs(on_error)

    def begin_iteration(self, it):
        """Fix each sync's scheme for iteration `it`; the layers whose scheme makes the weight
        gradient from sufficient factors (their own backward must leave it alone)."""
        return {li for li, syncer in self.syncers.items() if syncer.prepare(it)}

    def backward_done(self, it, layer, event):
        """Layer `layer`'s gradient of iteration `it` is complete (`event`: recorded after its
        backward on a GPU): start its sync, or under no overlap every sync after layer 0."""
        if self.overlap:
            if layer in self.syncers:
                self._start(it, layer, event)
        elif layer == 0:
            for li in sorted(self.syncers, reverse=True):
                self._start(it, li, event)

    def before_forward(self, layer):
        if self.pending:
            self.pending.wait_for(self.forward_waits.get(layer, ()))

    def wait_all(self):
        """Block until every sync in flight is done; (iteration, [LayerStats], seconds this wait
        took, seconds of that iteration's syncs the worker was exposed to), or None if none."""
        if not self.pending:
            return None
        it, stats, barrier_s = self.pending.wait_all()
        return it, stats, barrier_s, self.pending.exposed_s

    def cancel(self):
        """After a failure: drop the syncs not yet started and forget the rest."""
        self.pending.cancel()

    def _start(self, it, li, event):
        syncer = self.syncers[li]
        if li != self.inline_layer:
            self.pending.add(it, li, self.pool.submit(syncer.sync, it, event))
            return
        done, t0 = Future(), time.time()
        try:
            done.set_result(syncer.sync(it, event))
        except Exception as e:                  # the waits report it, as for the pool's
            done.set_exception(e)
        self.pending.add(it, li, done)
        self.pending.exposed_s += time.time() - t0
