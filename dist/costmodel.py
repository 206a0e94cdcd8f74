"""BestScheme on link costs: a table of what each link costs, and a predicted sync time per scheme.

Why: Table 1 of the paper (dist/cost.py) counts floats on the busiest node, which misleads twice:
SFB's rebuild of the weight gradient from every worker's factors is arithmetic the floats do not
see, and a message costs its latency whatever its size. Here a scheme's sync of one layer is
predicted in seconds from what the scheme says it moves (`Scheme.traffic(rec, P1, P2)`: messages
and floats on the busiest node, flops on a worker) and what the links cost:

    time = α·messages + bytes/β          on the slowest link of the kind the scheme uses
           + bytes·c_enc                 where the link is encrypted (CURVE), c_enc measured once
           + flops / flop rate           the scheme's extra arithmetic on a worker
           + backlog                     contention, see below

Contention (the simple rule): syncs that overlap share a link by taking turns. WFBP starts the
syncs in backward order, so a layer's sync waits for the transfers the layers above it put on the
same kind of link (peers or servers) in the same iteration; the backward compute between them is
not subtracted (it is not measured), so the backlog is an upper bound that steers a layer to the
less loaded kind of link. `plan()` walks the layers in backward order keeping that backlog.

A `LinkTable` is one process's view of its links: {target rank: Link(α, β, encrypted)} per worker,
the flop rate and c_enc. It comes from the start-up probe (dist/probe.py) or from a JSON file
(`--cost-table`, which tests use to force a choice; see `load_cost_table`).
"""
import json
import math

from .errors import DistError
from .schemes import choose_scheme, scheme_class

# a layer already measured moves to another scheme only if that is predicted this much faster (so
# two schemes of nearly equal cost do not swap at every refresh, each swap moving solver history)
SWITCH_MARGIN = 0.9
# the correction a refresh takes from observed sync times is kept within these factors
MIN_CORRECTION, MAX_CORRECTION = 0.1, 10.0


class Link:
    """One link as a process sees it: latency α (s), bandwidth β (bytes/s), CURVE or not."""

    __slots__ = ("alpha", "beta", "encrypted")

    def __init__(self, alpha, beta, encrypted=False):
        self.alpha, self.beta, self.encrypted = float(alpha), float(beta), bool(encrypted)

    def seconds(self, messages, nbytes, encrypt_cost):
        return (self.alpha * messages + nbytes / self.beta
                + (nbytes * encrypt_cost if self.encrypted else 0.0))

    def as_dict(self):
        return {"alpha": self.alpha, "beta": self.beta, "encrypted": self.encrypted}


class LinkTable:
    """links[worker rank][target rank] -> Link; flops: the slowest worker's flop rate (flop/s);
    encrypt_cost: seconds per byte CURVE adds on an encrypted link. `injected`: from a file (its
    predictions are not corrected by observed times, so a test's choices stay what it forced)."""

    def __init__(self, links, flops, encrypt_cost=0.0, injected=False):
        self.links = {int(w): {int(t): link for t, link in row.items()} for w, row in links.items()}
        self.flops = float(flops)
        self.encrypt_cost = float(encrypt_cost)
        self.injected = injected

    def slowest(self, roles, kind, messages, nbytes):
        """The seconds of the slowest link of `kind` ('peers' or 'servers') from any worker, for
        `messages` messages carrying `nbytes` in all (the busiest node's view)."""
        worst = 0.0
        for w in roles.worker_ranks():
            row = self.links.get(w, {})
            targets = (roles.server_ranks() if kind == "servers" else
                       [r for r in roles.worker_ranks() if r != w])
            for t in targets:
                link = row.get(t)
                if link is None:
                    raise DistError(f"the cost table has no link from {roles.name(w)} to "
                                    f"{roles.name(t)}")
                worst = max(worst, link.seconds(messages, nbytes, self.encrypt_cost))
        return worst

    def as_dict(self):
        return {"links": {str(w): {str(t): link.as_dict() for t, link in row.items()}
                          for w, row in self.links.items()},
                "flops": self.flops, "encrypt_cost": self.encrypt_cost, "injected": self.injected}

    @classmethod
    def from_reports(cls, reports):
        """The table from every worker's probe report: {"links": {target: {alpha, beta,
        encrypted}}, "flops": ..., "encrypt_cost": ...} per worker rank."""
        links = {w: {int(t): Link(v["alpha"], v["beta"], v.get("encrypted", False))
                     for t, v in rep["links"].items()} for w, rep in reports.items()}
        flops = min(rep["flops"] for rep in reports.values())
        encrypt = max(rep.get("encrypt_cost", 0.0) for rep in reports.values())
        return cls(links, flops, encrypt)


def link_kind(cls):
    return "servers" if cls.uses_servers else "peers"


