"""BestScheme on link costs: a table of what each link costs, and a predicted sync time per scheme.

Why: Table 1 of the paper (dist/cost/formulas.py) counts floats on the busiest node, which misleads twice:
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

A `LinkTable` (dist/cost/links.py) is one process's view of its links: {target rank: Link(α, β,
encrypted)} per worker, the flop rate and c_enc. It comes from the start-up probe
(dist/cost/probe.py) or from a JSON file (`--cost-table`, which tests use to force a choice; see
`load_cost_table`).

Refresh (`Planner`, `Corrections`): the sync times the workers observe correct the model per
(layer, scheme), as the ratio of observed to uncorrected modelled seconds in the windows that
layer ran that scheme (a median, kept while the layer runs another), and a layer moves only for a
scheme predicted faster by a margin and beyond the spread of those windows, so that steady costs
settle each layer after one move at most while a real change is followed within two windows. The
rule and its numbers are explained in docs/distributed.md ("Refresh").
"""
import math

from .links import Link, LinkTable, load_cost_table
from ..errors import DistError
from ..schemes import choose_scheme, scheme_class

# the tables come from dist/cost/links.py; callers take them from here with the model
__all__ = ["Link", "LinkTable", "load_cost_table", "link_kind", "scheme_seconds",
           "modelled_seconds", "plan", "window_ratios", "Corrections", "Planner"]

# A layer moves to another scheme only if that is predicted at least this much faster than its own
# (predicted < SWITCH_MARGIN x its own), the other taken at the highest ratio of its recent windows
# and its own at the lowest: every move moves solver history, and two schemes of nearly equal
# cost must not swap on noise (docs/distributed.md, "Refresh", says why these numbers).
SWITCH_MARGIN = 0.85
# ... and to a scheme it has never run (whose correction is borrowed, see Corrections) only if that
# is predicted at least this much faster: a borrowed correction is a guess.
TRY_MARGIN = 0.7
# Evidence is a span of refresh windows: two, or as many as make EVIDENCE iterations when the
# windows are shorter (--cost-refresh under 4: one iteration's sync time is mostly noise). A layer
# leaves a scheme only after a span of it (one window of a scheme just taken may be one the host
# was busy in).
EVIDENCE = 8
# A (layer, scheme)'s correction is the median of the observed/modelled ratios of the last MEMORY
# spans of refresh windows in which that layer ran that scheme; it is kept while the layer runs
# another.
MEMORY = 4
# When the newest span of ratios all lie beyond STEP times the median of the ones before them (all
# above, or all below), the cost has changed: the older ratios are dropped, so the correction
# follows within a span (two windows).
STEP = 1.5
# a window's ratio is kept within these factors (a stalled window should not rule the median)
MIN_CORRECTION, MAX_CORRECTION = 0.01, 100.0


def link_kind(cls):
    return "servers" if cls.uses_servers else "peers"


def scheme_seconds(cls, rec, roles, table, itemsize):
    """(transfer seconds, compute seconds) the model gives scheme class `cls` syncing layer `rec`
    for one iteration, before contention and before any correction."""
    t = cls.traffic(rec, roles.workers, roles.servers)
    if not math.isfinite(t["floats"]):
        return math.inf, 0.0
    transfer = table.slowest(roles, link_kind(cls), t["messages"], t["floats"] * itemsize)
    return transfer, t["flops"] / table.flops


def _walk(layers, roles, table, itemsize, pick):
    """The layers in backward order (WFBP's), each adding the transfer of the scheme `pick` gives
    it to the backlog of its kind of link: ({layer: scheme}, {layer: {scheme: (backlog, alone)}}),
    `alone` the scheme's seconds without contention, both uncorrected. `pick(rec, modelled)`, with
    the layer's {scheme: (backlog, alone)}, returns a scheme name."""
    backlog = {"peers": 0.0, "servers": 0.0}
    choices, modelled = {}, {}
    for rec in sorted(layers, key=lambda r: -r.index):
        li = rec.index
        own, transfers = {}, {}
        for name in rec.candidates:
            cls = scheme_class(name)
            transfer, compute = scheme_seconds(cls, rec, roles, table, itemsize)
            transfers[name] = transfer
            own[name] = (backlog[link_kind(cls)], transfer + compute)
        choices[li] = pick(rec, own)
        modelled[li] = own
        backlog[link_kind(scheme_class(choices[li]))] += transfers[choices[li]]
    return choices, modelled


