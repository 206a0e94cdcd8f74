"""`poseidon simulate`: throughput scaling of one model, per mode and node count, from the
discrete-event model of dist/sim/simulate.py.

    poseidon simulate --model vgg19_22k --nodes 1,2,4,8,16,32 --bandwidth 40Gbit
    poseidon simulate --model googlenet --bandwidth 10GbE --modes wfbp,poseidon --json out.json
    poseidon simulate --model resnet152 --modes wfbp,allreduce,ps-sfb-ar-priority --devices-per-node 4
    poseidon simulate --profile my.json ...            # a profile written by --write-profile
    poseidon simulate --model prototxt/cifar10_quick/train_val.prototxt --measure   # timed here
    poseidon simulate --model prototxt/vgg19/deploy.prototxt --img-per-s 35.5 --write-profile p.json

Values a user can get wrong (unknown model, unreadable bandwidth) print one line and exit 1.
"""
import json
import math
import os

from poseidon import prototxt as shipped_prototxt
from poseidon.engine.errors import PoseidonError

from .common import out

DEFAULT_MODES = "ps-nooverlap,wfbp,poseidon"
# the modes of dist/sim/simulate.py (spelled out so that --help needs no import of dist)
MODE_NAMES = ("ps-nooverlap", "wfbp", "poseidon", "sfb", "allreduce", "hybrid-nooverlap",
              "ps-sfb-ar", "ps-sfb-ar-priority", "tf", "horovod", "nodwbp-2015", "dwbp-2015",
              "sacp-2015")
# the profiles in dist/sim/profiles/ (spelled out for the same reason; a test keeps them in step)
SHIPPED_MODELS = ("vgg19", "vgg19_22k", "googlenet", "resnet152", "inception_v3", "alexnet",
                  "cifar10_quick")


def add(sub):
    p = sub.add_parser("simulate", help="speedup tables from a discrete-event model of one "
                                        "iteration (paper's models shipped as profiles)")
    p.add_argument("--model", help="a shipped profile (" + ", ".join(SHIPPED_MODELS) + ") or, "
                                   "with --measure or --img-per-s, a prototxt file")
    p.add_argument("--profile", help="a profile JSON file (from --write-profile)")
    p.add_argument("--measure", action="store_true",
                   help="time the model's layers with the engine on this machine")
    p.add_argument("--iterations", default="3", help="timed iterations for --measure")
    p.add_argument("--img-per-s", default=None,
                   help="build the profile from the prototxt and this throughput, per-layer "
                        "times apportioned by FLOPs")
    p.add_argument("--write-profile", default=None, help="save the profile used to this file")
    p.add_argument("--nodes", default="1,2,4,8,16,32", help="node counts, comma-separated")
    p.add_argument("--servers", default=None,
                   help="servers P2 (default: one per node, beside each worker, as in the paper)")
    p.add_argument("--separate-servers", action="store_true",
                   help="servers on their own nodes instead of beside the workers")
    p.add_argument("--bandwidth", default="40Gbit", help="per NIC and direction, e.g. 40Gbit, "
                                                         "10GbE, 1.25GB/s, inf (rates: "
                                                         "docs/configuration.md)")
    p.add_argument("--goodput", default=None,
                   help="the most a node's software stack moves per direction (default: each "
                        "system's TCP share and host stack, docs/simulate.md); the link runs at "
                        "min(bandwidth, goodput)")
    p.add_argument("--latency", default="5us", help="per message, e.g. 5us, 0.1ms")
    p.add_argument("--pcie", default=None, help="GPU<->host copy rate per direction (default: "
                                                "the system's, 12GB/s; inf: no copies)")
    p.add_argument("--update-rate", default=None,
                   help="bytes/s a server adds or applies (default: the system's KV-store host "
                        "rate, 2.31GB/s from the paper's single-node Caffe+PS)")
    p.add_argument("--gemm-rate", default="profile",
                   help="FLOP/s of the SFB rebuild and all-reduce's reduction (default: the "
                        "profile's own rate, its FLOPs over its step time)")
    p.add_argument("--devices-per-node", default="1",
                   help="G replicas per node, reduced into one leader before the inter-node sync")
    p.add_argument("--intra-bandwidth", default="12GB/s",
                   help="between a node's devices and their leader (PCIe-like), e.g. 12GB/s")
    p.add_argument("--kv-pair", default=None,
                   help="KV pair size (as --kv-pair-bytes of train; default: the system's, 2MB, "
                        "whole tensors for tf); a huge value (1GB) puts each tensor whole on one "
                        "server, as a PS without KV pairs does")
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help="comma-separated: " + ", ".join(MODE_NAMES))
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(run=run)


def _positive_ints(text, what):
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise PoseidonError(f"--{what} takes positive integers separated by commas, got '{text}'")
    return values


