"""The information book: what every process of a job knows about the model and the cluster.

Per layer with parameters to sync: type, M, N, K (rows of its GEMM), parameter shapes, and whether it
can give sufficient factors; per parameter: shape, lr_mult, decay_mult, the layer that syncs it;
cluster: P1, P2, addresses; the KV-pair placement; the solver (for the servers' update rule).

The coordinator builds it once from worker 0's description of its net (after checking that every
worker described the same net) and hands the same book to every process. It is static during a
run, so every process evaluates `best_scheme(l)` (Algorithm 1 over the registered schemes,
dist/schemes/best.py) locally with no round trip and all reach the same decision; `query(...)`
answers the same questions over the coordinator's socket.

Under the measured cost model (dist/cost/model.py) the choices the book is built with are only the
first ones: the coordinator publishes others, each "effective from" an iteration, and every
worker files them in its book (`publish`), so `best_scheme(l, it)` still gives every rank the same
answer. Such a book lists each layer's `candidates` and places every parameter a scheme with
servers may sync on the servers, so that a layer can change scheme without a new placement.
"""
import hashlib
import json
from dataclasses import replace

from ..errors import DistError
from .records import Bundle, LayerRecord, Pair, ParamRecord
from .placement import DEFAULT_PAIR_BYTES, cut_pairs, make_bundles, merge_on_servers, place_pairs
from ..schemes import SCHEMES, choose_scheme, hybrid_members, scheme_class, usable_schemes


def relaxed_consistency(options):
    """'--straggler-timeout' or '--staleness' when the options relax BSP, else None. Under either,
    every layer goes by PS: SFB needs every peer's factors of the iteration, so it cannot leave a
    late worker out, nor let a worker run ahead, without a second protocol."""
    if options.get("straggler_timeout") is not None:
        return "--straggler-timeout"
    if int(options.get("staleness") or 0) > 0:
        return "--staleness"
    return None


# ------------------------------------------------------------------------------------------------
# describing a worker's net
# ------------------------------------------------------------------------------------------------
def describe_net(net, iter_size=1, replicas=1):
    """A description of the net's synchronised parameters (records of its layers and parameters;
    on the wire records.description_to_wire), from which the coordinator builds the book and
    which it compares between workers. Parameter ids are indexes into net.learnable_params (the
    solver's history order). `replicas`: the worker runs the net as that many replicas
    (engine/replicas.py), so a layer's sufficient factors have K·replicas rows."""
    stats_layers = {li for li, layer in enumerate(net.layers) if layer.stores_statistics}
    users = {}
    for li, specs in enumerate(net.layer_param_specs):
        for bi, spec in enumerate(specs):
            users.setdefault(spec.name, []).append((li, bi))
    params = []
    by_layer = {}
    for pid, (blob, spec) in enumerate(zip(net.learnable_params, net.learnable_param_specs)):
        synced = spec.lr_mult != 0 and spec.layer_index not in stats_layers
        sync_layer = min(li for li, _ in users[spec.name])
        shared = len(users[spec.name]) > 1
        params.append(ParamRecord(id=pid, name=spec.name, layer=sync_layer,
                                  owner=(spec.layer_index, spec.blob_index),
                                  shape=tuple(blob.shape), count=int(blob.count),
                                  lr_mult=float(spec.lr_mult), decay_mult=float(spec.decay_mult),
                                  shared=shared, synced=synced))
        if synced:
            by_layer.setdefault(sync_layer, []).append(pid)
    layers = []
    for li in sorted(by_layer):
        layer = net.layers[li]
        pids = by_layer[li]
        M, N, K = layer.gemm_dims(net.bottom_vecs[li])
        K *= int(replicas)
        own = [params[p] for p in pids]
        weight_ok = any(p.owner == (li, 0) and not p.shared for p in own)
        sfb = bool(layer.has_sufficient_factors and iter_size == 1 and weight_ok
                   and all(p.owner[0] == li and not p.shared for p in own))
        layers.append(LayerRecord(
            index=li, name=net.layer_names[li], type=layer.type, M=M, N=N, K=K, sfb=sfb,
            params=tuple(pids),
            # whether this net's backward makes the layer's weight gradient (and so its
            # factors): not for a layer off the loss path
            weight_grad=bool(net.layer_need_backward[li] and layer.param_propagate_down[0]),
            shapes=tuple(params[p].shape for p in pids)))
    described = {"net": net.name, "dtype": str(net.dtype), "iter_size": int(iter_size),
                 "layers": layers, "params": params}
    if replicas != 1:
        described["replicas"] = int(replicas)
    return described