def modelled_seconds(layers, roles, table, itemsize, choices):
    """{layer: {scheme: seconds}} the model gives (uncorrected, contention included) when the
    layers run `choices` {layer: scheme}."""
    modelled = _walk(layers, roles, table, itemsize, lambda rec, own: choices[rec.index])[1]
    return {li: {n: b + a for n, (b, a) in own.items()} for li, own in modelled.items()}


def plan(layers, roles, table, itemsize, current=None, correction=None):
    """BestScheme on predicted seconds: ({layer index: scheme name}, {layer index: {scheme name:
    predicted seconds}}). `layers`: the book's records, each with its 'candidates' (the scheme
    names that may sync it). `correction`: a Corrections, whose factor for (layer, scheme)
    multiplies the scheme's own seconds (the backlog is the model's); None: none. `current`: the
    schemes now in use, each kept unless another is predicted faster by SWITCH_MARGIN (with a
    correction: after a span of windows of the current one, TRY_MARGIN if the layer has not run
    the other, each at the edge of its recent ratios). Layers go in backward order (WFBP's), each
    adding its transfer to the backlog of its kind of link (the contention rule of the module
    docstring)."""
    return _plan(layers, roles, table, itemsize, current, correction)[:2]


def _plan(layers, roles, table, itemsize, current=None, correction=None):
    """plan()'s choices and predicted seconds, and the model's {layer: {scheme: (backlog,
    alone)}} they were corrected from."""
    predicted = {}

    def pick(rec, own):
        li = rec.index
        mine = predicted[li] = {n: b + a * (correction.factor(li, n) if correction else 1.0)
                                for n, (b, a) in own.items()}
        best = choose_scheme(rec, roles.workers, roles.servers, predicted=mine)
        keep = (current or {}).get(li)
        if keep not in mine or best == keep:
            return best
        if correction is None:           # the model alone (the probe's, or a --cost-table)
            return best if mine[best] < SWITCH_MARGIN * mine[keep] else keep
        if correction.windows(li, keep) < correction.span:
            return keep                  # not enough of its own scheme seen yet
        (b_keep, a_keep), (b_best, a_best) = own[keep], own[best]
        low, high = correction.bounds(li, keep)[0], correction.bounds(li, best)[1]
        margin = SWITCH_MARGIN if correction.own(li, best) is not None else TRY_MARGIN
        return best if b_best + a_best * high < margin * (b_keep + a_keep * low) else keep

    choices, modelled = _walk(layers, roles, table, itemsize, pick)
    return choices, predicted, modelled


def window_ratios(observed, modelled, choices):
    """{(layer, scheme): ratio} of a refresh window: by how much the scheme that ran took longer
    than the model says it takes alone, its backlog (the model's) taken out first; clamped.
    `observed`: {layer: seconds} (the slowest worker's median over the window); `choices`: the
    schemes that ran in it, `modelled`: the model's {layer: {scheme: (backlog, alone)}} then."""
    ratios = {}
    for li, seen in observed.items():
        name = choices.get(li)
        backlog, alone = (modelled.get(li) or {}).get(name) or (0.0, None)
        if name is None or not alone or not math.isfinite(alone) or not math.isfinite(seen):
            continue
        ratios[(li, name)] = _clamp((seen - backlog) / alone)
    return ratios


def _clamp(ratio):
    return min(MAX_CORRECTION, max(MIN_CORRECTION, ratio))


def _median(values):
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else math.sqrt(v[mid - 1] * v[mid])