def _flops(text):
    if str(text).strip().lower() == "profile":
        return None
    s = str(text).strip().upper().replace("FLOPS", "").replace("FLOP/S", "")
    scale = {"G": 1e9, "T": 1e12, "P": 1e15}.get(s[-1:], 1.0)
    try:
        value = float(s[:-1] if s[-1:] in "GTP" and s else s) * scale
    except ValueError:
        raise PoseidonError(f"cannot read --gemm-rate '{text}': give FLOP/s, e.g. 6e12, 6T, "
                            f"inf, or profile") from None
    if value <= 0:
        raise PoseidonError(f"--gemm-rate must be positive, got '{text}'")
    return value


def network_from_args(args):
    from poseidon.dist.coord.placement import DEFAULT_PAIR_BYTES, parse_bytes
    from poseidon.dist.sim.modes import Network
    from poseidon.dist.units import parse_latency, parse_rate

    def rate(flag):
        value = getattr(args, flag[2:].replace("-", "_"))
        return None if value is None else parse_rate(value, flag, infinite=True)
    try:
        latency = parse_latency(args.latency, "--latency")
        pair = None if args.kv_pair is None else parse_bytes(args.kv_pair)
        return Network(bandwidth=rate("--bandwidth"), latency=latency, pcie=rate("--pcie"),
                       update_rate=rate("--update-rate"), goodput=rate("--goodput"),
                       gemm_rate=_flops(args.gemm_rate), intra_bandwidth=rate("--intra-bandwidth"),
                       kv_pair_bytes=pair,
                       chunk_bytes=None if pair is None else min(pair, DEFAULT_PAIR_BYTES),
                       separate_servers=args.separate_servers)
    except ValueError as e:
        raise PoseidonError(str(e)) from None


def _prototxt_for(model):
    if os.path.exists(model):
        return model
    path = shipped_prototxt.path(model)
    if path.exists():
        return str(path)
    raise PoseidonError(f"--model '{model}' is neither a prototxt file nor a folder of prototxt/")


def load_or_build_profile(args):
    from poseidon.dist.sim import profile as simprofile
    if args.profile:
        return simprofile.load_profile(args.profile)
    if not args.model:
        raise PoseidonError(f"give --model ({', '.join(SHIPPED_MODELS)} or a prototxt with "
                            f"--measure) or --profile FILE")
    if args.measure:
        iters = _positive_ints(args.iterations, "iterations")[0]
        return measure_profile(_prototxt_for(args.model), iters)
    if args.img_per_s is not None:
        try:
            rate = float(args.img_per_s)
        except ValueError:
            rate = -1.0
        if not rate > 0 or not math.isfinite(rate):
            raise PoseidonError(f"--img-per-s takes a positive number, got '{args.img_per_s}'")
        path = _prototxt_for(args.model)
        return simprofile.profile_from_throughput(path, rate, f"{rate} img/s given on the command "
                                                  f"line; per-layer times apportioned by FLOPs")
    if args.model.endswith(".prototxt"):
        raise PoseidonError(f"--model {args.model}: a prototxt needs --measure (time it here) or "
                            f"--img-per-s (apportion a throughput by FLOPs)")
    return simprofile.load_profile(args.model)


def measure_profile(path, iterations):
    """Per-layer forward/backward times of the net on this machine (as `poseidon time` takes
    them), with describe_net's facts from the real Net."""
    from poseidon.dist.coord.book import describe_net
    from poseidon.engine import prototxt

    from .timing import time_layers, timing_net
    net = timing_net(prototxt.read_net(path), "TRAIN", source=path)
    fwd, bwd = time_layers(net, iterations)
    layers = [{"name": name, "type": layer.type, "forward_ms": 1e3 * fwd[i] / iterations,
               "backward_ms": 1e3 * bwd[i] / iterations}
              for i, (name, layer) in enumerate(zip(net.layer_names, net.layers))]
    desc = describe_net(net)
    first_top = net.top_vecs[0][0].shape if net.top_vecs and net.top_vecs[0] else (1,)
    batch = first_top[0] if first_top else 1
    net.shutdown()
    step = sum(r["forward_ms"] + r["backward_ms"] for r in layers)
    return {"model": os.path.basename(os.path.dirname(os.path.abspath(path))) or path,
            "batch": int(batch), "step_ms": step,
            "source": f"measured with the engine on this machine ({iterations} iterations, CPU)",
            "layers": layers, "description": desc}