def scheme_seconds(cls, rec, roles, table, itemsize, correction=None):
    """(transfer seconds, compute seconds) of scheme class `cls` syncing layer `rec` for one
    iteration, before contention. `correction`: {link kind: factor} from observed times."""
    t = cls.traffic(rec, roles.workers, roles.servers)
    if not math.isfinite(t["floats"]):
        return math.inf, 0.0
    kind = link_kind(cls)
    transfer = table.slowest(roles, kind, t["messages"], t["floats"] * itemsize)
    transfer *= (correction or {}).get(kind, 1.0)
    return transfer, t["flops"] / table.flops


def plan(layers, roles, table, itemsize, current=None, correction=None):
    """BestScheme on predicted seconds: ({layer index: scheme name}, {layer index: {scheme name:
    predicted seconds}}). `layers`: the book's records, each with its 'candidates' (the scheme
    names that may sync it). `current`: the schemes now in use, kept unless another is predicted
    faster by SWITCH_MARGIN. Layers go in backward order (WFBP's), each adding its transfer to
    the backlog of its kind of link (the contention rule of the module docstring)."""
    backlog = {"peers": 0.0, "servers": 0.0}
    choices, predicted = {}, {}
    for rec in sorted(layers, key=lambda r: -r["index"]):
        li = rec["index"]
        own = {}
        for name in rec["candidates"]:
            cls = scheme_class(name)
            transfer, compute = scheme_seconds(cls, rec, roles, table, itemsize, correction)
            own[name] = (transfer, compute, backlog[link_kind(cls)] + transfer + compute)
        best = choose_scheme(rec, roles.workers, roles.servers,
                             predicted={n: v[2] for n, v in own.items()})
        keep = (current or {}).get(li)
        if keep in own and not own[best][2] < SWITCH_MARGIN * own[keep][2]:
            best = keep
        choices[li] = best
        predicted[li] = {n: v[2] for n, v in own.items()}
        backlog[link_kind(scheme_class(best))] += own[best][0]
    return choices, predicted


def correction_from(observed, predicted, choices):
    """{link kind: factor} by which observed sync times exceed the predicted ones: for each kind,
    the sum of the observed seconds of its layers over the sum of their predictions (clamped).
    `observed`: {layer index: seconds} (the slowest worker's mean over a refresh window)."""
    sums = {}
    for li, seen in observed.items():
        name = choices.get(li)
        guess = (predicted.get(li) or {}).get(name)
        if name is None or not guess or not math.isfinite(guess):
            continue
        kind = link_kind(scheme_class(name))
        o, p = sums.get(kind, (0.0, 0.0))
        sums[kind] = (o + seen, p + guess)
    return {kind: min(MAX_CORRECTION, max(MIN_CORRECTION, o / p))
            for kind, (o, p) in sums.items() if p > 0}


# ------------------------------------------------------------------------------------------------
# an injected table: a JSON file of link costs, optionally changing at given iterations
# ------------------------------------------------------------------------------------------------
TABLE_KEYS = ("from_iteration", "default", "peers", "servers", "links", "flops", "encrypt_cost")
LINK_KEYS = ("alpha", "beta", "encrypted")


def _number(path, where, value, positive):
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > 0 if positive else value >= 0))
    if not ok:
        raise DistError(f"cost table {path}: {where} is {json.dumps(value)}, expected a "
                        f"{'positive' if positive else 'non-negative'} number")
    return float(value)


def _link(path, where, spec):
    if not isinstance(spec, dict):
        raise DistError(f"cost table {path}: {where} must be an object like "
                        f'{{"alpha": 1e-4, "beta": 1e9}}')
    unknown = sorted(set(spec) - set(LINK_KEYS))
    if unknown:
        raise DistError(f"cost table {path}: {where} has the unknown key '{unknown[0]}' "
                        f"(a link has {', '.join(LINK_KEYS)})")
    if "alpha" not in spec or "beta" not in spec:
        raise DistError(f"cost table {path}: {where} needs both 'alpha' (seconds a message) and "
                        f"'beta' (bytes a second)")
    return Link(_number(path, f"{where}.alpha", spec["alpha"], False),
                _number(path, f"{where}.beta", spec["beta"], True), bool(spec.get("encrypted")))


def _phase(path, where, spec):
    if not isinstance(spec, dict):
        raise DistError(f"cost table {path}: {where} must be an object")
    unknown = sorted(set(spec) - set(TABLE_KEYS))
    if unknown:
        raise DistError(f"cost table {path}: {where} has the unknown key '{unknown[0]}' (known: "
                        f"{', '.join(TABLE_KEYS)})")
    start = spec.get("from_iteration", 0)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise DistError(f"cost table {path}: {where}.from_iteration is {json.dumps(start)}, "
                        f"expected an iteration (a whole number >= 0)")
    links = {}
    for k, v in (spec.get("links") or {}).items():
        a, sep, b = k.partition("->")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise DistError(f"cost table {path}: {where}.links has the key '{k}', expected "
                            f"'RANK->RANK' such as '0->2'")
        links[(int(a), int(b))] = _link(path, f"{where}.links['{k}']", v)
    kinds = {kind: _link(path, f"{where}.{kind}", spec[kind])
             for kind in ("default", "peers", "servers") if kind in spec}
    if "default" not in kinds and not ("peers" in kinds and "servers" in kinds):
        raise DistError(f"cost table {path}: {where} needs a 'default' link (or both 'peers' and "
                        f"'servers')")
    return {"from": start, "kinds": kinds, "links": links,
            "flops": _number(path, f"{where}.flops", spec.get("flops", 1e10), True),
            "encrypt_cost": _number(path, f"{where}.encrypt_cost", spec.get("encrypt_cost", 0.0),
                                    False)}


