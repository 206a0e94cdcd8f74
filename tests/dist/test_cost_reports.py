"""What the workers measure and report for the measured cost model, checked on fabricated inputs:

- the probe's fit: round-trip times of a small and a large message turned into a link's latency α
  and bandwidth β (with CURVE's share taken out on an encrypted link), and the report it sends;
- `LinkTable.from_reports`: every worker's report lands in the table on the link it describes,
  with the slowest flop rate and the dearest encryption cost;
- the published choices: every worker, not only worker 0, files them in its book.

Nothing here opens a socket: the probe's round trips, the coordinator and the transport are
stand-ins, so each check is exact and fast.

Run: python -m pytest tests/dist/test_cost_reports.py -q
"""
import json
from types import SimpleNamespace

import numpy
import pytest

from poseidon.dist.cost import probe
from poseidon.dist.coord.book import InformationBook
from poseidon.dist.coord.records import description_from_wire
from poseidon.dist.cost.model import LinkTable
from poseidon.dist.cost.sync import CostSync
from poseidon.dist.cost.probe import PROBE_BYTES, PROBE_ROUND_TRIPS, Prober
from poseidon.dist.job.roles import Roles


# ----- the probe's fit ----------------------------------------------------------------------------
def prober_with_times(times, keys=None, routes=None, rank=0, roles=None):
    """A Prober whose round trips take the given seconds, in order (no message is sent)."""
    transport = SimpleNamespace(rank=rank, keys=keys, routes=routes or {})
    p = Prober(transport, roles or Roles(2, 1))
    queue = list(times)
    seen = []

    def round_trip(target, payload):
        seen.append((target, payload.nbytes))
        return queue.pop(0)
    p._round_trip = round_trip
    p.seen = seen
    p.left = queue
    return p


def small_trips(fastest):
    """PROBE_ROUND_TRIPS small round trips, the fastest of which takes `fastest` seconds."""
    return [fastest * (1 + 0.5 * ((i + 1) % PROBE_ROUND_TRIPS)) for i in range(PROBE_ROUND_TRIPS)]


def test_the_fit_gives_latency_and_bandwidth_of_a_clear_link():
    """Small round trips of 200 µs at best (α = 100 µs, half of one); the large one takes 2 MiB at
    500 MB/s more than that: β = 500 MB/s."""
    alpha, beta = 1e-4, 5e8
    trips = small_trips(2 * alpha)
    assert min(trips) == 2 * alpha and trips[0] != 2 * alpha     # the fastest, not the first
    p = prober_with_times(trips + [2 * alpha + PROBE_BYTES / beta])
    got = p.link(1, encrypt_cost=0.0)
    assert got["alpha"] == pytest.approx(alpha, rel=1e-12)
    assert got["beta"] == pytest.approx(beta, rel=1e-9)
    assert got["encrypted"] is False
    assert p.left == []                                          # every round trip was taken
    assert [n for _, n in p.seen] == [probe.SMALL.nbytes] * PROBE_ROUND_TRIPS + [PROBE_BYTES]
    assert {t for t, _ in p.seen} == {1}


def test_the_fit_takes_curves_share_out_of_an_encrypted_link():
    """With keys and a TCP route the link is encrypted: CURVE's 0.2 ns a byte, measured apart, is
    taken out of the transfer, so β is the wire's; on a Unix-socket route (no CURVE) it is not."""
    alpha, beta, curve = 5e-5, 1e9, 2e-10
    transfer = PROBE_BYTES / beta + PROBE_BYTES * curve
    tcp = prober_with_times(small_trips(2 * alpha) + [2 * alpha + transfer], keys=object(),
                            routes={1: "tcp"})
    got = tcp.link(1, encrypt_cost=curve)
    assert got == {"alpha": pytest.approx(alpha, rel=1e-12), "beta": pytest.approx(beta, rel=1e-9),
                   "encrypted": True}
    ipc = prober_with_times(small_trips(2 * alpha) + [2 * alpha + transfer], keys=object(),
                            routes={1: "ipc"})
    got = ipc.link(1, encrypt_cost=curve)
    assert got == {"alpha": pytest.approx(alpha, rel=1e-12),
                   "beta": pytest.approx(PROBE_BYTES / transfer, rel=1e-9), "encrypted": False}


def test_the_fit_bounds_curves_share_and_the_bandwidth():
    """CURVE's share is never more than half the transfer (a noisy measurement cannot make the wire
    free), and a large message no slower than a small one reads as 1 TB/s, not as infinity."""
    alpha, transfer = 1e-4, 1e-3
    p = prober_with_times(small_trips(2 * alpha) + [2 * alpha + transfer], keys=object())
    got = p.link(1, encrypt_cost=1.0)               # a second a byte: far more than the transfer
    assert got["beta"] == pytest.approx(PROBE_BYTES / (transfer / 2), rel=1e-9)
    assert got["alpha"] == pytest.approx(alpha, rel=1e-12) and got["encrypted"] is True
    fast = prober_with_times(small_trips(2 * alpha) + [alpha])
    got = fast.link(1, encrypt_cost=0.0)
    assert got["beta"] == pytest.approx(1e12, rel=1e-9)
    assert got["alpha"] == pytest.approx(alpha, rel=1e-12)