def _finite(value):
    """JSON without Infinity: unlimited rates become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _plan_words(schemes):
    """'SFB for fc6, fc7; 12 by all-reduce, 5 by PS' for one plan ({layer: scheme})."""
    sfb = [k for k, v in schemes.items() if v == "sfb"]
    counts = [(sum(v == s for v in schemes.values()), word)
              for s, word in (("allreduce", "all-reduce"), ("ps", "PS"))]
    counts = [(n, word) for n, word in counts if n]
    if not sfb and len(counts) == 1:
        return f"all {counts[0][0]} by {counts[0][1]}"
    rest = ", ".join(f"{n} by {word}" for n, word in counts)
    return f"SFB for {', '.join(sfb)}" + (f", {rest}" if rest else "") if sfb else rest


def scheme_line(rows, nodes):
    """Which layers go by which scheme at each node count, e.g. '2-4 nodes: SFB for fc, 57 by
    PS'; for a by-time mode also which candidate plan ran."""
    groups = []
    for p in nodes:
        r = rows[p]
        key = (_plan_words(r.schemes), r.plan)
        if groups and groups[-1][1] == key:
            groups[-1][0].append(p)
        else:
            groups.append(([p], key))
    parts = []
    for ps_, (what, plan) in groups:
        span = f"{ps_[0]}" if len(ps_) == 1 else f"{ps_[0]}-{ps_[-1]}"
        how = f" ({plan})" if plan else ""
        parts.append(f"{span} node{'s' if len(ps_) > 1 or ps_[0] > 1 else ''}: {what}{how}")
    return "; ".join(parts)


def system_words(system, net):
    """One mode's system and the figures it runs at, e.g. 'Poseidon KV store: link 18.5 Gbit/s,
    PCIe 12 GB/s, server 2.31 GB/s, 2 MB pairs'."""
    from poseidon.dist.sim.systems import WHOLE_TENSORS, resolve
    r = resolve(net, system)
    pair = ("whole tensors" if r.kv_pair_bytes >= WHOLE_TENSORS
            else f"{r.kv_pair_bytes / 2**20:g} MB pairs")

    def gbs(v):
        return "unlimited" if v == math.inf else f"{v / 1e9:.3g} GB/s"
    return (f"{system.name}: link {_rate(r.bandwidth)}, PCIe {gbs(r.pcie)}, server "
            f"{gbs(r.update_rate)}, {pair}")


def _rate(bps):
    return "unlimited" if bps == math.inf else f"{bps * 8 / 1e9:.3g} Gbit/s"


def run(args):
    from poseidon.dist.sim import profile as simprofile
    from poseidon.dist.sim.simulate import MODES, scaling_table
    from poseidon.dist.sim.systems import resolve
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise PoseidonError(f"--modes: unknown mode '{(bad or [args.modes])[0]}' (choose from "
                            f"{', '.join(MODES)})")
    nodes = _positive_ints(args.nodes, "nodes")
    servers = _positive_ints(args.servers, "servers")[0] if args.servers is not None else None
    net = network_from_args(args)
    profile = load_or_build_profile(args)
    if args.write_profile:
        simprofile.write_profile(profile, args.write_profile)
        out(f"profile written to {args.write_profile}")
    devices = _positive_ints(args.devices_per_node, "devices-per-node")[0]
    table = scaling_table(profile, nodes, modes, net, servers, devices)
    name = profile.get("model", "?")
    where = ("on their own nodes" if args.separate_servers else "beside the workers")
    out(f"{name}: batch {profile.get('batch')} per node, one-node step "
        f"{1e3 * next(iter(next(iter(table.values())).values())).compute_s:.1f} ms "
        f"({profile.get('source', 'profile')})")
    out(f"network: {_rate(net.bandwidth)} line rate per NIC and direction, latency "
        f"{net.latency * 1e6:g} us; {servers or 'one'} server{'s' if servers and servers > 1 else ''} "
        f"{'in all' if servers else 'per node'}, {where}")
    for m in modes:
        out(f"  {m}: {system_words(MODES[m].system, net)}")
    if devices > 1:
        out(f"{devices} devices per node reduce into one leader over {_rate(net.intra_bandwidth)} "
            f"before the inter-node sync")
    out("speedup = P1 * G * t_1 / t_P1 (t_1: one device, compute only; G devices per node); "
        "iteration ms in brackets")
    out("")
    width = 20
    out(f"{'nodes':>5}  " + "".join(f"{m:>{width}}" for m in modes))
    for p in nodes:
        cells = [f"{table[m][p].speedup:7.2f}x ({table[m][p].iteration_s * 1e3:6.0f})"
                 for m in modes]
        out(f"{p:>5}  " + "".join(f"{c:>{width}}" for c in cells))
    for m in modes:
        out(f"{m} ({MODES[m].label}): " + scheme_line(table[m], nodes))
    if args.json:
        payload = {"model": name, "profile_source": profile.get("source"),
                   "network": dict(net.__dict__), "servers": servers,
                   "systems": {m: dict(resolve(net, MODES[m].system).__dict__) for m in modes},
                   "results": {m: {str(p): r.as_dict() for p, r in rows.items()}
                               for m, rows in table.items()}}
        with open(args.json, "w") as f:
            json.dump(_finite(payload), f, indent=1)
        out(f"results written to {args.json}")
