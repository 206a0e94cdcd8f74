"""Ring all-reduce (dist/schemes/allreduce.py, its plan in dist/schemes/ring.py).

- the plan: every chunk's pieces cover the flat gradient once, what a worker is sent is what its
  left neighbour sends, and each worker's floats add up to the cost model's figure;
- `--sync allreduce` on P1 = 2, 3 (an odd ring) and 4 workers, with and without overlap, ends with
  the parameters of one process on the combined batch (float64, 1e-5), and the replicas are
  bitwise identical; pieces are made small so every chunk goes as several;
- `--sync hybrid` on a net where BestScheme picks PS, SFB and the ring for different layers;
- the bytes each worker moves per layer are the plan's, and the cost model's on the wire;
- under --staleness every layer goes by PS; a piece from the wrong worker, of the wrong length or
  for a slot the ring lacks is dropped at the door; a worker that never sends its pieces stops the
  job within --timeout, with one line naming the layer and the worker.

Run: python -m pytest tests/dist/test_allreduce.py -q
"""
import json
import time
from dataclasses import replace

import numpy
import pytest

from poseidon.dist.coord.book import InformationBook
from poseidon.dist.coord.records import LayerRecord, description_from_wire
from poseidon.dist.coord.checks import WireRules
from poseidon.dist.cost.formulas import allreduce_cost, ps_cost, sfb_cost
from poseidon.dist.errors import DistError
from poseidon.dist.job.roles import Roles
from poseidon.dist.schemes import SCHEMES, choose_scheme, sync_choices
from poseidon.dist.schemes import allreduce
from poseidon.dist.schemes.ring import (ALL_GATHER, REDUCE_SCATTER, layer_floats, ring_address,
                                        ring_key, ring_plan)
from poseidon.dist.worker.timeline import role_path
from poseidon.dist.transport import FIXED_HEADER_BYTES, Message, Msg

from .helpers import (assert_params_close, conv_net, fc_net, make_lmdb, params_of, reference,
                      run_processes, run_threads, solver_param, skip_ring_part)

ITEM = 8                    # float64
ITERS = 5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of at most 32 floats: every chunk of the test nets' larger layers goes as several."""
    monkeypatch.setattr(allreduce, "PIECE_FLOATS", 32)


def run_and_compare(data, tmp_path, net_text, K, P1, P2, **options):
    """The job's workers against one process on the combined batch; the replicas bit for bit."""
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(net_text(data, P1 * K), max_iter=ITERS), weights_out=weights)
    solvers = run_threads(solver_param(net_text(data, K), max_iter=ITERS), P1, P2,
                          weights=weights, **options)
    label = f"P1={P1} P2={P2} {options}"
    for s in solvers:
        assert s.solver.iter == ITERS
        assert_params_close(params_of(s), want, rtol=1e-5, label=label)
    first = params_of(solvers[0])
    for s in solvers[1:]:
        for a, b in zip(params_of(s), first):
            assert numpy.array_equal(a, b), f"{label}: replicas differ"
    return solvers, {rec.name: rec.scheme for rec in solvers[0].book.layers}


# ----- the plan ------------------------------------------------------------------------------------
@pytest.mark.parametrize("floats,P,piece", [(440, 3, 32), (120, 4, 1 << 18), (3, 4, 2), (7, 1, 4)])
def test_the_plan_covers_the_gradient_and_matches_the_cost(floats, P, piece):
    plan = ring_plan(floats, P, piece)
    for c in range(P):                                  # the pieces of a chunk: its floats, once
        edges = [plan.piece(c, j) for j in range(plan.pieces)]
        assert edges[0][0] == plan.bounds[c] and edges[-1][1] == plan.bounds[c + 1]
        assert all(a[1] == b[0] for a, b in zip(edges, edges[1:]))
    assert plan.bounds[0] == 0 and plan.bounds[-1] == floats
    assert plan.slots == 2 * (P - 1) * plan.pieces
    for r in range(P):
        for phase in (REDUCE_SCATTER, ALL_GATHER):
            for s in range(P - 1):
                assert plan.received_chunk(phase, s, r) == plan.sent_chunk(phase, s, r - 1)
        # the last reduce-scatter step leaves worker r the sum of chunk r
        if P > 1:
            assert plan.received_chunk(REDUCE_SCATTER, P - 2, r) == r
            assert plan.sent_chunk(ALL_GATHER, 0, r) == r
        moved = plan.floats_sent(r) + plan.floats_received(r)
        assert abs(moved - allreduce_cost(floats, P)) < 4
    assert sum(plan.floats_sent(r) for r in range(P)) == \
        sum(plan.floats_received(r) for r in range(P))
    if floats % P == 0:
        assert plan.floats_sent(0) + plan.floats_received(0) == allreduce_cost(floats, P)
    for slot in range(plan.slots):
        assert ring_address(ring_key(17, slot)) == (17, slot)