class InjectedCosts:
    """The phases of a --cost-table file, each a table from its `from_iteration` on."""

    def __init__(self, path, phases):
        self.path, self.phases = path, phases

    def table_at(self, iteration, roles):
        """The LinkTable in force at `iteration`, for the job's roles."""
        phase = [p for p in self.phases if p["from"] <= iteration][-1]
        kinds, links = phase["kinds"], phase["links"]
        for (a, b) in links:
            if not (roles.is_worker(a) and 0 <= b < roles.size and a != b):
                raise DistError(f"cost table {self.path}: the link '{a}->{b}' is not from a "
                                f"worker to another rank of this job of {roles.workers} workers "
                                f"and {roles.servers} servers")
        rows = {}
        for w in roles.worker_ranks():
            rows[w] = {}
            for t in range(roles.size):
                if t == w:
                    continue
                kind = "servers" if roles.is_server(t) else "peers"
                rows[w][t] = links.get((w, t)) or kinds.get(kind) or kinds["default"]
        return LinkTable(rows, phase["flops"], phase["encrypt_cost"], injected=True)


def load_cost_table(path):
    """Read and check a --cost-table file; one DistError line naming the file and the fault.

    The file is one table, or a list of tables with ascending `from_iteration` (the first 0):
        {"default": {"alpha": 1e-4, "beta": 1.25e9},      every link not named otherwise
         "peers": {...}, "servers": {...},                  worker-worker / worker-server links
         "links": {"0->2": {"alpha": ..., "beta": ...}},    one link, as worker 0 sees it
         "flops": 2e10, "encrypt_cost": 0.0}                flop/s; CURVE seconds per byte"""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise DistError(f"cost table {path}: cannot be read ({e.strerror or e}); give a JSON file "
                        f"of link costs to --cost-table") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise DistError(f"cost table {path}: not JSON ({e}); see docs/distributed.md, "
                        f"'The measured cost model'") from None
    specs = data if isinstance(data, list) else [data]
    if not specs:
        raise DistError(f"cost table {path}: an empty list; give at least one table")
    phases = [_phase(path, f"table {i}" if isinstance(data, list) else "the table", spec)
              for i, spec in enumerate(specs)]
    starts = [p["from"] for p in phases]
    if starts[0] != 0 or starts != sorted(set(starts)):
        raise DistError(f"cost table {path}: from_iteration must start at 0 and grow from table "
                        f"to table (got {starts})")
    return InjectedCosts(path, phases)


# ------------------------------------------------------------------------------------------------
# the coordinator's side: reports in, choices out
# ------------------------------------------------------------------------------------------------
class Planner:
    """Turns the workers' reports into the choices every worker takes (the coordinator runs it, so
    every rank gets the same answer). `injected`: an InjectedCosts, which replaces the probe."""

    def __init__(self, roles, injected=None):
        self.roles, self.injected = roles, injected
        self.table = None
        self.current = None              # {layer: scheme} of the last publish
        self.predicted = {}              # {layer: {scheme: seconds}} of the last publish
        if injected is not None:         # a fault in the file stops the job before it starts
            for phase in injected.phases:
                injected.table_at(phase["from"], roles)

    def decide(self, book, reports, start):
        """The SCHEMES message's object for choices in force from iteration `start`. `reports`:
        {worker rank: {"links", "flops", "encrypt_cost"}} (the probe) or {"observed": {layer:
        mean sync seconds}} (a refresh window)."""
        correction = None
        if self.injected is not None:
            self.table = self.injected.table_at(start, self.roles)
        elif all("links" in rep for rep in reports.values()):
            self.table = LinkTable.from_reports(reports)
        elif self.table is not None and self.current is not None:
            observed = {}
            for rep in reports.values():
                for li, seconds in (rep.get("observed") or {}).items():
                    observed[int(li)] = max(observed.get(int(li), 0.0), float(seconds))
            correction = correction_from(observed, self.predicted, self.current)
        if self.table is None:
            raise DistError("the coordinator got sync times before any link costs (the probe)")
        layers = [rec for rec in book.layers if rec.get("candidates")]
        choices, predicted = plan(layers, self.roles, self.table, int(book.data["itemsize"]),
                                  current=self.current, correction=correction)
        self.current, self.predicted = choices, predicted
        return {"from": int(start), "choices": {str(li): n for li, n in choices.items()},
                "predicted": {str(li): {n: (s if math.isfinite(s) else None)
                                        for n, s in p.items()} for li, p in predicted.items()},
                "table": self.table.as_dict()}
