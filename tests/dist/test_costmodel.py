"""The measured cost model: predicted seconds per scheme, choices every rank shares, a layer that
changes scheme mid-run (its solver history moving with it), and bad --cost-table files.

Run: python -m pytest tests/dist/test_costmodel.py -x -q
"""
import json

import numpy
import pytest

from poseidon.dist.coord.book import cost_model
from poseidon.dist.coord.records import LayerRecord
from poseidon.dist.cost.formulas import ps_cost, sfb_cost
from poseidon.dist.cost.model import (Link, LinkTable, Planner, load_cost_table, plan,
                                     window_ratios)
from poseidon.dist.errors import DistError
from poseidon.dist.job.roles import Roles
from poseidon.dist.schemes import best_scheme, scheme_class
from poseidon.engine import backend

from .helpers import (assert_params_close, fc_net, make_lmdb, params_of, reference, run_threads,
                      solver_param)

GBIT = 1.25e8          # bytes a second of a 1 Gbit/s link


def table(roles, peers, servers, flops=1e10, encrypt=0.0, encrypted=False):
    rows = {w: {t: Link(*(servers if roles.is_server(t) else peers), encrypted=encrypted)
                for t in range(roles.size) if t != w} for w in roles.worker_ranks()}
    return LinkTable(rows, flops, encrypt)


def fc(M, N, K, index=0):
    return LayerRecord(index=index, name=f"fc{index}", type="InnerProduct", M=M, N=N, K=K,
                       sfb=True, params=(), candidates=("ps", "sfb"))


# ----- the model --------------------------------------------------------------------------------
def test_traffic_of_the_papers_schemes():
    rec = fc(4096, 4096, 32)
    ps, sfb = scheme_class("ps").traffic(rec, 8, 8), scheme_class("sfb").traffic(rec, 8, 8)
    assert ps == {"messages": 28, "floats": ps_cost(4096, 4096, 8, 8), "flops": 0.0}
    assert sfb == {"messages": 14, "floats": sfb_cost(4096, 4096, 32, 8),
                   "flops": 2.0 * 32 * 8 * 4096 * 4096}


def test_the_rebuild_makes_ps_win_where_floats_pick_sfb():
    """4096x4096 fc at K=32 on 8+8: floats pick SFB by 16x; with a slow GEMM the rebuild (8.6 G
    flops at 1 Gflop/s: 8.6 s) costs more than PS's 235 MB at 1.25 GB/s."""
    rec = fc(4096, 4096, 32)
    assert best_scheme(True, 4096, 4096, K=32, P1=8, P2=8) == "sfb"
    roles = Roles(8, 8)
    slow_gemm = table(roles, (1e-4, 10 * GBIT), (1e-4, 10 * GBIT), flops=1e9)
    choices, predicted = plan([rec], roles, slow_gemm, itemsize=4)
    assert choices == {0: "ps"}
    assert predicted[0]["sfb"] > 8.5 > predicted[0]["ps"]
    fast_gemm = table(roles, (1e-4, 10 * GBIT), (1e-4, 10 * GBIT), flops=1e13)
    assert plan([rec], roles, fast_gemm, itemsize=4)[0] == {0: "sfb"}


def test_latency_and_encryption_are_charged():
    roles = Roles(4, 4)
    rec = fc(64, 64, 8)                     # tiny: the messages' latency is all
    t = table(roles, (1e-3, GBIT), (1e-3, GBIT))
    _, predicted = plan([rec], roles, t, itemsize=4)
    assert predicted[0]["ps"] == pytest.approx(12 * 1e-3 + ps_cost(64, 64, 4, 4) * 4 / GBIT)
    curve = table(roles, (1e-3, GBIT), (1e-3, GBIT), encrypt=1e-8, encrypted=True)
    _, dearer = plan([rec], roles, curve, itemsize=4)
    assert dearer[0]["ps"] == pytest.approx(predicted[0]["ps"] + ps_cost(64, 64, 4, 4) * 4e-8)


def test_overlapping_syncs_queue_on_their_link():
    """Two equal layers whose lone choice is SFB (12.6 ms against PS's 16.8 ms): the lower one
    would wait for the upper one's factors on the peer links, so it goes to the idle servers."""
    roles = Roles(2, 1)
    t = table(roles, (1e-5, GBIT), (1e-5, GBIT), flops=1e13)
    layers = [fc(512, 512, 192, index=1), fc(512, 512, 192, index=2)]
    alone, _ = plan(layers[1:], roles, t, itemsize=4)
    assert alone == {2: "sfb"}
    both, predicted = plan(layers, roles, t, itemsize=4)
    assert both == {2: "sfb", 1: "ps"}
    assert predicted[1]["sfb"] == pytest.approx(2 * predicted[2]["sfb"], rel=1e-3)


