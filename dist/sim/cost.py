"""Predicted time of one layer's sync under each scheme, the per-layer plan built from it, and the
other whole plans `poseidon simulate` runs (one scheme everywhere, the paper's Algorithm 1).

Why: Algorithm 1 (dist/schemes/best.py) compares float counts on the busiest node, which ignores
what a scheme costs besides the wire: SFB's rebuild GEMM (2·M·N·K per peer, on every worker),
the parameter server's host copies and CPU work, all-reduce's 2·(P1−1) message latencies. On a
fast network that makes it send VGG19-22K's FC layers by SFB although PS, hidden under the
backward pass, is faster. Here each scheme's cost is a time, on two resources a sync occupies:

  link   latency · messages + bytes on the busiest node's link / bandwidth, plus the host work on
         the way (PCIe copies, the servers' adds and update, a node's local reduce over
         --intra-bandwidth when G devices share it)
  gpu    the SFB rebuild, or all-reduce's reduction and update, at the device's FLOP rate

and the plan walks the backward pass from the top, giving each layer the scheme that ends the
iteration soonest given what the layers above already hold (dist/sim/simulate.py then checks the
plan against the single-scheme plans; see docs/simulate.md). The byte and FLOP counts are the
discrete-event model's own: it calls these same functions.
"""
from dataclasses import dataclass

from ..cost.formulas import ps_cost, sfb_cost
from .systems import POSEIDON, resolve

SCHEMES = ("ps", "sfb", "allreduce")
# the plans a by-time choice is checked against: one scheme everywhere it applies
SINGLE_SCHEME_PLANS = ("ps", "allreduce", "sfb")
# The SFB rebuild's FLOP rate for a profile that states no FLOPs (a measured one): a Titan X's
# fp32 peak is 6.6 TFLOP/s, and big GEMMs come close to it.
DEFAULT_GEMM_RATE = 6e12
# FLOPs a worker spends per parameter applying momentum SGD (scale, add, scale, add): all-reduce
# updates on every worker instead of on the servers.
UPDATE_FLOPS = 4


@dataclass(frozen=True)
class Shape:
    """The job's shape: P1 nodes (one worker, or one leader of G devices, each), P2 servers."""
    nodes: int
    servers: int
    devices: int = 1
    separate_servers: bool = False


@dataclass(frozen=True)
class LayerTime:
    link: float
    gpu: float

    @property
    def total(self):
        return self.link + self.gpu


# ------------------------------------------------------------------------------------------------
# bytes and FLOPs, shared with the discrete-event model
# ------------------------------------------------------------------------------------------------
def has_bias(rec):
    return len(rec.params) > 1


def factor_bytes(rec, devices, itemsize):
    """One node's SFB message: the K rows of (M + N) factors of each of its devices, and the
    layer's bias gradient (M floats, summed on the node)."""
    M, N, K = rec.M, rec.N, rec.K
    return (devices * K * (M + N) + (M if has_bias(rec) else 0)) * itemsize


def rebuild_flops(rec, replicas):
    """Each device rebuilds the weight gradient from the other replicas' factors."""
    return 2.0 * rec.M * rec.N * rec.K * (replicas - 1)


def ring_bytes(nbytes, members):
    """What each member of a ring all-reduce sends (and receives): 2·(P−1)/P of the layer."""
    return 0 if members < 2 else 2 * (members - 1) * nbytes // members


def ring_steps(members):
    return 0 if members < 2 else 2 * (members - 1)


def reduction_flops(count, members):
    """A ring member adds (P−1)/P of the layer's elements, then updates every parameter."""
    return (members - 1) / members * count + UPDATE_FLOPS * count


def intra_bytes(scheme, nbytes, fbytes_one, shape):
    """(before, after) bytes over a node's intra-node link when G devices sit behind one leader:
    a local ring reduce into the leader and its broadcast back for PS and all-reduce; for SFB the
    G−1 local factor sets gathered, then the remote nodes' sets handed to each device."""
    G = shape.devices
    if G < 2:
        return 0, 0
    if scheme == "sfb":
        return (G - 1) * fbytes_one, (shape.nodes - 1) * G * fbytes_one
    local = ring_bytes(nbytes, G)
    return local, local


