"""The per-layer wait: the next forward of layer l waits for the syncs it depends on, not for all.

Why: under BSP the forward of layer l in iteration t+1 needs layer l's parameters of iteration t,
nothing more. A barrier that waits for every sync of t before the next forward makes the bottom
layers wait for the top layer's sync, which with wait-free backpropagation is the last to finish
(its backward ran first, but on a wire ordered lowest layer first it is sent last). Waiting for
layer l's own sync before forward(l) lets the bottom layers compute while the top layers' syncs
are still on the wire, which is what `--priority` is for.

What forward(l) must see finished, from iteration t (`forward_waits`, computed once per net):
  - the syncs that write a parameter layer l reads: the syncer of each parameter the layer uses
    (a parameter shared by name with another layer is synced with its owner);
  - the syncs that may still read a blob forward(l) writes: forward(l) writes its top blobs (an
    in-place layer's top is its bottom too, and a Split's tops are its bottom's storage: blobs
    are compared as objects and by the memory they cover), and a scheme that sends a layer's
    bottom data (`Scheme.sends_bottom_data`: SFB's X factor, sent zero-copy on the CPU) reads
    the bottom of each member of its syncer, so every sync whose scheme may send bottom data, of a layer one of
    whose bottoms is a top of l, is waited for as well.
Forward writes nothing else a sync reads: the syncs read the parameters' diffs and the top diffs
(SFB's G), which only the clearing of the gradients and the backward write; before those the
worker waits for every sync still pending (`WorkerHooks.before_backward`). Waits accumulate down
the net: forward(l) runs after forward(0..l-1), so it has waited for their syncs too.

`PendingSyncs` holds one iteration's syncs while they are in flight and counts the time the
worker spent waiting on them (the exposed sync time of --stats).
"""
import time
from concurrent.futures import FIRST_EXCEPTION, wait


def _span(blob):
    """(first, last + 1) address of a blob's data: blobs that share storage (a Split's tops and
    its bottom, an in-place layer's top and bottom) overlap, whichever Blob objects they are."""
    data = blob.data
    iface = getattr(data, "__array_interface__", None) or data.__cuda_array_interface__
    start = iface["data"][0]
    return start, start + data.nbytes


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


def forward_waits(net, syncers, sends_bottom_data):
    """{layer index: the keys of `syncers` whose syncs forward(layer) must see finished}.

    syncers: {key: Syncer} (each with `.pids`, its learnable parameter ids, and `.members`, its
    layers). sends_bottom_data(syncer): whether a scheme it may run sends its layers' bottom
    data."""
    pid_of = {spec.name: pid for pid, spec in enumerate(net.learnable_param_specs)}
    writer = {pid: key for key, syncer in syncers.items() for pid in syncer.pids}
    readers = []                               # (blob, its memory, sync that may send it)
    for key, syncer in syncers.items():
        if sends_bottom_data(syncer):
            for li in syncer.members:
                readers += [(blob, _span(blob), key) for blob in net.bottom_vecs[li]]
    waits = {}
    for li in range(len(net.layers)):
        keys = {writer[pid_of[spec.name]] for spec in net.layer_param_specs[li]
                if spec.name in pid_of and pid_of[spec.name] in writer}
        for top in net.top_vecs[li]:
            mine = _span(top)
            keys |= {key for blob, span, key in readers if blob is top or _overlap(span, mine)}
        waits[li] = tuple(sorted(keys))
    return waits


class PendingSyncs:
    """One iteration's syncs in flight: {syncer key: Future}, and the seconds the worker has
    waited on them so far (`exposed_s`; the running of a sync on the training thread counts
    too). on_error(it, exceptions) is called (and must raise) when a waited sync failed."""

    def __init__(self, on_error):
        self._on_error = on_error
        self.it, self.futures = None, {}
        self.exposed_s = 0.0
        self._waited = set()

    def __bool__(self):
        return bool(self.futures)

    def add(self, it, key, future):
        """A sync of iteration `it` started."""
        if not self.futures:
            self.it, self.exposed_s = it, 0.0
        self.futures[key] = future

    def wait_for(self, keys):
        """Block until the syncs of `keys` (those in flight) are done; raise if one failed."""
        futures = [self.futures[k] for k in keys if k in self.futures and k not in self._waited]
        if not futures:
            return
        t0 = time.time()
        done, _ = wait(futures, timeout=None, return_when=FIRST_EXCEPTION)
        self.exposed_s += time.time() - t0
        self._check(futures, done)
        self._waited.update(keys)

    def wait_all(self):
        """Block until every sync in flight is done (raise if one failed); returns (iteration,
        the syncs' results, the seconds this last wait took) and forgets them."""
        futures = list(self.futures.values())
        t0 = time.time()
        done, _ = wait(futures, timeout=None, return_when=FIRST_EXCEPTION)
        t1 = time.time()
        self._check(futures, done)
        self.exposed_s += t1 - t0
        settled = (self.it, [f.result() for f in futures], t1 - t0)
        self.futures, self._waited = {}, set()
        return settled

    def cancel(self):
        """After a failure: cancel the syncs not yet started (the pool is not left blocked on
        them) and forget all of them (a later iteration waits for its own syncs only)."""
        futures, self.futures, self._waited = self.futures, {}, set()
        for f in futures.values():
            f.cancel()

    def _check(self, futures, done):
        errors = [f.exception() for f in futures if f in done and f.exception() is not None]
        if errors:
            # on_error first: it waits for every sync of the iteration to give its NaN/Inf
            # verdict (dist/job/verdicts.py), and a sync still queued on the pool gives none once
            # cancelled; the job stops naming the first bad layer, not the first to fail
            try:
                self._on_error(self.it, errors)
            finally:
                self.cancel()
