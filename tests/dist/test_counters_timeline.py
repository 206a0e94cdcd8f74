"""What goes over the wire, per layer and iteration (--stats), and what the timeline shows.

Payload: PS moves the layer's M*N + M values up and down once per worker; SFB sends K*(M+N) + M
values to each of the P1 - 1 peers. Headers are counted apart. The cost model's per-node figures
follow from these counts. The timeline (--timeline) is one Chrome trace of every worker in which an
upper layer's sync overlaps the backward of lower layers (and does not with --no-overlap).

Run: python -m pytest tests/dist/test_counters_timeline.py -q
"""
import json

import pytest

from poseidon.dist.cost.formulas import ps_cost, sfb_cost
from poseidon.dist.worker.timeline import role_path
from poseidon.dist.transport import FIXED_HEADER_BYTES

from .helpers import conv_net, fc_net, make_lmdb, run_threads, solver_param

ITEM = 8            # float64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


def read_jsonl(path):
    with open(path, "r", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("sync,ipc", [("ps", "auto"), ("ps", "links"), ("sfb", "auto")])
def test_payload_per_layer_per_iteration(data, tmp_path, sync, ipc):
    """--ipc auto keeps a KV push's arrays in the server's shared memory
    (dist/transport/onehost/kvshm.py): its header then describes no arrays, and the payload counts
    the bytes moved through it."""
    P1, P2, K, iters = 3, 2, 4, 4
    stats = str(tmp_path / "stats.jsonl")
    solvers = run_threads(solver_param(fc_net(data, K), max_iter=iters), P1, P2, sync=sync,
                          stats=stats, kv_pair_bytes=8192, bucket_bytes=0,   # each layer alone
                          ipc=ipc)
                          # (on one host --bucket-bytes auto would share one sync between them)
    book = solvers[0].book
    dims = {rec.name: (rec.M, rec.N) for rec in book.layers}
    pairs_of = {rec.name: len(book.bundles_of_layer(rec.index)) for rec in book.layers}
    arrays_of = {rec.name: sum(len(book.pairs_of_param(p)) for p in rec.params)
                 for rec in book.layers}
    if sync == "ps" and ipc == "links":   # 8 kB pairs and messages: a small layer's bias
        assert pairs_of["ip1"] == arrays_of["ip1"] >= 2       # rides with its weight; full 8 kB
        assert pairs_of["ip2"] == arrays_of["ip2"] - 1 and pairs_of["ip3"] == 1   # pairs alone
    elif sync == "ps":  # in shared memory a layer's pairs on one server are one message
        assert book.data["merged_on_servers"]
        for rec in book.layers:
            servers = {p.server for pid in rec.params for p in book.pairs_of_param(pid)}
            assert pairs_of[rec.name] == len(servers) and arrays_of[rec.name] > 1
    for rank in range(P1):
        records = read_jsonl(role_path(stats, "worker", rank))
        assert [r["iter"] for r in records] == list(range(iters))
        for r in records:
            assert r["role"] == "worker" and r["rank"] == rank
            for name, layer in r["layers"].items():
                M, N = dims[name]
                assert layer["scheme"] == sync
                if sync == "ps":
                    assert layer["sent_payload"] == layer["recv_payload"] == (M * N + M) * ITEM
                    n = pairs_of[name]
                    assert layer["messages_sent"] == layer["messages_received"] == n
                    described = 0 if ipc == "auto" else 6 * arrays_of[name]
                    assert layer["sent_header"] == layer["recv_header"] == \
                        n * FIXED_HEADER_BYTES + described
                else:
                    per_peer = (K * (M + N) + M) * ITEM
                    assert layer["sent_payload"] == layer["recv_payload"] == (P1 - 1) * per_peer
                    header = FIXED_HEADER_BYTES + 2 * (2 + 8) + (2 + 4)   # G, X 2-D; bias 1-D
                    assert layer["sent_header"] == (P1 - 1) * header
                assert layer["sync_s"] > 0
            assert r["sent_payload"] == sum(v["sent_payload"] for v in r["layers"].values())
    for index in range(P2):
        records = read_jsonl(role_path(stats, "server", index))
        held = sum(p.length for p in book.pairs_on_server(index)) * ITEM
        if sync == "sfb":
            assert records == []                         # nothing to hold
            continue
        assert [r["iter"] for r in records] == list(range(iters))
        for r in records:
            assert r["bytes_held"] == held
            assert r["recv_payload"] == r["sent_payload"] == P1 * held

    # The per-node cost model follows from the counts. Node r hosts worker r and server r:
    # SFB: the worker sends K(M+N) (+M bias) to P1-1 peers and receives as much.
    if sync == "sfb":
        last = read_jsonl(role_path(stats, "worker", 0))[-1]["layers"]
        for name, layer in last.items():
            M, N = dims[name]
            floats = (layer["sent_payload"] + layer["recv_payload"]) / ITEM
            assert floats == sfb_cost(M, N, K, P1) + 2 * (P1 - 1) * M
    else:
        # PS with P2 = P1 servers co-located: the worker's traffic to the OTHER servers plus the
        # server's traffic with the OTHER workers is 2MN(P1+P2-2)/P2 when the pairs are spread evenly.
        for name in dims:
            M, N = dims[name]
            worker = (M * N + M) * 2                      # measured above: up and down, per worker
            assert worker * ITEM == read_jsonl(role_path(stats, "worker", 0))[0]["layers"][name][
                "sent_payload"] * 2
            node = worker * (P2 - 1) / P2 + worker * (P1 - 1) / P2
            assert node == pytest.approx(ps_cost(M, N, P1, P2) + 2 * M * (P1 + P2 - 2) / P2)


def _events(trace, pid, prefix):
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == pid
            and e["name"].startswith(prefix)]