def test_a_measured_choice_is_kept_within_the_margin():
    """SFB predicted 5% faster than PS: a layer on PS stays there (no history move for so little);
    at half PS's time it moves."""
    roles = Roles(2, 1)
    t = table(roles, (1e-5, GBIT), (1e-5, GBIT), flops=1e13)
    close = fc(512, 512, 243)
    assert plan([close], roles, t, itemsize=4)[0] == {0: "sfb"}
    assert plan([close], roles, t, itemsize=4, current={0: "ps"})[0] == {0: "ps"}
    far = fc(512, 512, 128)
    assert plan([far], roles, t, itemsize=4, current={0: "ps"})[0] == {0: "sfb"}


def test_a_window_gives_each_layer_the_ratio_of_the_scheme_it_ran():
    """Observed over the model's seconds alone, after the model's backlog: 2.5 s observed with 0.5
    s of backlog is a ratio of 2 on 1 s alone."""
    got = window_ratios({0: 2.5, 1: 300.0, 2: 1.0},
                        {0: {"ps": (0.5, 1.0), "sfb": (0.0, 4.0)}, 1: {"sfb": (0.0, 1.0)}},
                        {0: "ps", 1: "sfb"})
    assert got == {(0, "ps"): 2.0, (1, "sfb"): 100.0}       # clamped at 100; layer 2 not planned


def test_measured_is_the_default_across_hosts_only():
    assert cost_model({}, {0: "a", 1: "a", 2: "a"}, None) == "static"
    assert cost_model({}, {0: "a", 1: "b", 2: "a"}, None) == "measured"
    assert cost_model({"cost_model": "measured"}, {0: "a"}, None) == "measured"
    assert cost_model({"cost_model": "static"}, {0: "a", 1: "b"}, None) == "static"
    assert cost_model({"cost_model": "measured", "sync": "ps"}, {0: "a"}, None) == "static"
    assert cost_model({"cost_model": "measured"}, {0: "a"}, "--staleness") == "static"


# ----- bad tables: one line naming the file -------------------------------------------------
BAD = [
    ("{", "not JSON"),
    ('{"peers": {"alpha": 1e-4, "beta": 1e9}}', "needs a 'default' link"),
    ('{"default": {"alpha": 1e-4, "beta": 0}}', "the table.default.beta is 0"),
    ('{"default": {"alpha": 1e-4}}', "needs both 'alpha'"),
    ('{"default": {"alpha": 1e-4, "beta": 1e9}, "latency": 3}', "unknown key 'latency'"),
    ('{"default": {"alpha": 1e-4, "beta": 1e9}, "links": {"0-1": {"alpha": 0, "beta": 1}}}',
     "expected 'RANK->RANK'"),
    ('[{"from_iteration": 4, "default": {"alpha": 0, "beta": 1e9}}]', "must start at 0"),
    ('[]', "an empty list"),
]


@pytest.mark.parametrize("text,says", BAD, ids=[s for _, s in BAD])
def test_bad_cost_table_is_one_line(tmp_path, text, says):
    path = tmp_path / "costs.json"
    path.write_text(text)
    with pytest.raises(DistError) as e:
        load_cost_table(str(path))
    line = str(e.value)
    assert "\n" not in line and str(path) in line and says in line


def test_cost_table_naming_a_rank_outside_the_job_is_refused_at_start(tmp_path):
    from poseidon.dist.coord.coordinator import Coordinator
    from poseidon.dist.transport import free_port
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"default": {"alpha": 1e-4, "beta": 1e9},
                                "links": {"0->7": {"alpha": 1e-4, "beta": 1e9}}}))
    with pytest.raises(DistError) as e:
        Coordinator(Roles(2, 1), "127.0.0.1", free_port(), cost_table=str(path))
    assert "'0->7'" in str(e.value) and "2 workers and 1 servers" in str(e.value)
    with pytest.raises(DistError, match="cannot be read"):
        Planner(Roles(2, 1), load_cost_table(str(tmp_path / "missing.json")))


# ----- jobs: every rank takes the same choices; a switch mid-run changes no number -----------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