def ps_link_bytes(nbytes, shape):
    """Bytes one direction of the busiest node's link carries for a layer under PS (Table 1's
    2·M·N·(P1+P2−2)/P2 both ways when the servers sit beside the workers)."""
    P1, P2 = shape.nodes, shape.servers
    if shape.separate_servers:
        return P1 * nbytes / P2
    return nbytes * (P1 + P2 - 2) / P2


def paper_scheme(rec, P1, P2, devices=1):
    """Algorithm 1 as the paper states it: SFB where it applies and Table 1's float count on the
    busiest node, 2·K·(P1−1)·(M+N), is at most PS's 2·M·N·(P1+P2−2)/P2; PS elsewhere. A node's
    SFB message carries its G devices' rows."""
    M, N, K = rec.M, rec.N, rec.K * devices
    return "sfb" if rec.sfb and sfb_cost(M, N, K, P1) <= ps_cost(M, N, P1, P2) else "ps"


# ------------------------------------------------------------------------------------------------
# one layer's predicted time
# ------------------------------------------------------------------------------------------------
def layer_times(rec, nbytes, count, shape, net, flop_rate, itemsize):
    """{scheme: LayerTime} for the schemes that can sync the layer `rec` (a LayerRecord); figures
    `net` leaves open are Poseidon's, whose engine runs the by-time modes."""
    net = resolve(net, POSEIDON)
    P1, G = shape.nodes, shape.devices
    lat, bw = net.latency, net.bandwidth

    def wire(n):
        return 0.0 if n == 0 else n / bw

    def host(n, rate):
        return 0.0 if n == 0 else n / rate

    def local(scheme, fbytes_one=0):
        before, after = intra_bytes(scheme, nbytes, fbytes_one, shape)
        return host(before + after, net.intra_bandwidth)

    out = {}
    ps_bytes = ps_link_bytes(nbytes, shape)
    out["ps"] = LayerTime(
        link=(2 * lat if ps_bytes else 0.0) + wire(ps_bytes) + host(2 * nbytes, net.pcie)
        + host((P1 + 1) * nbytes / shape.servers, net.update_rate) + local("ps"),
        gpu=0.0)
    ar_bytes = ring_bytes(nbytes, P1)
    staged = min(nbytes, net.chunk_bytes)
    out["allreduce"] = LayerTime(
        link=ring_steps(P1) * lat + wire(ar_bytes) + host(2 * staged, net.pcie)
        + local("allreduce"),
        gpu=host(reduction_flops(count, P1), flop_rate))
    if rec.sfb:
        f = factor_bytes(rec, G, itemsize)
        one = rec.K * (rec.M + rec.N) * itemsize
        out["sfb"] = LayerTime(
            link=(lat if P1 > 1 else 0.0) + wire((P1 - 1) * f) + host(P1 * f, net.pcie)
            + local("sfb", one),
            gpu=host(rebuild_flops(rec, P1 * G), flop_rate))
    return out


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
def plan_by_time(records, times, backward_end, compute_end):
    """{layer index: scheme}. `records`: the synced layers; `times`: {index: {scheme: LayerTime}};
    `backward_end`: {index: when that layer's backward ends on one device, no sync}; `compute_end`:
    when the whole backward ends.

    Backward order, top layer first. The network is one queue, the GPU another: a layer's sync
    starts when its backward is done and the link is free, and GPU work (rebuild, reduction)
    pushes the rest of the backward back. Each layer takes the scheme whose predicted iteration
    end is soonest: the later of the GPU's end (backward plus all GPU work so far) and the link's
    end (this layer's sync plus, at best, the cheapest sync of every layer below); ties go to
    the scheme with less time of its own, then to the order of SCHEMES."""
    order = sorted(records, key=lambda r: -r.index)
    cheapest = {rec.index: min(t.total for t in times[rec.index].values()) for rec in order}
    below = {}
    rest = 0.0
    for rec in reversed(order):
        below[rec.index] = rest
        rest += cheapest[rec.index]
    link_free, gpu_extra, plan = 0.0, 0.0, {}
    for rec in order:
        li = rec.index
        ready = backward_end[li] + gpu_extra
        start = max(link_free, ready)

        def predicted_end(item):
            name, t = item
            gpu_end = compute_end + gpu_extra + t.gpu
            link_end = start + t.link + t.gpu + below[li]
            return (max(gpu_end, link_end), t.total, SCHEMES.index(name))
        name, t = min(times[li].items(), key=predicted_end)
        plan[li] = name
        link_free = start + t.link
        gpu_extra += t.gpu
    return plan