def _layer(M, N, K=1, sfb=False, shapes=None, index=0):
    """A layer's record with the fields the costs read."""
    return LayerRecord(index=index, name=f"l{index}", type="InnerProduct", M=M, N=N, K=K, sfb=sfb,
                       params=(), shapes=None if shapes is None else tuple(map(tuple, shapes)))


def test_cost_and_traffic_of_the_scheme():
    rec = _layer(64, 576, 32, shapes=[[64, 576], [64]])
    F = 64 * 576 + 64
    cls = SCHEMES["allreduce"]
    assert layer_floats(rec) == F == layer_floats(_layer(64, 576))   # no shapes: a bias of M
    assert cls.cost(rec, 4, 2) == allreduce_cost(F, 4) == 2 * 2 * 3 / 4 * F
    traffic = cls.traffic(rec, 4, 2)
    assert traffic["floats"] == cls.cost(rec, 4, 2) and traffic["flops"] == 3 / 4 * F
    assert traffic["messages"] == 2 * 2 * 3 * ring_plan(F, 4, allreduce.PIECE_FLOATS).pieces
    assert cls.cost(rec, 1, 1) == 0 and cls.traffic(rec, 1, 0)["messages"] == 0
    # a layer index a piece's key cannot carry: the ring does not apply, BestScheme takes another
    assert cls.applies_to(replace(rec, index=(1 << 15) - 1))
    assert not cls.applies_to(replace(rec, index=1 << 15))
    assert choose_scheme(replace(rec, index=1 << 15), 4, 1, sync="allreduce") == "ps"
    assert "allreduce" in sync_choices()


def test_best_scheme_takes_the_cheapest_of_three():
    """With as many servers as workers the ring ties PS on a layer without a bias (and wins, being
    serverless) and loses to it by the bias otherwise; with fewer servers it beats PS; SFB still
    wins on a wide fully connected layer with a small batch."""
    def rec(M, N, K, sfb, bias=True):
        return _layer(M, N, K, sfb, shapes=[[M, N]] + ([[M]] if bias else []))
    conv, wide, nobias = rec(64, 576, 32, False), rec(4096, 4096, 32, True), \
        rec(1000, 1024, 128, True, bias=False)
    for P1, P2 in ((2, 2), (8, 8), (4, 1), (8, 2)):
        for r in (conv, wide, nobias):
            costs = {name: cls.cost(r, P1, P2) for name, cls in SCHEMES.items()
                     if cls.applies_to(r)}
            cheapest = min(costs.values())
            got = choose_scheme(r, P1, P2)
            assert costs[got] == cheapest, (P1, P2, r, costs)
    assert choose_scheme(conv, 8, 8) == "ps"
    assert choose_scheme(conv, 8, 2) == "allreduce"
    assert choose_scheme(nobias, 8, 8) == "allreduce"
    assert choose_scheme(wide, 8, 2) == "sfb"
    assert ps_cost(64, 576, 8, 8) < allreduce_cost(64 * 577, 8) < ps_cost(64, 576, 8, 2)
    assert sfb_cost(4096, 4096, 32, 8) < allreduce_cost(4096 * 4097, 8)


# ----- equivalence ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("P1", [2, 3, 4])
@pytest.mark.parametrize("no_overlap", [False, True])
def test_sync_allreduce_equals_one_process(data, tmp_path, small_pieces, P1, no_overlap):
    _, schemes = run_and_compare(data, tmp_path, conv_net, 2, P1, 1, sync="allreduce",
                                 no_overlap=no_overlap)
    assert set(schemes.values()) == {"allreduce"}