def overlaps(trace, pid):
    """(upper layer's sync, lower layer's backward) pairs that overlap in time on worker pid."""
    found = []
    syncs = _events(trace, pid, "sync ")
    backs = _events(trace, pid, "backward ")
    for s in syncs:
        for b in backs:
            if (b["args"]["iter"] == s["args"]["iter"] and b["args"]["layer"] < s["args"]["layer"]
                    and b["ts"] < s["ts"] + s["dur"] and s["ts"] < b["ts"] + b["dur"]):
                found.append((s["name"], b["name"]))
    return found


@pytest.mark.slow
def test_timeline_shows_wfbp_overlap(data, tmp_path):
    path = str(tmp_path / "trace.json")
    run_threads(solver_param(conv_net(data, 8), max_iter=6), 2, 1, timeline=path,
                bucket_bytes=0)        # WFBP per layer (auto makes one bucket on one host)
    with open(path, "r", encoding="utf-8") as f:
        trace = json.load(f)
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {(0, "worker 0"), (1, "worker 1")}
    threads = {e["args"]["name"] for e in trace["traceEvents"]
               if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == 0}
    assert "compute (forward, backward)" in threads and any(t.startswith("sync") for t in threads)
    for pid in (0, 1):
        assert len(_events(trace, pid, "forward")) == 6
        assert len(_events(trace, pid, "sync ")) == 6 * 4           # conv1, conv2, ip1, ip2
        assert overlaps(trace, pid), "no sync of an upper layer overlaps a lower layer's backward"
        # the sync after the last backward has nothing to overlap: the training thread runs it
        syncs = _events(trace, pid, "sync ")
        lowest = min(e["args"]["layer"] for e in syncs)
        rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == pid}
        for e in syncs:
            on_pool = rows[e["tid"]].startswith("sync")
            assert on_pool == (e["args"]["layer"] != lowest), (e["name"], rows[e["tid"]])


@pytest.mark.slow
def test_no_overlap_syncs_after_the_whole_backward(data, tmp_path):
    path = str(tmp_path / "trace.json")
    run_threads(solver_param(conv_net(data, 8), max_iter=4), 2, 1, timeline=path,
                no_overlap=True)
    with open(path, "r", encoding="utf-8") as f:
        trace = json.load(f)
    for pid in (0, 1):
        assert overlaps(trace, pid) == []
        for it in range(4):
            backs = [e for e in _events(trace, pid, "backward ") if e["args"]["iter"] == it]
            syncs = [e for e in _events(trace, pid, "sync ") if e["args"]["iter"] == it]
            assert min(s["ts"] for s in syncs) >= max(b["ts"] + b["dur"] for b in backs) - 1


@pytest.mark.slow
def test_bandwidth_cap_is_applied(data, tmp_path):
    """--bandwidth 20Mbit: every process's sends go through a 2.5 MB/s token bucket."""
    import time
    t0 = time.monotonic()
    solvers = run_threads(solver_param(fc_net(data, 4), max_iter=3), 2, 1, sync="ps",
                          bandwidth="20Mbit")
    elapsed = time.monotonic() - t0
    assert solvers[0].transport.bucket.rate == 2.5e6
    # each worker pushes and the server answers ~84 kB per iteration per worker: >= 3 x 34 ms
    assert elapsed > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("force", [False, True])
def test_the_last_sync_runs_on_the_training_thread_unless_a_backward_follows_it(data, tmp_path,
                                                                                force):
    """The lowest synced layer's sync runs on the training thread: nothing is left to overlap
    with it. Not when a layer below it still has a backward to run (force_backward through a
    parameterless layer under conv1): that backward would wait for it. Either way the stats say
    how long the syncs ran past the end of backward."""
    text = conv_net(data, 8).replace('bottom: "data" top: "conv1"', 'bottom: "scaled" top: "conv1"')
    text = text.replace('layer { name: "conv1"', 'layer { name: "relu0" type: "ReLU" '
                        'bottom: "data" top: "scaled" }\nlayer { name: "conv1"', 1)
    if force:
        text = "force_backward: true\n" + text
    stats = str(tmp_path / "stats.jsonl")
    solvers = run_threads(solver_param(text, max_iter=3), 1, 1, stats=stats, bucket_bytes=0)
    solver = solvers[0]
    conv1 = solver.net.layer_names.index("conv1")
    assert min(solver.syncers) == conv1
    assert solver.net.layer_need_backward[conv1 - 1] == force          # relu0
    assert solver.hooks.wfbp.inline_layer == (None if force else conv1)
    for r in read_jsonl(role_path(stats, "worker", 0)):
        assert r["exposed_sync_s"] >= r["barrier_wait_s"] >= 0
        assert r["exposed_sync_s"] > 0        # conv1's sync always starts after its backward
        assert 0 < r["backward_s"] <= r["forward_backward_s"]      # the last sync not in it