class Corrections:
    """What observed sync times say about the model, per (layer, scheme) pair: the ratios of
    observed to modelled seconds of the last MEMORY spans of windows (`span` windows each: 2, or
    more when the windows are short, see EVIDENCE) in which that layer ran that scheme. The
    pair's factor is their median; (their lowest, their highest) bound it for the switching rule.
    A pair keeps its ratios while its layer runs another scheme.

    A change of cost is told from noise by a span of consecutive windows: when a pair's newest
    `span` ratios all lie beyond STEP times the median of its earlier ones, in the same direction,
    the earlier ones are dropped (the pair follows at once). If pairs of one scheme only show such
    a change, it is that scheme's: the pairs of that scheme not measured now move with it. If
    pairs of two or more schemes show it together (or pairs of another scheme moved the same way
    by at least half as much, in logs), it is the load's (a busier host slows every sync): every
    pair not measured now moves with it, so a layer compares its scheme with one it does not run
    at the same load.

    A pair never measured borrows the median factor of the same scheme on other layers, else of the
    schemes on the same kind of link (this layer's too), else 1: a kind of link the model
    misjudges does not bias a scheme on the other kind, which is then tried (TRY_MARGIN)."""

    def __init__(self, span=2):
        self.span = span
        self.ratios = {}                 # {(layer, scheme): [ratio, oldest first]}
        self.live = set()                # the pairs measured in the last window

    def add(self, ratios):
        """Take a window's {(layer, scheme): ratio} (window_ratios)."""
        span = self.span
        moved, changed = {}, {}          # {pair: its newest span over the median of those before};
        for key, r in ratios.items():    # {pair beyond STEP: +1 up, -1 down}
            seen = self.ratios.setdefault(key, [])
            seen.append(r)
            if len(seen) > span:
                before, new = _median(seen[:-span]), seen[-span:]
                moved[key] = _median(new) / before
                if min(new) > STEP * before:
                    changed[key] = 1
                elif max(new) * STEP < before:
                    changed[key] = -1
        self.live = set(ratios)
        half = math.sqrt(STEP)
        for way in (1, -1):
            steps = {}                   # {scheme: [move]} of the pairs that changed this way
            for key, w in changed.items():
                if w == way:
                    steps.setdefault(key[1], []).append(moved[key])
            if not steps:
                continue
            # the load's if pairs of two schemes changed, or a pair of another scheme moved the
            # same way by at least half as much (in logs)
            elsewhere = any(name not in steps and (m > half if way > 0 else m * half < 1)
                            for (_, name), m in moved.items())
            load = (_median([m for ms in steps.values() for m in ms])
                    if len(steps) > 1 or elsewhere else None)
            for key, seen in self.ratios.items():
                if key in changed:
                    del seen[:-span]     # the pair follows its own new level
                    continue
                move = _median(steps[key[1]]) if key[1] in steps else load
                if move:                 # the others move with it, but for what was just measured
                    older = max(0, len(seen) - span) if key in self.live else len(seen)
                    seen[:older] = [_clamp(x * move) for x in seen[:older]]
        for seen in self.ratios.values():
            del seen[:-MEMORY * span]

    def windows(self, li, name):
        """How many windows' ratios the pair holds."""
        return len(self.ratios.get((li, name)) or ())

    def own(self, li, name):
        """The median of the pair's own ratios (None: never measured)."""
        seen = self.ratios.get((li, name))
        return _median(seen) if seen else None

    def factor(self, li, name):
        """The pair's factor: its own, else a borrowed one (see the class's docstring)."""
        mine = self.own(li, name)
        if mine is not None:
            return mine
        kind = link_kind(scheme_class(name))
        for same in (lambda l, n: n == name and l != li,
                     lambda l, n: link_kind(scheme_class(n)) == kind):
            others = [self.own(l, n) for (l, n) in self.ratios if same(l, n)]
            if others:
                return _median(others)
        return 1.0

    def bounds(self, li, name):
        """(lowest, highest) ratio of the pair's recent windows; a pair never measured: its
        borrowed factor, twice."""
        seen = self.ratios.get((li, name))
        if not seen:
            f = self.factor(li, name)
            return f, f
        return min(seen), max(seen)


