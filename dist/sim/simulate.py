"""A discrete-event model of one BSP iteration of Poseidon on P1 nodes and P2 servers.

Why: the paper's scaling figures were taken on 32 Titan X nodes over 40 GbE; we cannot rerun them,
but we can replay one iteration with the same layer sizes, the same KV pairs and placement
(dist.book / dist.placement), the same scheme choice (Algorithm 1) and the paper's compute times,
and see where the time goes; and we can try what the paper did not (ring all-reduce, a choice by
predicted time, priority, several devices per node). Everything is an event in one priority
queue; every resource is a queue (dist/sim/engine.py):

  gpu[w]            forward and backward of each layer (one after the other), and the SFB rebuild
                    and all-reduce's reduction GEMMs, which slot in between backward layers as a
                    CUDA stream would
  d2h[w], h2d[w]    PCIe copies of gradients / factors to the host and of new values back
  intra[w]          with G devices per node, the link the G replicas reduce over into the node's
                    leader (and the leader broadcasts back over); the leader is the node's worker
  up[n], down[n]    each node's NIC, full duplex: a chunk occupies the sender's uplink for
                    bytes/bandwidth; its first bit reaches the receiver's downlink one latency
                    later (cut-through), where it waits its turn and cannot finish before the last
                    bit has crossed; so one chunk alone takes bytes/bandwidth + latency
  cpu[s]            a server adds each pushed KV pair into its accumulator and applies the update
                    when all P1 pushes are in (the BSP counter), then pulls go out to every worker

Sync of a layer starts when its backward is done (WFBP) or when the whole backward pass is done
(no overlap, the paper's Caffe+PS). The iteration ends when every worker has every layer back;
with priority (ps-sfb-ar-priority) the next forward instead runs layer by layer, each layer as
soon as its own sync is in, and the iteration's time is when that forward ends less its own
length: serving lower layers first is what lets it start early. A server on the same node as a
worker exchanges with it without touching the NIC. The records a run is given and gives back (modes,
the network's figures, the result) are in modes.py.
Speedup is P1 * G * t_1 / t_P1 with t_1 the one-device compute time (plain Caffe, no sync), as in
the paper.
"""
import dataclasses

from ..coord.book import InformationBook
from ..coord.placement import DEFAULT_PAIR_BYTES
from .cost import (Shape, algorithm1_plan, candidate_plans, compute_seconds, factor_bytes,
                      intra_bytes, profile_flop_rate, rebuild_flops, reduction_flops, ring_bytes,
                      ring_steps, single_scheme_plan)
from .engine import EventQueue, Fifo, after, seconds
from .modes import MODES, Network, Result
from .systems import resolve


def build_book(profile, workers, servers, sync, kv_pair_bytes=DEFAULT_PAIR_BYTES, layers=None):
    """The real information book (schemes by Algorithm 1, KV pairs placed by LPT) for a profile;
    `layers`: only these synced layers (the others sync without servers)."""
    desc = profile["description"]
    if layers is not None:
        desc = dict(desc, layers=layers)
    options = {"sync": sync, "kv_pair_bytes": kv_pair_bytes, "sum_gradients": False}
    return InformationBook.build(desc, workers, servers, options)


@dataclasses.dataclass(frozen=True)
class KVMessage:
    """A bundle as the model moves it: its id, its server, the elements of all its pairs."""
    id: int
    server: int
    length: int