@pytest.mark.slow
def test_sync_allreduce_processes_equal_one_process(data, tmp_path, monkeypatch):
    """The odd ring (3 workers) as `poseidon train` processes, pieces of 32 floats by the flag
    (--piece-bytes 256): one process on the combined batch within 1e-5, and every replica
    bitwise worker 0's."""
    monkeypatch.setenv("POSEIDON_CONV", "im2col")     # the route the processes are pinned to
    P1, K = 3, 2
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(conv_net(data, P1 * K), max_iter=ITERS), weights_out=weights)
    got = run_processes(solver_param(conv_net(data, K), max_iter=ITERS), P1, 1, tmp_path,
                        weights=weights, sync="allreduce", piece_bytes=32 * ITEM)
    assert_params_close(got, want, rtol=1e-5, label="processes: allreduce P1=3, 32-float pieces")


def mixed_net(source, batch):
    """conv_net whose classifier has no bias: at P1 = P2 = 2 and K = 8 BestScheme sends the
    convolutions by PS (the ring moves their bias too), ip1 by SFB and the bias-free ip2 by the
    ring (it ties PS and needs no server)."""
    text = conv_net(source, batch)
    head = 'name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"\n  inner_product_param {'
    assert head in text
    return text.replace(head, head + " bias_term: false")


@pytest.mark.slow
@pytest.mark.parametrize("P1", [2, 3, 4])
@pytest.mark.parametrize("no_overlap", [False, True])
def test_hybrid_chooses_each_of_the_three_and_equals_one_process(data, tmp_path, small_pieces, P1,
                                                                 no_overlap):
    # a batch of 16 across the workers: SFB's factors grow with K·P1, so that keeps ip1 on SFB
    solvers, schemes = run_and_compare(data, tmp_path, mixed_net, 16 // P1, P1, P1,
                                       no_overlap=no_overlap)
    assert schemes == {"conv1": "ps", "conv2": "ps", "ip1": "sfb", "ip2": "allreduce"}
    for rec in solvers[0].book.layers:                  # what BestScheme picks is the cheapest
        costs = {name: cls.cost(rec, P1, P1) for name, cls in SCHEMES.items()
                 if cls.applies_to(rec)}
        assert costs[rec.scheme] == min(costs.values()), (rec.name, costs)


@pytest.mark.slow
def test_sync_a_plus_b_chooses_among_the_named_schemes_alone(data, tmp_path, small_pieces):
    """`--sync ps+sfb` is the paper's Algorithm 1: on the net where the full hybrid sends ip2 by
    the ring, it goes by PS (which ties the ring there on floats), and the job still equals one
    process; a name not registered is one line."""
    _, schemes = run_and_compare(data, tmp_path, mixed_net, 8, 2, 2, sync="ps+sfb")
    assert schemes == {"conv1": "ps", "conv2": "ps", "ip1": "sfb", "ip2": "ps"}
    rec = _layer(1000, 1024, 128, shapes=[[1000, 1024]])
    assert choose_scheme(rec, 8, 8, sync="sfb+allreduce") == "allreduce"
    assert choose_scheme(rec, 8, 8, sync="ps+sfb") == "ps"
    for bad in ("ps+nccl", "ps+ps"):
        with pytest.raises(DistError, match="joined by '\\+'"):
            choose_scheme(rec, 8, 8, sync=bad)


@pytest.mark.slow
def test_no_servers_under_hybrid_sends_convolutions_by_the_ring(data, tmp_path):
    _, schemes = run_and_compare(data, tmp_path, conv_net, 2, 2, 0)
    assert schemes == {"conv1": "allreduce", "conv2": "allreduce", "ip1": "sfb", "ip2": "sfb"}