# ------------------------------------------------------------------------------------------------
# the coordinator's side: reports in, choices out
# ------------------------------------------------------------------------------------------------
class Planner:
    """Turns the workers' reports into the choices every worker takes (the coordinator runs it, so
    every rank gets the same answer). `injected`: an InjectedCosts, which replaces the probe.

    A refresh window's sync times are credited to the choices that ran in it: those of the publish
    in force at the window's last iteration, which (the choices of a report taking effect one
    window later, dist/cost/sync.py) is the publish two reports back, not the latest. Its observed
    seconds are compared with that publish's uncorrected (modelled) seconds, so the corrections
    are ratios that stay put while the costs do, whichever predictions were published since."""

    KEEP = 4                             # publishes kept to look the windows' choices up in

    def __init__(self, roles, injected=None):
        self.roles, self.injected = roles, injected
        self.table = None
        self.current = None              # {layer: scheme} of the last publish
        self.predicted = {}              # {layer: {scheme: seconds}} of the last publish
        self.corrections = Corrections()
        self.published = []              # [(from iteration, choices, modelled seconds)]
        self._last_refresh = None        # the `start` of the last refresh report
        if injected is not None:         # a fault in the file stops the job before it starts
            for phase in injected.phases:
                injected.table_at(phase["from"], roles)

    def in_force(self, it):
        """(choices, modelled seconds) of the publish in force at iteration `it` (the oldest kept
        if none is)."""
        ran = [p for p in self.published if p[0] <= it] or self.published[:1]
        return ran[-1][1:] if ran else ({}, {})

    def _window(self, book, start):
        """(iterations a window holds, the last of them) for the refresh report of choices from
        `start` (0, -1 if not known)."""
        refresh = int((getattr(book, "options", None) or {}).get("cost_refresh") or 0)
        if refresh <= 0 and self._last_refresh is not None:
            refresh = start - self._last_refresh        # consecutive windows
        return (refresh, start - refresh - 1) if refresh > 0 else (0, -1)

    def decide(self, book, reports, start):
        """The SCHEMES message's object for choices in force from iteration `start`. `reports`:
        {worker rank: {"links", "flops", "encrypt_cost"}} (the probe) or {"observed": {layer:
        median sync seconds}} (a refresh window; the first after a probe is not used, its
        iterations pay for the start)."""
        corrected = self.injected is None
        if all("links" in rep for rep in reports.values()):
            if self.injected is None:
                self.table = LinkTable.from_reports(reports)
            self.published, self._last_refresh = [], None     # a (re)start: iterations anew
        elif self.table is not None and self.current is not None and corrected:
            observed = {}
            for rep in reports.values():
                for li, seconds in (rep.get("observed") or {}).items():
                    observed[int(li)] = max(observed.get(int(li), 0.0), float(seconds))
            if self._last_refresh is not None:       # the first window is the warm-up's
                refresh, end = self._window(book, int(start))
                self.corrections.span = max(2, -(-EVIDENCE // refresh)) if refresh else 2
                choices, modelled = self.in_force(end)
                self.corrections.add(window_ratios(observed, modelled, choices))
            self._last_refresh = int(start)
        if self.injected is not None:
            self.table = self.injected.table_at(start, self.roles)
        if self.table is None:
            raise DistError("the coordinator got sync times before any link costs (the probe)")
        layers = [rec for rec in book.layers if rec.candidates]
        choices, predicted, modelled = _plan(
            layers, self.roles, self.table, int(book.data["itemsize"]), current=self.current,
            correction=self.corrections if corrected else None)
        self.current, self.predicted = choices, predicted
        self.published = (self.published + [(int(start), choices, modelled)])[-self.KEEP:]
        return {"from": int(start), "choices": {str(li): n for li, n in choices.items()},
                "predicted": {str(li): {n: (s if math.isfinite(s) else None)
                                        for n, s in p.items()} for li, p in predicted.items()},
                "table": self.table.as_dict()}