# ------------------------------------------------------------------------------------------------
# whole plans: {layer index: scheme}
# ------------------------------------------------------------------------------------------------
def compute_seconds(profile):
    """One device's step: every layer's forward and backward."""
    return sum(r["forward_ms"] + r["backward_ms"] for r in profile["layers"]) / 1e3


def profile_flop_rate(profile):
    """FLOP/s the profile's device reaches on average: its FLOPs over its step time."""
    flops = sum(r.get("flops_forward", 0) + r.get("flops_backward", 0) for r in profile["layers"])
    step = compute_seconds(profile)
    return flops / step if flops > 0 and step > 0 else DEFAULT_GEMM_RATE


def algorithm1_plan(profile, workers, servers, devices=1):
    """{layer index: scheme} by the paper's Algorithm 1, PS or SFB (dist/sim/cost.paper_scheme)."""
    return {rec.index: paper_scheme(rec, workers, servers, devices)
            for rec in profile["description"]["layers"]}


def single_scheme_plan(profile, scheme):
    """{layer index: scheme} with `scheme` wherever it applies (SFB: InnerProducts) and PS
    elsewhere."""
    return {rec.index: scheme if scheme != "sfb" or rec.sfb else "ps"
            for rec in profile["description"]["layers"]}


def predicted_plan(profile, workers, net, servers=None, devices=1):
    """{layer index: scheme} chosen per layer by predicted time (layer_times, plan_by_time)."""
    P2 = workers if servers is None else servers
    shape = Shape(workers, P2, devices, net.separate_servers)
    rate = net.gemm_rate if net.gemm_rate is not None else profile_flop_rate(profile)
    desc = profile["description"]
    itemsize = 8 if desc.get("dtype") == "float64" else 4
    count = {p.id: p.count for p in desc["params"]}
    times = {}
    for rec in desc["layers"]:
        n = sum(count[p] for p in rec.params)
        times[rec.index] = layer_times(rec, n * itemsize, n, shape, net, rate, itemsize)
    layers = profile["layers"]
    t = sum(r["forward_ms"] for r in layers) / 1e3
    backward_end = {}
    for li in range(len(layers) - 1, -1, -1):
        t += layers[li]["backward_ms"] / 1e3
        backward_end[li] = t
    return plan_by_time(desc["layers"], times, backward_end, t)


def candidate_plans(profile, workers, net, servers=None, devices=1):
    """The plans a by-time mode tries, the per-layer prediction first, without repeats."""
    P2 = workers if servers is None else servers
    named = [("by predicted time", predicted_plan(profile, workers, net, servers, devices))]
    named += [(f"all {s}" if s != "sfb" else "SFB for FC", single_scheme_plan(profile, s))
              for s in SINGLE_SCHEME_PLANS]
    named.append(("Algorithm 1", algorithm1_plan(profile, workers, P2, devices)))
    seen, out = set(), []
    for name, plan in named:
        key = tuple(sorted(plan.items()))
        if key not in seen:
            seen.add(key)
            out.append((name, plan))
    return out