@pytest.mark.slow
def test_resume_from_a_snapshot_is_bitwise(data, tmp_path):
    """Worker 0's snapshot holds the ring layers' solver history (each worker keeps its own copy,
    as for SFB); a resumed run hands it to every worker and ends with the uninterrupted run's
    bits."""
    def param(prefix):
        p = solver_param(conv_net(data, 2), max_iter=8)
        p.snapshot, p.snapshot_prefix = 4, str(prefix)
        return p
    full = run_threads(param(tmp_path / "a" / "run"), 3, 1, sync="allreduce", dtype="float32")
    resumed = run_threads(param(tmp_path / "b" / "run"), 3, 1, sync="allreduce", dtype="float32",
                          snapshot=str(tmp_path / "a" / "run_iter_4.solverstate"))
    assert resumed[0].solver.iter == 8
    for got, want in zip(resumed, full):
        for a, b in zip(params_of(got), params_of(want)):
            assert numpy.array_equal(a, b), "the resumed run differs from the uninterrupted one"


# ----- bytes on the wire ---------------------------------------------------------------------------
@pytest.mark.slow
def test_bytes_per_layer_are_the_plan_and_the_cost_model(data, tmp_path, small_pieces):
    P1, K = 3, 4
    stats, trace = str(tmp_path / "stats.jsonl"), str(tmp_path / "trace.json")
    solvers = run_threads(solver_param(fc_net(data, K), max_iter=3), P1, 1, sync="allreduce",
                          stats=stats, timeline=trace)
    book = solvers[0].book
    floats = {rec.name: layer_floats(rec) for rec in book.layers}
    exact = set()
    for rank in range(P1):
        with open(role_path(stats, "worker", rank), encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        assert len(records) == 3
        for r in records:
            for name, layer in r["layers"].items():
                plan = ring_plan(floats[name], P1, 32)
                assert plan.pieces > 1 or floats[name] <= 3 * 32
                assert layer["scheme"] == "allreduce"
                assert layer["sent_payload"] == plan.floats_sent(rank) * ITEM
                assert layer["recv_payload"] == plan.floats_received(rank) * ITEM
                assert layer["messages_sent"] == layer["messages_received"] == plan.slots
                assert layer["sent_header"] == plan.slots * (FIXED_HEADER_BYTES + 2 + 4)
                # where P1 divides the layer's floats (ip1, ip2), the cost model's figure
                # exactly; else (ip3's 125) within 4 floats
                moved = (layer["sent_payload"] + layer["recv_payload"]) / ITEM
                model = SCHEMES["allreduce"].traffic(book.layer(layer["layer"]), P1, 1)["floats"]
                assert model == allreduce_cost(floats[name], P1)
                if floats[name] % P1 == 0:
                    assert moved == model
                    exact.add(name)
                assert abs(moved - model) < 4
    assert exact == {"ip1", "ip2"}
    with open(trace, encoding="utf-8") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"
                  and e["name"].startswith("sync ")]
    assert events and all(e["args"]["scheme"] == "allreduce" and e["args"]["sent_payload"] > 0
                          for e in events)


# ----- relaxed consistency, wire checks, a missing peer --------------------------------------------
def _description(layers):
    recs, params = [], []
    for li, (kind, M, N, K, sfb) in enumerate(layers):
        pids = []
        for bi, shape in enumerate([(M, N), (M,)]):
            pids.append(len(params))
            params.append({"id": len(params), "name": f"l{li}[{bi}]", "layer": li,
                           "owner": [li, bi], "shape": list(shape), "count": int(numpy.prod(shape)),
                           "lr_mult": 1.0, "decay_mult": 1.0, "shared": False, "synced": True})
        recs.append({"index": li, "name": f"l{li}", "type": kind, "M": M, "N": N, "K": K,
                     "sfb": sfb, "params": pids, "shapes": [[M, N], [M]]})
    return description_from_wire({"net": "t", "dtype": "float64", "iter_size": 1, "layers": recs,
                                  "params": params})


