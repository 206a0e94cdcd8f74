"""A discrete-event model of one BSP iteration of Poseidon on P1 workers and P2 servers.

Why: the paper's scaling figures were taken on 32 Titan X nodes over 40 GbE; we cannot rerun them,
but we can replay one iteration with the same layer sizes, the same KV pairs and placement
(dist.book / dist.placement), the same scheme choice (Algorithm 1) and the paper's compute times,
and see where the time goes. Everything is an event in one priority queue; every resource is a
first-come-first-served queue:

  gpu[w]            forward and backward of each layer (one after the other), and the SFB rebuild
                    GEMMs, which slot in between backward layers as a CUDA stream would
  d2h[w], h2d[w]    PCIe copies of gradients / factors to the host and of new values back
  up[n], down[n]    each node's NIC, full duplex: a chunk occupies the sender's uplink for
                    bytes/bandwidth; its first bit reaches the receiver's downlink one latency
                    later (cut-through), where it waits its turn and cannot finish before the last
                    bit has crossed; so one chunk alone takes bytes/bandwidth + latency
  cpu[s]            a server adds each pushed KV pair into its accumulator and applies the update
                    when all P1 pushes are in (the BSP counter), then pulls go out to every worker

Sync of a layer starts when its backward is done (WFBP) or when the whole backward pass is done
(no overlap, the paper's Caffe+PS); the iteration ends when every worker has every layer back.
A server on the same node as a worker exchanges with it without touching the NIC. Speedup is
P1 * t_1 / t_P1 with t_1 the one-node compute time (plain Caffe, no sync), as in the paper.
"""
import heapq
import math
import re
from dataclasses import dataclass, field

from .book import InformationBook
from .schemes import best_scheme
from .schemes.ring import ring_plan
from .placement import DEFAULT_PAIR_BYTES

# mode -> (scheme override for the book, WFBP overlap)
MODES = {
    "ps-nooverlap": ("ps", False),       # Caffe+PS: sync after backward, everything through servers
    "wfbp": ("ps", True),                # Caffe+WFBP: overlap, everything through servers
    "poseidon": ("hybrid", True),        # WFBP + HybComm (Algorithm 1 per layer)
    "sfb": ("sfb", True),                # WFBP, every FC layer by SFB
    "allreduce": ("allreduce", True),    # WFBP, every layer by the ring all-reduce (no servers)
    "hybrid-nooverlap": ("hybrid", False),
}


@dataclass
class Network:
    """Link and host figures; rates in bytes/s (math.inf for 'free'), latency in seconds."""
    bandwidth: float = 40e9 / 8
    latency: float = 5e-6
    pcie: float = 12e9                 # PCIe 3.0 x16 as measured in practice, each direction
    update_rate: float = 10e9          # bytes/s a server adds or applies (16-core Xeon, memory bound)
    gemm_rate: float = 6e12            # FLOP/s of the SFB rebuild GEMM (Titan X fp32 peak ~6.6 T)
    chunk_bytes: int = DEFAULT_PAIR_BYTES   # messages cross the wire in pieces of at most this
    kv_pair_bytes: int = DEFAULT_PAIR_BYTES
    separate_servers: bool = False     # servers on their own nodes instead of beside the workers

    @classmethod
    def ideal(cls, **kw):
        """Everything but compute free: the speedup must then be P1."""
        base = dict(bandwidth=math.inf, latency=0.0, pcie=math.inf, update_rate=math.inf,
                    gemm_rate=math.inf)
        base.update(kw)
        return cls(**base)


@dataclass
class Result:
    mode: str
    workers: int
    servers: int
    iteration_s: float
    compute_s: float
    speedup: float
    schemes: dict
    node_bytes_sent: list = field(default_factory=list)
    node_bytes_received: list = field(default_factory=list)
    layer_done_s: dict = field(default_factory=dict)
    backward_done_s: float = 0.0
    events: int = 0

    def as_dict(self):
        return dict(self.__dict__)


# ------------------------------------------------------------------------------------------------
# the event engine and its queues
# ------------------------------------------------------------------------------------------------
class EventQueue:
    def __init__(self):
        self.now = 0.0
        self._heap = []
        self._seq = 0
        self.count = 0

    def at(self, t, action):
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, action))

    def run(self):
        while self._heap:
            t, _, action = heapq.heappop(self._heap)
            self.now = t
            self.count += 1
            action()