def digest(obj):
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def first_difference(a, b, path=""):
    """A readable 'where: x vs y' for the first place two JSON-able values differ, or None."""
    if type(a) is not type(b):
        return f"{path or 'value'}: {a!r} vs {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: {'missing' if k not in a else a[k]!r} vs " \
                       f"{'missing' if k not in b else b[k]!r}"
            d = first_difference(a[k], b[k], f"{path}.{k}" if path else k)
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} entries vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            label = f"{path}[{i}]"
            if isinstance(x, dict) and "name" in x:
                label = f"{path}['{x['name']}']"
            d = first_difference(x, y, label)
            if d:
                return d
        return None
    return None if a == b else f"{path or 'value'}: {a!r} vs {b!r}"


def fusion_bytes(options):
    """The --fusion-bytes of a job's options (default: the KV pair size); 0 (one message per pair)
    under relaxed consistency, whose policies time, drop and hold replies pair by pair."""
    if relaxed_consistency(options):
        return 0
    value = options.get("fusion_bytes")
    if value is None:
        value = options.get("kv_pair_bytes") or DEFAULT_PAIR_BYTES
    return int(value)


# --bucket-bytes auto on a job whose processes all share one host: 1 MB (cifar10_quick's 0.58 MB
# of parameters in one sync). Across hosts WFBP's per-layer overlap hides the network; on one
# host there is no network, and each sync costs its wake-ups (docs/performance.md).
AUTO_BUCKET_BYTES = 1 << 20


def cost_model(options, hosts, relaxed):
    """'measured' or 'static' for a job: --cost-model, where `auto` is measured when the ranks
    registered from more than one host (a network to measure) and static on one host (so one-host
    jobs keep Table 1's choices); static when --sync forces a scheme or BSP is relaxed (there is
    no choice to make)."""
    if relaxed or hybrid_members(options.get("sync", "hybrid")) is None:
        return "static"
    model = options.get("cost_model") or "auto"
    if model == "auto":
        return "measured" if len(set((hosts or {}).values())) > 1 else "static"
    return model


def candidates(rec, servers, relaxed, sync="hybrid"):
    """The schemes that may sync layer `rec` under the measured model (those of the hybrid that
    apply, and with no servers none that needs them)."""
    return [cls.name for cls in usable_schemes(rec, relaxed, sync)
            if servers or not cls.uses_servers]


def may_use_servers(rec):
    names = rec.candidates if rec.candidates is not None else (rec.scheme,)
    return any(scheme_class(name).uses_servers for name in names)


def one_host(local, size):
    """Whether all `size` processes advertised a Unix-socket inbox
    (dist/transport/onehost/localipc.py) on the same boot, so every pair talks on this host (a job
    with --ipc off gives none)."""
    boots = {(info or {}).get("boot") for info in (local or {}).values()}
    return len(local or {}) == size and len(boots) == 1 and None not in boots


def bucket_bytes(options, single_host=False):
    """The bucket size of a job (0: every layer synced alone): --bucket-bytes, where `auto` is
    AUTO_BUCKET_BYTES on one host and 0 across hosts; 0 under relaxed consistency, whose
    policies work pair by pair."""
    if relaxed_consistency(options):
        return 0
    value = options.get("bucket_bytes") or 0
    if value == "auto":
        return AUTO_BUCKET_BYTES if single_host else 0
    return int(value)