def test_the_report_has_a_link_to_every_other_rank(monkeypatch):
    """Worker 1 of 3 workers and 1 server reports links to ranks 0, 2 and 3 (string keys, as JSON
    carries them), each from its own round trips, with its flop rate and CURVE's cost."""
    monkeypatch.setattr(probe, "flop_rate", lambda dtype, xp=numpy: 3e9)
    monkeypatch.setattr(probe, "curve_seconds_per_byte", lambda keys: 0.0)
    expect = {0: (1e-4, 1e9), 2: (2e-4, 5e8), 3: (3e-4, 2.5e8)}
    times = []
    for t in (0, 2, 3):
        a, b = expect[t]
        times += small_trips(2 * a) + [2 * a + PROBE_BYTES / b]
    p = prober_with_times(times, rank=1, roles=Roles(3, 1))
    report = p.report(numpy.float64)
    assert sorted(report) == ["encrypt_cost", "flops", "links"]
    assert report["flops"] == 3e9 and report["encrypt_cost"] == 0.0
    assert sorted(report["links"]) == ["0", "2", "3"]
    for t, (a, b) in expect.items():
        link = report["links"][str(t)]
        assert link["alpha"] == pytest.approx(a, rel=1e-12), t
        assert link["beta"] == pytest.approx(b, rel=1e-9), t
        assert link["encrypted"] is False
    assert [t for t, _ in p.seen] == [0] * 4 + [2] * 4 + [3] * 4
    assert json.loads(json.dumps(report)) == report


# ----- the link table from the reports ----------------------------------------------------------
def fabricated_reports():
    """Three workers and one server (rank 3): every link a different α and β, some encrypted,
    each worker a different flop rate and CURVE cost. Keys as the coordinator holds them: worker
    ranks as ints, targets as strings (they came through JSON)."""
    reports = {}
    for w in range(3):
        links = {}
        for t in range(4):
            if t != w:
                links[str(t)] = {"alpha": 1e-5 * (10 * w + t + 1), "beta": 1e8 * (10 * w + t + 1),
                                 "encrypted": t == 3 or (w + t) % 2 == 1}
        reports[w] = {"links": links, "flops": [4e9, 2.5e9, 7e9][w],
                      "encrypt_cost": [1e-10, 3e-10, 0.0][w]}
    return reports


def test_from_reports_puts_every_link_where_it_was_measured():
    reports = fabricated_reports()
    table = LinkTable.from_reports(reports)
    assert sorted(table.links) == [0, 1, 2]
    for w in range(3):
        assert sorted(table.links[w]) == [t for t in range(4) if t != w]
        for t in range(4):
            if t == w:
                continue
            link, want = table.links[w][t], reports[w]["links"][str(t)]
            assert (link.alpha, link.beta, link.encrypted) == \
                (want["alpha"], want["beta"], want["encrypted"]), (w, t)
    assert table.flops == 2.5e9                     # the slowest worker's
    assert table.encrypt_cost == 3e-10              # the dearest CURVE
    assert table.injected is False
    again = table.as_dict()
    assert again["encrypt_cost"] == 3e-10 and again["flops"] == 2.5e9
    assert again["links"]["2"]["3"] == {"alpha": 1e-5 * 24, "beta": 1e8 * 24, "encrypted": True}


def test_from_reports_charges_the_encryption_on_encrypted_links():
    """The slowest peer link of worker 1 -> worker 2 is encrypted: a transfer on it costs its α,
    its bytes over β and CURVE's seconds a byte; the servers' links all are encrypted."""
    reports = fabricated_reports()
    table = LinkTable.from_reports(reports)
    roles = Roles(3, 1)
    nbytes, messages = 1 << 20, 3
    peers = [table.links[w][t].seconds(messages, nbytes, 0.0)
             + (nbytes * 3e-10 if table.links[w][t].encrypted else 0.0)
             for w in range(3) for t in range(3) if t != w]
    assert table.slowest(roles, "peers", messages, nbytes) == pytest.approx(max(peers), rel=1e-12)
    servers = max(reports[w]["links"]["3"]["alpha"] * messages
                  + nbytes / reports[w]["links"]["3"]["beta"] + nbytes * 3e-10 for w in range(3))
    assert table.slowest(roles, "servers", messages, nbytes) == pytest.approx(servers, rel=1e-12)
    # a missing encryption cost would read as free: the dearer table is dearer by exactly CURVE's
    clear = LinkTable(table.links, table.flops, 0.0)
    assert table.slowest(roles, "servers", messages, nbytes) - \
        clear.slowest(roles, "servers", messages, nbytes) == pytest.approx(nbytes * 3e-10)