class Fifo:
    """One resource serving jobs in arrival order. A job gives finish(start) -> finish time."""

    def __init__(self, events, name):
        self.events, self.name = events, name
        self.queue = []
        self.head = 0
        self.busy = False

    def submit(self, finish, done, on_start=None):
        self.queue.append((finish, done, on_start))
        if not self.busy:
            self._next()

    def _next(self):
        if self.head >= len(self.queue):
            self.busy = False
            return
        finish, done, on_start = self.queue[self.head]
        self.queue[self.head] = None
        self.head += 1
        self.busy = True
        start = self.events.now
        end = finish(start)
        if on_start:
            on_start(start, end)

        def complete():
            done()
            self._next()
        self.events.at(end, complete)


def _after(seconds):
    return lambda start: start + seconds


def _seconds(nbytes, rate):
    return 0.0 if nbytes == 0 or rate == math.inf else nbytes / rate


# ------------------------------------------------------------------------------------------------
# one iteration
# ------------------------------------------------------------------------------------------------
def build_book(profile, workers, servers, sync, kv_pair_bytes=DEFAULT_PAIR_BYTES):
    """The real information book (schemes by Algorithm 1, KV pairs placed by LPT) for a profile."""
    options = {"sync": sync, "kv_pair_bytes": kv_pair_bytes, "sum_gradients": False}
    return InformationBook.build(profile["description"], workers, servers, options)