def stats_of(path, rank):
    base = str(path)
    stem, ext = base.rsplit(".", 1)
    with open(f"{stem}.worker-{rank}.{ext}", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def schemes_by_iteration(records):
    return [{name: rec["scheme"] for name, rec in r["layers"].items()} for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("ipc", ["auto", "off"])
def test_probed_choices_agree_on_every_worker(data, tmp_path, ipc):
    """The real probe, two workers, over Unix sockets and over TCP with CURVE: both write the same
    scheme and predicted time for every layer of every iteration (the coordinator decides, they
    take its answer)."""
    stats = tmp_path / "stats.jsonl"
    solvers = run_threads(solver_param(fc_net(data, 4), max_iter=6), 2, 1, cost_model="measured",
                          cost_refresh=2, stats=str(stats), ipc=ipc)
    assert solvers[0].book.measured
    a, b = stats_of(stats, 0), stats_of(stats, 1)
    assert len(a) == len(b) == 6
    for ra, rb in zip(a, b):
        for name, la in ra["layers"].items():
            lb = rb["layers"][name]
            assert (la["scheme"], la["predicted_s"]) == (lb["scheme"], lb["predicted_s"])
            assert la["predicted_s"] is not None and la["predicted_s"] > 0
    assert a[-1]["layers"]["ip1"]["observed_s"] > 0        # a refresh window's mean


def switching_run(data, tmp_path, on_gpu=False):
    """An injected table makes the fc layers SFB, then PS from the publish effective at
    iteration 8, then SFB again from 12: (the workers' solvers, the reference's parameters,
    worker 0's and worker 1's schemes by iteration)."""
    fast, slow = {"alpha": 1e-6, "beta": 1e11}, {"alpha": 1e-2, "beta": 1e6}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps([
        {"from_iteration": 0, "peers": fast, "servers": slow, "flops": 1e12},
        {"from_iteration": 8, "peers": slow, "servers": fast, "flops": 1e12},
        {"from_iteration": 12, "peers": fast, "servers": slow, "flops": 1e12}]))
    iters, K = 16, 8
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(fc_net(data, 2 * K), max_iter=iters), weights_out=weights)
    stats = tmp_path / "stats.jsonl"
    if on_gpu:
        backend.set_mode_gpu(0)
    try:
        solvers = run_threads(solver_param(fc_net(data, K), max_iter=iters), 2, 1,
                              weights=weights, cost_model="measured", cost_refresh=4,
                              cost_table=str(path), stats=str(stats))
    finally:
        backend.set_mode_cpu()
    return (solvers, want, schemes_by_iteration(stats_of(stats, 0)),
            schemes_by_iteration(stats_of(stats, 1)))


def check_switching(solvers, want, seen, seen_1):
    assert seen == seen_1
    assert [s["ip1"] for s in seen] == ["sfb"] * 8 + ["ps"] * 4 + ["sfb"] * 4
    assert all(len(set(s.values())) == 1 for s in seen)      # every fc layer switched together
    for s in solvers:
        assert_params_close(params_of(s), want, rtol=1e-5, label="switching")
    for x, y in zip(params_of(solvers[0]), params_of(solvers[1])):
        assert numpy.array_equal(x, y), "replicas differ"


@pytest.mark.slow
def test_switching_sfb_to_ps_and_back_equals_one_process(data, tmp_path):
    """Momentum's history moves with each switch, so the parameters still equal one process's on
    the combined batch (float64), and the replicas are bitwise equal."""
    check_switching(*switching_run(data, tmp_path))


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")
def test_switching_on_gpu_workers_equals_one_process(data, tmp_path):
    """The same on CuPy workers: the history fetched from the servers goes to the device."""
    solvers, want, seen, seen_1 = switching_run(data, tmp_path, on_gpu=True)
    assert solvers[0].net.xp is not numpy
    check_switching(solvers, want, seen, seen_1)


@pytest.mark.slow
def test_train_with_a_bad_cost_table_fails_in_one_line_before_any_process(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    bad = tmp_path / "costs.json"
    bad.write_text('{"default": {"alpha": -1, "beta": 1e9}}')
    solver = root / "prototxt" / "digits_quick" / "solver.prototxt"
    result = subprocess.run([sys.executable, "-m", "poseidon.tools.cli", "train", "--solver",
                             str(solver), "--workers", "2", "--cost-model", "measured",
                             "--cost-table", str(bad)], cwd=str(tmp_path), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(bad) in errors[0] and "alpha is -1" in errors[0], \
        result.stderr


@pytest.mark.slow
def test_snapshot_of_a_switching_run_resumes(data, tmp_path):
    """Snapshot at iteration 8, where the fc layers leave a peer scheme (SFB or the ring, whichever
    the table makes cheaper) for PS: the solverstate takes their
    history from worker 0 (the servers' copy is stale), the run goes on equal to one process, and
    the resumed run starts them on PS from the snapshot and ends equal to the uninterrupted one
    (to the float32 the engine writes snapshots in)."""
    fast, slow = {"alpha": 1e-6, "beta": 1e11}, {"alpha": 1e-2, "beta": 1e6}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps([{"from_iteration": 0, "peers": fast, "servers": slow},
                                {"from_iteration": 8, "peers": slow, "servers": fast}]))
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(fc_net(data, 8), max_iter=12), weights_out=weights)

    def run(folder, snapshot=None):
        p = solver_param(fc_net(data, 4), max_iter=12)
        p.snapshot, p.snapshot_prefix = 8, str(tmp_path / folder / "run")
        return run_threads(p, 2, 1, snapshot=snapshot, weights=None if snapshot else weights,
                           cost_model="measured", cost_refresh=4, cost_table=str(path))
    full = run("a")
    first = full[0].book.layers[0].index
    before, after = (full[0].book.best_scheme(first, it) for it in (7, 8))
    assert (before in ("sfb", "allreduce"), after) == (True, "ps"), (before, after)
    assert_params_close(params_of(full[0]), want, rtol=1e-5, label="snapshot at the switch")
    resumed = run("b", snapshot=str(tmp_path / "a" / "run_iter_8.solverstate"))
    for got, exp in zip(resumed, full):
        assert_params_close(params_of(got), params_of(exp), rtol=1e-6, label="resumed")