def test_from_reports_takes_the_probes_own_reports(monkeypatch):
    """The probe's reports of two workers, as they come through the coordinator, give a table with
    the links they measured and CURVE's cost of the worker that measured it dearer."""
    monkeypatch.setattr(probe, "flop_rate", lambda dtype, xp=numpy: 1e10)
    curve = {0: 1e-10, 1: 4e-10}
    reports = {}
    for w, (a, b) in ((0, (1e-4, 1e9)), (1, (3e-4, 2e8))):
        transfer = PROBE_BYTES / b + PROBE_BYTES * curve[w]
        p = prober_with_times(small_trips(2 * a) + [2 * a + transfer], keys=object(),
                              rank=w, roles=Roles(2, 0))
        monkeypatch.setattr(probe, "curve_seconds_per_byte", lambda keys, c=curve[w]: c)
        reports[w] = json.loads(json.dumps(p.report(numpy.float32)))
    table = LinkTable.from_reports(reports)
    assert table.encrypt_cost == 4e-10
    assert table.links[0][1].alpha == pytest.approx(1e-4) and table.links[0][1].encrypted
    assert table.links[1][0].alpha == pytest.approx(3e-4)
    assert table.links[0][1].beta == pytest.approx(1e9) and table.links[1][0].beta == \
        pytest.approx(2e8)


# ----- every worker files the published choices -------------------------------------------------
def measured_book(workers, servers):
    """A measured-model book of two layers that PS, SFB and the ring may each sync."""
    params, recs = [], []
    for li, (M, N) in enumerate([(40, 30), (20, 40)]):
        pids = []
        for bi, shape in enumerate([(M, N), (M,)]):
            pids.append(len(params))
            params.append({"id": len(params), "name": f"l{li}[{bi}]", "layer": li,
                           "owner": [li, bi], "shape": list(shape),
                           "count": int(numpy.prod(shape)), "lr_mult": 1.0, "decay_mult": 1.0,
                           "shared": False, "synced": True})
        recs.append({"index": li, "name": f"fc{li}", "type": "InnerProduct", "M": M, "N": N,
                     "K": 4, "sfb": True, "params": pids, "shapes": [[M, N], [M]]})
    desc = description_from_wire({"net": "t", "dtype": "float64", "iter_size": 1,
                                  "layers": recs, "params": params})
    return InformationBook.build(desc, workers, servers,
                                 {"sync": "hybrid", "kv_pair_bytes": 1 << 20,
                                  "cost_model": "measured"})


class Coordinator:
    """Answers report i with the i-th of `answers` (the SCHEMES object the coordinator sends)."""

    def __init__(self, answers):
        self.answers, self.reports = list(answers), []

    def report_costs(self, report, start):
        self.reports.append((report, start))
        return len(self.reports) - 1

    def published(self, call, timeout=None):
        return self.answers[call]

    def barrier(self, name, timeout=None):
        raise AssertionError(f"no barrier expected (a move between peer schemes): {name}")


def test_every_worker_files_the_published_choices():
    """Three workers each take the same two publishes (from iteration 0, after the probe; from
    iteration 4, after a refresh window of 2): every worker's book then gives the published scheme
    at every iteration, not Algorithm 1's, and all three books hold the same schedule."""
    workers = 3
    static = measured_book(workers, 1)
    candidates = {rec.index: rec.candidates for rec in static.layers}
    assert all({"sfb", "allreduce"} <= set(c) for c in candidates.values()), candidates
    first, later = {}, {}
    for li in candidates:
        # peer schemes only, each unlike what the book alone would say: no history moves, and a
        # worker that ignored a publish would be caught
        others = [n for n in ("sfb", "allreduce") if n != static.best_scheme(li)]
        first[li] = others[0]
        later[li] = "sfb" if first[li] == "allreduce" else "allreduce"
    answers = [{"from": 0, "choices": {str(li): n for li, n in first.items()},
                "predicted": {str(li): {n: 1e-3} for li, n in first.items()}},
               {"from": 4, "choices": {str(li): n for li, n in later.items()},
                "predicted": {str(li): {n: 2e-3} for li, n in later.items()}}]
    net = SimpleNamespace(dtype=numpy.float64, xp=numpy)
    books = []
    for rank in range(workers):
        book = measured_book(workers, 1)
        sync = CostSync(book, Coordinator(answers), kv=None,
                        transport=SimpleNamespace(rank=rank, keys=None, routes={}),
                        roles=Roles(workers, 1), refresh=2, slow=1.0)
        sync.prober = SimpleNamespace(report=lambda dtype, xp: {"links": {}})
        sync.start(0, net)
        for it in range(4):
            assert [book.best_scheme(li, it) for li in first] == list(first.values()), \
                (rank, it)
            sync.after_iteration(it, [])
        assert sync.due(4) and not sync.due(3)
        sync.before_iteration(4, net, history={})
        for it in range(4, 6):
            assert [book.best_scheme(li, it) for li in later] == list(later.values()), \
                (rank, it)
        assert sync.predicted == {li: {n: 2e-3} for li, n in later.items()}, rank
        books.append(book)
    assert all(b.schedule == books[0].schedule for b in books)
    assert books[0].schedule == [(0, first), (4, later)]
