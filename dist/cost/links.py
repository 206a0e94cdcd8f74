"""What each link of a job costs: a `LinkTable` of latency and bandwidth per (worker, target rank),
the flop rate and CURVE's cost per byte, from the workers' probes (dist/cost/probe.py) or from a
--cost-table file.

The file is read safely by dist/cost/tablefile.py; here its contents are checked (numbers in
range, links between ranks of the job) and turned into one table per phase, so that a test can
force a choice or change the costs at a given iteration. The measured model that reads these
tables is dist/cost/model.py.
"""
import json
import math

from .tablefile import read_cost_file
from ..errors import DistError


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
    data = read_cost_file(path)      # a regular file, bounded, UTF-8 JSON of the right shape
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