def sync_groups(layers, param_bytes, bucket):
    """{layer index: index of the layer its parameters are synced with}: consecutive PS layers,
    taken in backward order (highest index first), share one sync while their parameters add up
    to at most `bucket` bytes, and it starts when the lowest of them (the last one back) is done,
    as DDP's buckets. A layer alone over `bucket`, an SFB layer, or bucket 0: its own sync.

    Why: each message costs a handful of thread and process hops on both sides whatever its size
    (docs/performance.md, "The distributed path on one host"), so nets of many
    small layers pay per layer; a bucket trades some of WFBP's overlap for fewer messages."""
    group_of = {}
    current, size = [], 0
    for rec in sorted(layers, key=lambda r: -r.index):
        nbytes = sum(param_bytes[p] for p in rec.params)
        fits = (bucket and scheme_class(rec.scheme).uses_servers and nbytes <= bucket
                and len(rec.candidates or ()) <= 1)
        if current and (not fits or size + nbytes > bucket):
            for li in current:
                group_of[li] = current[-1]
            current, size = [], 0
        if fits:
            current.append(rec.index)
            size += nbytes
        else:
            group_of[rec.index] = rec.index
    for li in current:
        group_of[li] = current[-1]
    return group_of


def servers_share_memory(local, workers, servers):
    """Whether every server advertised its shared KV memory (dist/transport/onehost/kvshm.py; it
    does so only with --ipc auto, under BSP and without the bandwidth cap)."""
    local = {str(k): v for k, v in (local or {}).items()}
    return servers > 0 and all(isinstance((local.get(str(r)) or {}).get("kv_memory"), dict)
                               for r in range(workers, workers + servers))