class _Iteration:
    def __init__(self, profile, workers, mode, net, servers=None):
        if mode not in MODES:
            raise ValueError(f"unknown mode '{mode}' (choose from {', '.join(MODES)})")
        self.sync, self.overlap = MODES[mode]
        self.mode, self.net, self.P1 = mode, net, workers
        self.P2 = workers if servers is None else servers
        self.profile = profile
        self.book = build_book(profile, workers, self.P2, self.sync, net.kv_pair_bytes)
        self.itemsize = self.book.data["itemsize"]
        nodes = workers + (self.P2 if net.separate_servers else 0)
        self.n_nodes = max(nodes, self.P2)
        ev = self.events = EventQueue()
        self.gpu = [Fifo(ev, f"gpu{w}") for w in range(workers)]
        self.d2h = [Fifo(ev, f"d2h{w}") for w in range(workers)]
        self.h2d = [Fifo(ev, f"h2d{w}") for w in range(workers)]
        self.up = [Fifo(ev, f"up{n}") for n in range(self.n_nodes)]
        self.down = [Fifo(ev, f"down{n}") for n in range(self.n_nodes)]
        self.cpu = [Fifo(ev, f"cpu{s}") for s in range(self.P2)]
        self.sent = [0] * self.n_nodes
        self.received = [0] * self.n_nodes
        self.synced = {rec["index"]: rec for rec in self.book.layers}
        self.pending = [[] for _ in range(workers)]
        self.layer_done = [{} for _ in range(workers)]
        self.backward_done = [0.0] * workers
        self.pair_count = {}
        self.got = [{} for _ in range(workers)]
        self.params = {p["id"]: p for p in self.book.params}
        self.ring = {}                       # layer -> each worker's ring progress

    # nodes ------------------------------------------------------------------------------------
    def worker_node(self, w):
        return w

    def server_node(self, s):
        return self.P1 + s if self.net.separate_servers else s

    def transfer(self, src, dst, nbytes, done):
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
            wire = _seconds(size, bw)

            def on_up_start(start, end, wire=wire):
                last_bit = end + lat
                self.events.at(start + lat, lambda: self.down[dst].submit(
                    lambda t0: max(t0 + wire, last_bit), chunk_arrived))
            self.up[src].submit(_after(wire), lambda: None, on_start=on_up_start)

    # compute ----------------------------------------------------------------------------------
    def start(self):
        layers = self.profile["layers"]
        for w in range(self.P1):
            self._forward(w, 0, layers)

    def _forward(self, w, li, layers):
        if li == len(layers):
            self._backward(w, len(layers) - 1, layers)
            return
        self.gpu[w].submit(_after(layers[li]["forward_ms"] / 1e3),
                           lambda: self._forward(w, li + 1, layers))

    def _backward(self, w, li, layers):
        if li < 0:
            self.backward_done[w] = self.events.now
            if not self.overlap:
                for lj in self.pending[w]:
                    self._sync(w, lj)
            return

        def done():
            if li in self.synced:
                if self.overlap:
                    self._sync(w, li)
                else:
                    self.pending[w].append(li)
            self._backward(w, li - 1, layers)
        self.gpu[w].submit(_after(layers[li]["backward_ms"] / 1e3), done)

    # sync -------------------------------------------------------------------------------------
    def _sync(self, w, li):
        rec = self.synced[li]
        if rec["scheme"] == "sfb":
            self._sync_sfb(w, rec)
        elif rec["scheme"] == "allreduce":
            self._sync_ring(w, rec)
        else:
            self._sync_ps(w, rec)

    def _layer_bytes(self, rec):
        return sum(self.params[p]["count"] for p in rec["params"]) * self.itemsize

    def _finish(self, w, li):
        self.layer_done[w][li] = self.events.now

    def _sync_ps(self, w, rec):
        li = rec["index"]
        pairs = self._messages(rec)
        # each worker starts with a different server, so the first pushes do not all land on one
        pairs.sort(key=lambda p: ((p["server"] - w) % self.P2, p["id"]))
        self.got[w][li] = 0
        nbytes = self._layer_bytes(rec)

        def push_all():
            for pair in pairs:
                size = pair["length"] * self.itemsize
                self.transfer(self.worker_node(w), self.server_node(pair["server"]), size,
                              lambda pair=pair, size=size: self._server_add(pair, size, rec))
        self.d2h[w].submit(_after(_seconds(nbytes, self.net.pcie)), push_all)

    def _messages(self, rec):
        """The layer's KV messages (bundles of pairs, as the KV store sends them) as pseudo-pairs:
        id, server and the length of all their pairs."""
        length = {p["id"]: p["length"] for pid in rec["params"]
                  for p in self.book.pairs_of_param(pid)}
        return [{"id": b["id"], "server": b["server"],
                 "length": sum(length[k] for k in b["pairs"])}
                for b in self.book.bundles_of_layer(rec["index"])]

    def _server_add(self, pair, size, rec):
        s = pair["server"]

        def added():
            n = self.pair_count.get(pair["id"], 0) + 1
            self.pair_count[pair["id"]] = n
            if n == self.P1:
                self.cpu[s].submit(_after(_seconds(size, self.net.update_rate)),
                                   lambda: self._pull_all(pair, size, rec))
        self.cpu[s].submit(_after(_seconds(size, self.net.update_rate)), added)

    def _pull_all(self, pair, size, rec):
        s = pair["server"]
        order = sorted(range(self.P1), key=lambda w: (w - pair["id"]) % self.P1)
        for w in order:
            self.transfer(self.server_node(s), self.worker_node(w), size,
                          lambda w=w: self._worker_pulled(w, rec))

    def _worker_pulled(self, w, rec):
        li = rec["index"]
        self.got[w][li] += 1
        if self.got[w][li] == len(self.book.bundles_of_layer(li)):
            self.h2d[w].submit(_after(_seconds(self._layer_bytes(rec), self.net.pcie)),
                               lambda: self._finish(w, li))

    def _sync_sfb(self, w, rec):
        li = rec["index"]
        M, N, K = rec["M"], rec["N"], rec["K"]
        bias = len(rec["params"]) > 1
        factor_bytes = (K * (M + N) + (M if bias else 0)) * self.itemsize
        peers = [(w + d) % self.P1 for d in range(1, self.P1)]
        self.got[w].setdefault(li, 0)

        def send_all():
            for q in peers:
                self.transfer(self.worker_node(w), self.worker_node(q), factor_bytes,
                              lambda q=q: self._factors_in(q, rec, factor_bytes))
            self._factors_in(w, rec, factor_bytes, own=True)
        self.d2h[w].submit(_after(_seconds(factor_bytes, self.net.pcie)), send_all)

    def _factors_in(self, w, rec, factor_bytes, own=False):
        li = rec["index"]
        self.got[w][li] = self.got[w].get(li, 0) + 1
        if self.got[w][li] < self.P1:
            return
        M, N, K = rec["M"], rec["N"], rec["K"]
        # the peers' P1 - 1 rank-K products on top of the local gradient backward already made
        rebuild = _seconds(2.0 * M * N * K * (self.P1 - 1), self.net.gemm_rate)
        self.h2d[w].submit(_after(_seconds(factor_bytes * (self.P1 - 1), self.net.pcie)),
                           lambda: self.gpu[w].submit(_after(rebuild),
                                                      lambda: self._finish(w, li)))

    def _sync_ring(self, w, rec):
        """Ring all-reduce (dist/schemes/allreduce.py): 2·(P1 − 1) steps, each one chunk of the
        layer to the right neighbour, sent once the gradient is on the host and the left
        neighbour's chunk of the step before has come; the adds are not timed (memory speed, far
        below the wire's)."""
        li = rec["index"]
        state = self.ring.setdefault(li, [{"ready": False, "got": 0, "sent": 0}
                                          for _ in range(self.P1)])

        def ready():
            state[w]["ready"] = True
            self._ring_advance(w, rec, state)
        self.d2h[w].submit(_after(_seconds(self._layer_bytes(rec), self.net.pcie)), ready)

    def _ring_advance(self, w, rec, state):
        plan = ring_plan(self._layer_bytes(rec) // self.itemsize, self.P1, 1 << 62)
        steps, me = 2 * (self.P1 - 1), state[w]
        if me["ready"] and me["got"] == steps and "done" not in me:
            me["done"] = True
            self.h2d[w].submit(_after(_seconds(self._layer_bytes(rec), self.net.pcie)),
                               lambda: self._finish(w, rec["index"]))
        while me["ready"] and me["sent"] < steps and me["got"] >= me["sent"]:
            phase, step = divmod(me["sent"], self.P1 - 1)
            nbytes = plan.chunk_floats(plan.sent_chunk(phase, step, w)) * self.itemsize
            right = (w + 1) % self.P1
            me["sent"] += 1

            def arrived(right=right):
                state[right]["got"] += 1
                self._ring_advance(right, rec, state)
            self.transfer(self.worker_node(w), self.worker_node(right), nbytes, arrived)

    # result -----------------------------------------------------------------------------------
    def run(self):
        self.start()
        self.events.run()
        for w in range(self.P1):
            missing = set(self.synced) - set(self.layer_done[w])
            if missing:
                raise RuntimeError(f"simulation ended with worker {w} still waiting for layers "
                                   f"{sorted(missing)} (a bug in dist/simulate.py)")
        ends = [max([self.backward_done[w]] + list(self.layer_done[w].values()))
                for w in range(self.P1)]
        t = max(ends)
        compute = compute_seconds(self.profile)
        return Result(mode=self.mode, workers=self.P1, servers=self.P2, iteration_s=t,
                      compute_s=compute, speedup=self.P1 * compute / t if t > 0 else float(self.P1),
                      schemes={rec["name"]: rec["scheme"] for rec in self.book.layers},
                      node_bytes_sent=list(self.sent), node_bytes_received=list(self.received),
                      layer_done_s={self.synced[li]["name"]: v
                                    for li, v in self.layer_done[0].items()},
                      backward_done_s=self.backward_done[0], events=self.events.count)


def compute_seconds(profile):
    return sum(r["forward_ms"] + r["backward_ms"] for r in profile["layers"]) / 1e3


def simulate(profile, workers, mode="poseidon", net=None, servers=None):
    """One iteration of `profile` on `workers` nodes in `mode`; returns a Result."""
    if workers < 1:
        raise ValueError(f"the number of workers must be at least 1, got {workers}")
    if servers is not None and servers < 1:
        raise ValueError(f"the number of servers must be at least 1, got {servers}")
    return _Iteration(profile, workers, mode, net or Network(), servers).run()


def scaling_table(profile, nodes, modes, net=None, servers=None):
    """{mode: {P: Result}} for every mode and node count."""
    return {mode: {p: simulate(profile, p, mode, net, servers) for p in nodes} for mode in modes}


def algorithm1_schemes(profile, workers, servers, sync="hybrid"):
    """What BestScheme (dist/schemes/best.py) says for each synced layer (to check the simulator uses it)."""
    return {rec["name"]: best_scheme(rec["sfb"], rec["M"], rec["N"], rec["K"], workers, servers,
                                     sync)
            for rec in profile["description"]["layers"]}


# ------------------------------------------------------------------------------------------------
# parsing user figures
# ------------------------------------------------------------------------------------------------
_BITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text):
    """'40Gbit', '10GbE', '10Gbps', '10Gb/s' (bits) or '1.25GB/s', '5GByte/s' (bytes), 'inf'
    -> bytes per second. A lower-case b means bits, an upper-case B bytes."""
    s = str(text).strip().replace(" ", "")
    if s.lower() in ("inf", "infinite", "unlimited"):
        return math.inf
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)([kKmMgGtT]?)"
                     r"(bit|bits|bit/s|bits/s|bps|b/s|bE|B/s|B|Byte/s|byte/s)", s)
    if not m:
        raise ValueError(f"cannot read the bandwidth '{text}': give e.g. 40Gbit, 10GbE, "
                         f"1.25GB/s or inf")
    value = float(m.group(1)) * _BITS[m.group(2).lower()]
    if not m.group(3).startswith("B") and not m.group(3).startswith("Byte"):
        value /= 8.0
    if value <= 0:
        raise ValueError(f"the bandwidth must be positive, got '{text}'")
    return value


def parse_latency(text):
    """'5us', '0.1ms', '0', '1e-6s' -> seconds."""
    s = str(text).strip().lower().replace(" ", "").replace("µ", "u")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(ns|us|ms|s)?", s)
    if not m:
        raise ValueError(f"cannot read the latency '{text}': give e.g. 5us, 0.1ms or 0")
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]
    return float(m.group(1)) * scale
