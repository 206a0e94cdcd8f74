"""A worker's part of the measured cost model: probe, report, take the published schemes, move
solver history when a layer changes scheme.

The protocol (docs/decisions.md: "The measured cost model's choices take effect one refresh
window after they are reported", and the refresh rules after it):
- At the start of a run (and again after a restore) every worker probes its links
  (dist/cost/probe.py) and reports to the coordinator, which answers every worker with every layer's
  scheme from the start iteration on; each waits for that answer before the first iteration, so
  the replicas are initialised for the schemes they will run.
- Every N iterations (--cost-refresh N; after the iteration it with (it + 1) % N == 0) each
  worker reports the median sync seconds of each layer over that window. The coordinator answers
  with choices effective from it + 1 + N: one whole window later, which every worker reaches
  after the answer was sent, and by which time the answer has almost always arrived; a worker
  that reaches it first waits for it there, so no rank ever runs an iteration on other schemes
  than the others.
- When a layer's scheme changes at iteration e, its solver history moves with it before the
  iteration starts: from a scheme with servers to one without, every worker fetches the layer's
  history from the servers (which keep it); the other way, worker 0 gives the servers its values
  and history (a KV_INIT of the layer's pairs, as at the start), and the workers wait at a barrier
  so that no push of iteration e reaches a server before them.
"""
import logging
import statistics

from poseidon.engine import backend

from .probe import Prober
from ..worker.replicas import host_flat
from ..schemes import scheme_class

log = logging.getLogger("poseidon")


def _uses_servers(name):
    return name is not None and scheme_class(name).uses_servers


class CostSync:
    """The measured model on one worker (idle on a book of the static model)."""

    def __init__(self, book, client, kv, transport, roles, refresh, slow):
        self.book, self.client, self.kv = book, client, kv
        self.transport, self.roles = transport, roles
        self.rank = transport.rank
        self.active = book.measured
        self.refresh = max(1, int(refresh or 1))
        self.slow = slow
        self.prober = Prober(transport, roles)
        self.predicted = {}            # {layer: {scheme: seconds}} of the last publish
        self.observed = {}             # {layer: median sync seconds} of the last complete window
        self._window = {}              # {layer: [seconds of each iteration]} of the window measured
        self._due = {}                 # {iteration: report call} whose answer takes effect there
        self._told = False             # worker 0 has logged the first choices

    def start(self, it, net):
        """Probe, report, and take the choices in force from iteration `it` (the run's first)."""
        if not self.active:
            return
        self._due, self._window = {}, {}
        call = self.client.report_costs(self.prober.report(net.dtype, net.xp), it)
        self._take(self.client.published(call, timeout=self.slow))

    def _take(self, obj):
        start = obj["from"]
        before = {rec.index: self.book.best_scheme(rec.index, start)
                  for rec in self.book.layers}
        self.book.publish(start, {int(li): n for li, n in obj["choices"].items()})
        self.predicted = {int(li): p for li, p in (obj.get("predicted") or {}).items()}
        if self.rank != 0:
            return
        for rec in self.book.layers:
            li = rec.index
            now = self.book.best_scheme(li, start)
            seconds = self.predicted_seconds(li, now)
            if now != before[li] or not self._told:
                log.info(f"  from iteration {start}: {rec.name} -> {now.upper()}"
                         f"{f' (predicted {seconds * 1e3:.3g} ms)' if seconds else ''}"
                         f"{f', was {before[li].upper()}' if now != before[li] else ''}")
        self._told = True

    def predicted_seconds(self, li, scheme):
        return (self.predicted.get(li) or {}).get(scheme)

    def due(self, it):
        """Whether published choices take effect at iteration `it` (before_iteration then moves
        history, which needs every sync of the iteration before it finished)."""
        return it in self._due

    def before_iteration(self, it, net, history):
        """At an iteration where published choices take effect: take them, move the history of
        the layers that change scheme."""
        call = self._due.pop(it, None)
        if call is None:
            return
        layers = [rec.index for rec in self.book.layers]
        old = {li: self.book.best_scheme(li, it) for li in layers}
        self._take(self.client.published(call, timeout=self.slow))
        moved = [li for li in layers if self.book.best_scheme(li, it) != old[li]]
        off_servers = [li for li in moved if _uses_servers(old[li])
                       and not _uses_servers(self.book.best_scheme(li, it))]
        onto_servers = [li for li in moved if not _uses_servers(old[li])
                        and _uses_servers(self.book.best_scheme(li, it))]
        if off_servers:
            self._history_from_servers(off_servers, net, history)
        if onto_servers:
            if self.rank == 0:
                self._state_to_servers(onto_servers, it, net, history)
            self.client.barrier("scheme-switch", timeout=self.slow)

    def _params(self, layers):
        return [p.id for p in self.book.params if p.scheme is not None
                and p.layer in layers]

    def _history_from_servers(self, layers, net, history):
        pids = self._params(layers)
        counts = {pid: net.learnable_params[pid].count for pid in pids}
        hosts = self.kv.fetch_state(counts, net.dtype, lambda pid: len(history[pid]), pids=pids)
        for pid, (_, *arrays) in hosts.items():
            for h, host in zip(history[pid], arrays):
                h[...] = backend.to_xp(host.reshape(h.shape), backend.get_array_module(h))

    def _state_to_servers(self, layers, it, net, history):
        pids = set(self._params(layers))
        self.kv.init(it, lambda pid: [host_flat(net.learnable_params[pid].data)] +
                     [host_flat(h) for h in history[pid]],
                     pairs=[p for p in self.book.pairs if p.param in pids])

    def after_iteration(self, it, stats):
        """Add the iteration's sync times to the window; at its end, report it: each layer's
        median over the window (an iteration the OS or a neighbour stalled moves it little)."""
        if not self.active:
            return
        for st in stats:
            self._window.setdefault(st.layer, []).append(st.seconds)
        if (it + 1) % self.refresh:
            return
        self.observed = {li: statistics.median(s) for li, s in self._window.items() if s}
        self._window = {}
        start = it + 1 + self.refresh
        self._due[start] = self.client.report_costs(
            {"observed": {str(li): s for li, s in self.observed.items()}}, start)