@pytest.mark.slow
def test_relaxed_consistency_falls_back_to_ps(data):
    desc = _description([("Convolution", 64, 576, 32, False), ("InnerProduct", 100, 40, 64, True)])
    base = {"kv_pair_bytes": 1 << 20}
    bsp = InformationBook.build(desc, 4, 1, dict(base, sync="hybrid"))
    assert [rec.scheme for rec in bsp.layers] == ["allreduce", "allreduce"]
    for relax in ({"staleness": 2}, {"straggler_timeout": 1.0}):
        book = InformationBook.build(desc, 4, 1, dict(base, sync="hybrid", **relax))
        assert [rec.scheme for rec in book.layers] == ["ps", "ps"]
        assert [book.best_scheme(li) for li in (0, 1)] == ["ps", "ps"]
    with pytest.raises(DistError, match="--sync allreduce cannot be combined with --staleness"):
        InformationBook.build(desc, 4, 1, dict(base, sync="allreduce", staleness=1))
    # and a job: the layers the ring would take under BSP go by PS, and it trains
    solvers = run_threads(solver_param(conv_net(data, 2), max_iter=2), 3, 1, staleness=1)
    assert {rec.scheme for rec in solvers[0].book.layers} == {"ps"}


def test_a_bad_piece_is_dropped_at_the_door():
    desc = _description([("Convolution", 6, 27, 8, False)])      # 168 floats: chunks of 56
    book = InformationBook.build(desc, 3, 1, {"sync": "allreduce", "kv_pair_bytes": 1 << 20})
    roles = Roles(3, 1)
    rules = WireRules(1, roles, namer=roles.name)
    rules.set_book(book)
    plan = ring_plan(168, 3, allreduce.PIECE_FLOATS)
    length = plan.expected_length(0, 1)

    def piece(sender, slot, n, dtype=numpy.float64, layer=0):
        return Message(Msg.RING, sender, 4, ring_key(layer, slot), 0,
                       [numpy.zeros(n, dtype)], None, 30, n * 8)
    assert rules.check(piece(0, 0, length)) is None
    assert "takes the ring's pieces from worker 0" in rules.check(piece(2, 0, length))
    assert "expects float64 [56]" in rules.check(piece(0, 0, length + 1))
    assert "expects float64" in rules.check(piece(0, 0, length, numpy.float32))
    assert "is none that worker 1 takes" in rules.check(piece(0, plan.slots, length))
    assert "does not sync peer to peer" in rules.check(piece(0, 0, length, layer=5))
    assert "RING may come only from the workers" in rules.check(piece(3, 0, length))


@pytest.mark.slow
def test_a_missing_peer_stops_the_job_within_the_deadline(data, monkeypatch):
    """Worker 1 skips its part of ip2's ring at iteration 1: worker 0 waits for ip2's piece no
    longer than --timeout and the job stops with one line naming the layer and worker 1."""
    skip_ring_part(monkeypatch, 1, "ip2", 1)
    timeout = 3.0
    start = time.monotonic()
    with pytest.raises(DistError) as err:
        run_threads(solver_param(fc_net(data, 4), max_iter=4), 2, 1, sync="allreduce",
                    timeout=timeout)
    took = time.monotonic() - start
    text = str(err.value)
    print(f"\n{text} ({took:.1f} s)")
    assert "\n" not in text
    assert "layer 'ip2'" in text and "from worker 1" in text and "iteration 1" in text, text
    assert f"timed out after {timeout:g} s" in text, text
    assert took < 4 * timeout


# ----- the simulator -------------------------------------------------------------------------------
def test_the_simulator_moves_the_rings_bytes():
    """`poseidon simulate --modes allreduce`: every node sends and receives 2·(P1 − 1)/P1 of the
    layer, which is the cost model's figure, and with free communication the speedup is P1."""
    from poseidon.dist.sim.simulate import Network, simulate
    M, N, P = 1000, 1024, 8
    desc = _description([("InnerProduct", M, N, 32, True)])
    profile = {"model": "one", "batch": 32, "description": desc,
               "layers": [{"name": "l0", "type": "InnerProduct", "forward_ms": 10.0,
                           "backward_ms": 20.0}]}
    r = simulate(profile, P, "allreduce", Network())
    assert r.schemes == {"l0": "allreduce"}
    itemsize = 8                                        # the description's float64
    for sent, got in zip(r.node_bytes_sent, r.node_bytes_received):
        assert abs((sent + got) / itemsize - allreduce_cost(M * N + M, P)) < 4
    assert simulate(profile, P, "allreduce", Network.ideal()).speedup == pytest.approx(P)
    assert simulate(profile, 1, "allreduce", Network()).schemes == {"l0": "allreduce"}