# ------------------------------------------------------------------------------------------------
# one iteration
# ------------------------------------------------------------------------------------------------
class _Iteration:
    def __init__(self, profile, workers, mode, net, servers, devices, plan):
        self.mode, self.net, self.P1, self.G = mode, net, workers, devices
        self.how = MODES[mode]
        self.P2 = workers if servers is None else servers
        self.shape = Shape(workers, self.P2, devices, net.separate_servers)
        self.profile = profile
        self.flop_rate = net.gemm_rate if net.gemm_rate is not None else profile_flop_rate(profile)
        self.plan = plan
        records = profile["description"]["layers"]
        ps_layers = [rec for rec in records if plan[rec.index] == "ps"]
        self.book = build_book(profile, workers, self.P2, "ps", net.kv_pair_bytes, ps_layers)
        self.itemsize = self.book.data["itemsize"]
        nodes = workers + (self.P2 if net.separate_servers else 0)
        self.n_nodes = max(nodes, self.P2)
        ev = self.events = EventQueue()

        def queues(name, n):
            return [Fifo(ev, f"{name}{i}", self.how.priority) for i in range(n)]
        self.gpu, self.d2h, self.h2d, self.intra = (queues(q, workers)
                                                    for q in ("gpu", "d2h", "h2d", "intra"))
        self.up, self.down = queues("up", self.n_nodes), queues("down", self.n_nodes)
        self.cpu = queues("cpu", self.P2)
        self.sent = [0] * self.n_nodes
        self.received = [0] * self.n_nodes
        self.synced = {rec.index: rec for rec in records}
        self.params = {p.id: p for p in profile["description"]["params"]}
        self.pending = [[] for _ in range(workers)]
        self.layer_done = [{} for _ in range(workers)]
        self.backward_done = [None] * workers
        self.next_forward = [[0, False, 0.0] for _ in range(workers)]   # layer, running, end
        self.pair_count = {}
        self.ring_ready = {}
        self.got = [{} for _ in range(workers)]

    # nodes ------------------------------------------------------------------------------------
    def worker_node(self, w):
        return w

    def server_node(self, s):
        return self.P1 + s if self.net.separate_servers else s

    def transfer(self, src, dst, nbytes, done, priority=0):
        """Send nbytes from node src to node dst in chunks; done() when the last one arrives."""
        if src == dst or nbytes == 0:
            done()
            return
        self.sent[src] += nbytes
        self.received[dst] += nbytes
        bw, lat = self.net.bandwidth, self.net.latency
        sizes = [self.net.chunk_bytes] * (nbytes // self.net.chunk_bytes)
        if nbytes % self.net.chunk_bytes:
            sizes.append(nbytes % self.net.chunk_bytes)
        left = [len(sizes)]

        def chunk_arrived():
            left[0] -= 1
            if left[0] == 0:
                done()

        for size in sizes:
            wire = seconds(size, bw)

            def on_up_start(start, end, wire=wire):
                last_bit = end + lat
                self.events.at(start + lat, lambda: self.down[dst].submit(
                    lambda t0: max(t0 + wire, last_bit), chunk_arrived, priority=priority))
            self.up[src].submit(after(wire), lambda: None, on_start=on_up_start,
                                priority=priority)

    # compute ----------------------------------------------------------------------------------
    def start(self):
        layers = self.profile["layers"]
        for w in range(self.P1):
            self._forward(w, 0, layers)

    def _forward(self, w, li, layers):
        if li == len(layers):
            self._backward(w, len(layers) - 1, layers)
            return
        self.gpu[w].submit(after(layers[li]["forward_ms"] / 1e3),
                           lambda: self._forward(w, li + 1, layers), priority=li)

    def _backward(self, w, li, layers):
        if li < 0:
            self.backward_done[w] = self.events.now
            if not self.how.overlap:
                for lj in self.pending[w]:
                    self._sync(w, lj)
            self._forward_again(w)
            return

        def done():
            if li in self.synced:
                if self.how.overlap:
                    self._sync(w, li)
                else:
                    self.pending[w].append(li)
            self._backward(w, li - 1, layers)
        self.gpu[w].submit(after(layers[li]["backward_ms"] / 1e3), done, priority=li)

    def _forward_again(self, w):
        """The next iteration's forward, layer by layer, each once its own sync is in (in a mode
        with `layerwise`; the others end at the barrier)."""
        state = self.next_forward[w]
        layers = self.profile["layers"]
        li, running = state[0], state[1]
        if (not self.how.layerwise or running or li == len(layers)
                or self.backward_done[w] is None
                or (li in self.synced and li not in self.layer_done[w])):
            return
        state[1] = True

        def done():
            state[0], state[1], state[2] = li + 1, False, self.events.now
            self._forward_again(w)
        self.gpu[w].submit(after(layers[li]["forward_ms"] / 1e3), done, priority=li)

    # sync -------------------------------------------------------------------------------------
    def _layer_bytes(self, rec):
        return sum(self.params[p].count for p in rec.params) * self.itemsize

    def _one_factor_bytes(self, rec):
        return rec.K * (rec.M + rec.N) * self.itemsize

    def _local(self, w, rec, which, then):
        """The node-local step before (0) or after (1) a layer's sync, when G devices share it."""
        nbytes = intra_bytes(self.plan[rec.index], self._layer_bytes(rec),
                             self._one_factor_bytes(rec), self.shape)[which]
        if nbytes == 0:
            then()
            return
        self.intra[w].submit(after(seconds(nbytes, self.net.intra_bandwidth)), then,
                             priority=rec.index)

    def _sync(self, w, li):
        rec = self.synced[li]
        go = {"ps": self._sync_ps, "sfb": self._sync_sfb,
              "allreduce": self._sync_allreduce}[self.plan[li]]
        self._local(w, rec, 0, lambda: go(w, rec))

    def _finish(self, w, li):
        def record():
            self.layer_done[w][li] = self.events.now
            self._forward_again(w)
        self._local(w, self.synced[li], 1, record)

    def _sync_ps(self, w, rec):
        li = rec.index
        pairs = self._messages(rec)
        # each worker starts with a different server, so the first pushes do not all land on one
        pairs.sort(key=lambda p: ((p.server - w) % self.P2, p.id))
        self.got[w][li] = 0
        nbytes = self._layer_bytes(rec)

        def push_all():
            for pair in pairs:
                size = pair.length * self.itemsize
                self.transfer(self.worker_node(w), self.server_node(pair.server), size,
                              lambda pair=pair, size=size: self._server_add(pair, size, rec),
                              priority=li)
        self.d2h[w].submit(after(seconds(nbytes, self.net.pcie)), push_all, priority=li)

    def _messages(self, rec):
        """The layer's KV messages (bundles of pairs, as the KV store sends them), each moved as
        one pair of the length of all its pairs."""
        length = {p.id: p.length for pid in rec.params
                  for p in self.book.pairs_of_param(pid)}
        return [KVMessage(id=b.id, server=b.server, length=sum(length[k] for k in b.pairs))
                for b in self.book.bundles_of_layer(rec.index)]

    def _server_add(self, pair, size, rec):
        s, li = pair.server, rec.index

        def added():
            n = self.pair_count.get(pair.id, 0) + 1
            self.pair_count[pair.id] = n
            if n == self.P1:
                self.cpu[s].submit(after(seconds(size, self.net.update_rate)),
                                   lambda: self._pull_all(pair, size, rec), priority=li)
        self.cpu[s].submit(after(seconds(size, self.net.update_rate)), added, priority=li)

    def _pull_all(self, pair, size, rec):
        s = pair.server
        order = sorted(range(self.P1), key=lambda w: (w - pair.id) % self.P1)
        for w in order:
            self.transfer(self.server_node(s), self.worker_node(w), size,
                          lambda w=w: self._worker_pulled(w, rec), priority=rec.index)

    def _worker_pulled(self, w, rec):
        li = rec.index
        self.got[w][li] += 1
        if self.got[w][li] == len(self.book.bundles_of_layer(li)):
            self.h2d[w].submit(after(seconds(self._layer_bytes(rec), self.net.pcie)),
                               lambda: self._finish(w, li), priority=li)

    def _sync_sfb(self, w, rec):
        li = rec.index
        fbytes = factor_bytes(rec, self.G, self.itemsize)
        peers = [(w + d) % self.P1 for d in range(1, self.P1)]
        self.got[w].setdefault(li, 0)

        def send_all():
            for q in peers:
                self.transfer(self.worker_node(w), self.worker_node(q), fbytes,
                              lambda q=q: self._factors_in(q, rec, fbytes), priority=li)
            self._factors_in(w, rec, fbytes)
        self.d2h[w].submit(after(seconds(fbytes, self.net.pcie)), send_all, priority=li)

    def _factors_in(self, w, rec, fbytes):
        li = rec.index
        self.got[w][li] = self.got[w].get(li, 0) + 1
        if self.got[w][li] < self.P1:
            return
        # the other replicas' rank-K products on top of the local gradient backward already made
        rebuild = seconds(rebuild_flops(rec, self.P1 * self.G), self.flop_rate)
        self.h2d[w].submit(after(seconds(fbytes * (self.P1 - 1), self.net.pcie)),
                           lambda: self.gpu[w].submit(after(rebuild), lambda: self._finish(w, li),
                                                      priority=li), priority=li)

    def _sync_allreduce(self, w, rec):
        """Ring all-reduce: it starts when every node holds the layer's gradient; each node sends
        2·(P1−1)/P1 of the layer to its right-hand neighbour. The 2·(P1−1) steps are one stream
        per link here (the ring pipelines them), which keeps the bytes and the step count's
        latencies but not each step's wait for the slowest link."""
        li = rec.index
        staged = min(self._layer_bytes(rec), self.net.chunk_bytes)

        def ready():
            self.ring_ready[li] = self.ring_ready.get(li, 0) + 1
            if self.ring_ready[li] == self.P1:
                self._ring(rec, staged)
        # the ring streams through pinned host buffers: one chunk's copy is not hidden
        self.d2h[w].submit(after(seconds(staged, self.net.pcie)), ready, priority=li)

    def _ring(self, rec, staged):
        li, P1 = rec.index, self.P1
        count = sum(self.params[p].count for p in rec.params)
        reduce_s = seconds(reduction_flops(count, P1), self.flop_rate)
        left = [P1]

        def update_everywhere():
            for v in range(P1):
                self.h2d[v].submit(
                    after(seconds(staged, self.net.pcie)),
                    lambda v=v: self.gpu[v].submit(after(reduce_s), lambda v=v: self._finish(v, li),
                                                   priority=li), priority=li)

        def arrived():
            left[0] -= 1
            if left[0] == 0:
                # the transfer carried one latency; the other steps each add theirs
                extra = (ring_steps(P1) - 1) * self.net.latency
                self.events.at(self.events.now + extra, update_everywhere)
        if P1 < 2:
            update_everywhere()
            return
        nbytes = ring_bytes(self._layer_bytes(rec), P1)
        for v in range(P1):
            self.transfer(self.worker_node(v), self.worker_node((v + 1) % P1), nbytes, arrived,
                          priority=li)

    # result -----------------------------------------------------------------------------------
    def run(self):
        self.start()
        self.events.run()
        for w in range(self.P1):
            missing = set(self.synced) - set(self.layer_done[w])
            if missing:
                raise RuntimeError(f"simulation ended with worker {w} still waiting for layers "
                                   f"{sorted(missing)} (a bug in dist/sim/simulate.py)")
        forward = sum(r["forward_ms"] for r in self.profile["layers"]) / 1e3
        if self.how.layerwise:
            ends = [state[2] - forward for state in self.next_forward]
        else:
            ends = [max([self.backward_done[w]] + list(self.layer_done[w].values()))
                    for w in range(self.P1)]
        t = max(ends)
        compute = compute_seconds(self.profile)
        replicas = self.P1 * self.G
        names = {rec.index: rec.name for rec in self.synced.values()}
        return Result(mode=self.mode, workers=self.P1, servers=self.P2, iteration_s=t,
                      compute_s=compute, devices=self.G,
                      speedup=replicas * compute / t if t > 0 else float(replicas),
                      schemes={names[li]: s for li, s in sorted(self.plan.items())},
                      node_bytes_sent=list(self.sent), node_bytes_received=list(self.received),
                      layer_done_s={names[li]: v for li, v in self.layer_done[0].items()},
                      backward_done_s=self.backward_done[0], events=self.events.count)


# ------------------------------------------------------------------------------------------------
# modes, plans and tables
# ------------------------------------------------------------------------------------------------
def mode_plan(profile, workers, mode, servers=None, devices=1):
    """{layer index: scheme} of a mode that does not choose by time."""
    kind = MODES[mode].plan
    if kind == "hybrid":
        return algorithm1_plan(profile, workers, workers if servers is None else servers, devices)
    return single_scheme_plan(profile, kind)


def simulate(profile, workers, mode="poseidon", net=None, servers=None, devices=1):
    """One iteration of `profile` on `workers` nodes of `devices` devices each, in `mode`.

    A by-time mode runs every candidate plan (candidate_plans) and keeps the fastest: the
    per-layer prediction is coarse, and a plan the model shows slower than one scheme
    everywhere must not be the one chosen (as a live job could time one iteration of each)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode '{mode}' (choose from {', '.join(MODES)})")
    for what, value in (("workers", workers), ("devices per node", devices)):
        if value < 1:
            raise ValueError(f"the number of {what} must be at least 1, got {value}")
    if servers is not None and servers < 1:
        raise ValueError(f"the number of servers must be at least 1, got {servers}")
    net = resolve(net or Network(), MODES[mode].system)
    if MODES[mode].plan != "timed":
        plan = mode_plan(profile, workers, mode, servers, devices)
        return _run(profile, workers, mode, net, servers, devices, plan, "")
    best = None
    for name, plan in candidate_plans(profile, workers, net, servers, devices):
        r = _run(profile, workers, mode, net, servers, devices, plan, name)
        if best is None or r.iteration_s < best.iteration_s:
            best = r
    return best


# A by-time mode runs the single-scheme plans again, and a table asks for them as modes too: one
# run of each (profile, shape, network, plan, queueing) is enough. The profile is kept with its
# result so that its id cannot be reused while the entry lives; profiles are read, never changed,
# once loaded.
_RUNS = {}
_RUNS_KEPT = 512


def _run(profile, workers, mode, net, servers, devices, plan, plan_name):
    how = MODES[mode]
    key = (id(profile), workers, how.overlap, how.priority, how.layerwise,
           dataclasses.astuple(net), servers, devices, tuple(sorted(plan.items())))
    hit = _RUNS.get(key)
    if hit is None or hit[0] is not profile:
        if len(_RUNS) >= _RUNS_KEPT:
            _RUNS.clear()
        hit = _RUNS[key] = (profile, _Iteration(profile, workers, mode, net, servers, devices,
                                                plan).run())
    return dataclasses.replace(hit[1], mode=mode, plan=plan_name)


def scaling_table(profile, nodes, modes, net=None, servers=None, devices=1):
    """{mode: {P: Result}} for every mode and node count."""
    return {mode: {p: simulate(profile, p, mode, net, servers, devices) for p in nodes}
            for mode in modes}