def layer_records(description, workers, servers, options, relaxed, model, itemsize):
    """The book's record of each layer: its description with its first scheme (Algorithm 1),
    the schemes it may move to under the measured model, and the ring's piece size."""
    sync = options.get("sync", "hybrid")
    piece = options.get("piece_bytes")
    layers = []
    for rec in description["layers"]:
        if piece:
            rec = replace(rec, piece_floats=max(1, int(piece) // itemsize))
        rec = replace(rec, scheme=choose_scheme(rec, workers, servers, sync, relaxed))
        rec = replace(rec, candidates=(tuple(candidates(rec, servers, relaxed, sync))
                                       if model == "measured" else (rec.scheme,)))
        layers.append(rec)
    return layers


def check_servers(layers, servers, sync, relaxed):
    """Refuse --servers 0 when a layer's scheme needs a parameter server, naming the layers."""
    needs_ps = [rec for rec in layers if scheme_class(rec.scheme).uses_servers]
    if not needs_ps or servers != 0:
        return
    names = ", ".join(f"'{r.name}' ({r.type})" for r in needs_ps[:6])
    more = f" and {len(needs_ps) - 6} more" if len(needs_ps) > 6 else ""
    why = ("--sync ps sends every layer through the servers" if sync == "ps" else
           f"{relaxed} sends every layer through the servers" if relaxed else
           f"--sync {sync} applies to only some layers, the others go by PS; --sync "
           f"hybrid sends them by a scheme without servers")
    serverless = ", ".join(n for n, c in SCHEMES.items() if not c.uses_servers)
    raise DistError(f"--servers 0 needs every layer with parameters to go by a scheme "
                    f"without servers ({serverless}), but "
                    f"{names}{more} would be synced through a parameter server ({why}): "
                    f"give --servers 1 or more")


def place_params(params, layers, servers, options, itemsize):
    """(KV pairs, bundles): the parameters a scheme with servers may sync, cut into KV pairs,
    bundled per layer and placed on the servers (each pair and bundle names its server)."""
    layers = [rec for rec in layers if may_use_servers(rec)]
    on_servers = {rec.index for rec in layers}
    pair_bytes = int(options.get("kv_pair_bytes"))
    ps_params = [(p.id, p.count) for p in params if p.scheme is not None and p.layer in on_servers]
    cut = cut_pairs(ps_params, itemsize, pair_bytes)
    length = {pair_id: n for pair_id, _, _, n in cut}
    bundles = make_bundles(layers, cut, itemsize, fusion_bytes(options))
    where = place_pairs([sum(length[k] for k in b.pairs) * itemsize for b in bundles], servers)
    bundles = [replace(bundle, server=s) for bundle, s in zip(bundles, where)]
    server_of = {k: bundle.server for bundle in bundles for k in bundle.pairs}
    pairs = [Pair(id=i, param=pid, offset=off, length=n, server=server_of[i])
             for (i, pid, off, n) in cut]
    return pairs, bundles


# ------------------------------------------------------------------------------------------------
# the book
# ------------------------------------------------------------------------------------------------
# the book's fields on the wire, in the order they travel; the records' lists among them
WIRE_FIELDS = ("workers", "servers", "options", "net", "dtype", "itemsize", "iter_size",
               "grad_scale", "layers", "params", "pairs", "bundles", "addresses", "hosts", "local",
               "solver", "one_host", "bucket_bytes", "merged_on_servers", "cost_model")
RECORD_LISTS = ("layers", "params", "pairs", "bundles")


class InformationBook:
    """The book: its records (dist/coord/records.py: LayerRecord, ParamRecord, Pair, Bundle, all
    frozen) and, in `data`, its other fields (workers, options, dtype, grad_scale, addresses, ...)
    as they travel. It travels as one JSON object: `to_wire` where the coordinator sends it,
    `from_wire` where a process receives it. The one thing that changes during a run, the measured
    model's published choices, is kept beside the frozen records in `schedule` (`publish`), so
    every record stays what the coordinator built and the digest stays that of the sent book."""

    def __init__(self, data, layers, params, pairs, bundles):
        self.data = data
        self.workers = int(data["workers"])
        self.servers = int(data["servers"])
        self.options = data["options"]
        self.layers, self.params, self.pairs, self.bundles = layers, params, pairs, bundles
        self._layer = {rec.index: rec for rec in self.layers}
        self._pairs_of = {}
        for pair in self.pairs:
            self._pairs_of.setdefault(pair.param, []).append(pair)
        self.schedule = []          # [(effective from iteration, {layer: scheme})], published
        self._bundles_of = {}
        for bundle in self.bundles:
            self._bundles_of.setdefault(bundle.layer, []).append(bundle)

    @classmethod
    def from_wire(cls, obj):
        """The book from its JSON object (as the coordinator sent it)."""
        data = {k: v for k, v in obj.items() if k not in RECORD_LISTS}
        return cls(data, [LayerRecord.from_wire(r) for r in obj["layers"]],
                   [ParamRecord.from_wire(p) for p in obj["params"]],
                   [Pair.from_wire(p) for p in obj["pairs"]],
                   [Bundle.from_wire(b) for b in obj["bundles"]])

    def to_wire(self):
        """The book's JSON object: the same keys, in the same order, as it always travelled, so
        its bytes (and digest) are those of a book built by any version of this code."""
        records = {"layers": [r.to_wire() for r in self.layers],
                   "params": [p.to_wire() for p in self.params],
                   "pairs": [p.to_wire() for p in self.pairs],
                   "bundles": [b.to_wire() for b in self.bundles]}
        order = list(WIRE_FIELDS) + [k for k in self.data if k not in WIRE_FIELDS]
        return {k: records[k] if k in records else self.data[k] for k in order
                if k in records or k in self.data}

    # ----- building -------------------------------------------------------------------------------
    @classmethod
    def build(cls, description, workers, servers, options, addresses=None, hosts=None,
              solver_text="", local=None):
        """The book for a job: schemes by Algorithm 1, then the PS parameters cut into KV pairs and
        placed on the servers. Raises DistError when --servers 0 cannot work for this net."""
        sync = options.get("sync", "hybrid")
        relaxed = relaxed_consistency(options)
        if relaxed and hybrid_members(sync) is None and scheme_class(sync).bsp_only:
            raise DistError(f"--sync {sync} cannot be combined with {relaxed}: it needs every "
                            f"worker's contribution of an iteration; give --sync ps or hybrid "
                            f"(under {relaxed} every layer then goes by PS)")
        model = cost_model(options, hosts, relaxed)
        itemsize = 8 if description.get("dtype") == "float64" else 4
        layers = layer_records(description, workers, servers, options, relaxed, model, itemsize)
        param_bytes = {p.id: p.count * itemsize for p in description["params"]}
        single_host = one_host(local, workers + servers)
        bucket = bucket_bytes(options, single_host)
        group_of = sync_groups(layers, param_bytes, bucket)
        layers = [replace(rec, group=group_of[rec.index]) for rec in layers]
        check_servers(layers, servers, sync, relaxed)
        scheme_of = {rec.index: rec.scheme for rec in layers}
        params = [replace(p, scheme=scheme_of.get(p.layer) if p.synced else None)
                  for p in description["params"]]
        pairs, bundles = place_params(params, layers, servers, options, itemsize)
        merged = (single_host and options.get("fusion_bytes") is None and not relaxed
                  and servers_share_memory(local, workers, servers))
        if merged:
            bundles = merge_on_servers(bundles)
        iter_size = int(description.get("iter_size", 1))
        scale = (1.0 if options.get("sum_gradients") else 1.0 / workers) / iter_size
        data = {"workers": workers, "servers": servers, "options": dict(options),
                "net": description["net"], "dtype": description.get("dtype", "float32"),
                "itemsize": itemsize, "iter_size": iter_size, "grad_scale": scale,
                "addresses": {str(k): v for k, v in (addresses or {}).items()},
                "hosts": {str(k): v for k, v in (hosts or {}).items()},
                "local": {str(k): v for k, v in (local or {}).items()}, "solver": solver_text,
                "one_host": single_host, "bucket_bytes": bucket, "merged_on_servers": merged,
                "cost_model": model}
        return cls(data, layers, params, pairs, bundles)

    # ----- Algorithm 1 and queries -----------------------------------------------------------------
    def layer(self, li):
        return self._layer[li]

    def synced_layers(self):
        """The layers after whose backward a sync starts (each layer, or the lowest of a bucket)."""
        return [rec.index for rec in self.layers if rec.group == rec.index]

    def group_members(self, li):
        """The layers synced by the sync that starts after layer li: li alone, or the bucket
        --bucket-bytes made, in backward order (li, the lowest, last)."""
        return [rec.index for rec in sorted(self.layers, key=lambda r: -r.index)
                if rec.group == li]

    def best_scheme(self, li, it=None):
        """BestScheme for layer li (with the --sync override), evaluated on the book; at iteration
        `it`, the measured model's choice published for it, if any."""
        for start, choices in reversed(self.schedule):
            if it is not None and start <= it and li in choices:
                return choices[li]
        return choose_scheme(self._layer[li], self.workers, self.servers,
                             self.options.get("sync", "hybrid"), relaxed_consistency(self.options))

    @property
    def measured(self):
        return self.data.get("cost_model") == "measured"

    def switchable(self, li):
        """Whether layer li may change scheme during the run (measured model, several of them)."""
        return len(self._layer[li].candidates or ()) > 1

    def publish(self, start, choices):
        """File the measured model's choices {layer: scheme}, in force from iteration `start` on
        (a later publish for the same or an earlier start replaces what it covers)."""
        self.schedule = [(s, c) for s, c in self.schedule if s < start]
        self.schedule.append((int(start), {int(li): name for li, name in choices.items()}))

    def scheme_of_param(self, pid, it=None):
        """The scheme that syncs parameter pid at iteration `it` (None: not synced)."""
        p = self.params[pid]
        return None if p.scheme is None else self.best_scheme(p.layer, it)

    def pairs_of_param(self, pid):
        return self._pairs_of.get(pid, [])

    def bundles_of_layer(self, li):
        """The layer's KV messages: [Bundle]."""
        return self._bundles_of.get(li, [])

    def bundles_on_server(self, server_index):
        return [b for b in self.bundles if b.server == server_index]

    def pairs_on_server(self, server_index):
        return [p for p in self.pairs if p.server == server_index]

    def server_bytes(self):
        loads = [0] * self.servers
        for p in self.pairs:
            loads[p.server] += p.length * self.data["itemsize"]
        return loads

    def address(self, rank):
        return self.data["addresses"][str(rank)]

    def local(self, rank):
        """The rank's Unix-socket inbox (dist/transport/onehost/localipc.py), or None."""
        return self.data.get("local", {}).get(str(rank))

    def digest(self):
        wire = self.to_wire()
        return digest({k: wire[k] for k in ("layers", "params", "pairs", "bundles", "options",
                                            "workers", "servers", "solver")})

    def query(self, what, **kw):
        """Coordinator's Query: 'layer' (index=), 'best_scheme' (index=), 'pairs' (param= or
        server=), 'cluster', 'server_bytes', 'costs' (index=); the answer as it travels (records
        as their JSON objects)."""
        from ..cost.formulas import scheme_costs
        if what == "layer":
            return self.layer(int(kw["index"])).to_wire()
        if what == "best_scheme":
            return self.best_scheme(int(kw["index"]))
        if what == "pairs":
            pairs = (self.pairs_of_param(int(kw["param"])) if "param" in kw
                     else self.pairs_on_server(int(kw["server"])))
            return [pair.to_wire() for pair in pairs]
        if what == "cluster":
            return {"workers": self.workers, "servers": self.servers,
                    "addresses": self.data["addresses"], "hosts": self.data["hosts"]}
        if what == "server_bytes":
            return self.server_bytes()
        if what == "costs":
            rec = self.layer(int(kw["index"]))
            costs = scheme_costs(rec.M, rec.N, rec.K, self.workers, self.servers)
            costs.update((name, cls.cost(rec, self.workers, self.servers))
                         for name, cls in SCHEMES.items())
            return costs
        raise DistError(f"unknown query '{what}' (layer, best_scheme, pairs, cluster, "
                        f"server_bytes, costs)")

    def summary_lines(self):
        """Human-readable lines: each synced layer's scheme and the bytes per server."""
        lines = []
        for rec in self.layers:
            with_ = (f" (synced with '{self.layer(rec.group).name}')" if rec.group != rec.index
                     else "")
            lines.append(f"  {rec.name:<16} {rec.type:<14} M={rec.M:<6} N={rec.N:<7} "
                         f"K={rec.K:<5} -> {rec.scheme.upper()}{with_}")
        if self.servers:
            loads = ", ".join(f"{b / 1e6:.2f} MB" for b in self.server_bytes())
            n = len(self.bundles)
            lines.append(f"  KV pairs: {len(self.pairs)} over {self.servers} server(s): {loads}; "
                         f"{n} message{'s' if n != 1 else ''} each way per iteration")
        bucket = self.data.get("bucket_bytes", 0)
        if bucket and self.data["options"].get("bucket_bytes") == "auto":
            lines.append(f"  one host: consecutive PS layers of up to {bucket / 2**20:g} MB in all "
                         f"share a sync (--bucket-bytes auto; 0 syncs each layer alone)")
        return lines
