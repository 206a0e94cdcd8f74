"""`poseidon simulate` beyond the paper: ring all-reduce, the choice by predicted time, priority,
G devices per node behind a leader, and the ResNet-152 profile (dist/sim/simulate.py,
dist/sim/cost.py, dist/sim/profile.py).

* the by-time choice is never below the best single scheme, for the four shipped models at several
  node counts and bandwidths (printed as a table);
* all-reduce moves 2·(P1−1)/P1 of a layer per node, in 2·(P1−1) latencies (by hand);
* priority never makes an iteration longer than FIFO, and can make it shorter;
* G = 2 devices per node: by hand, and exactly twice the speedup when the node's link is free;
* the ResNet-152 profile loads and has ResNet-152's layers and parameters.
"""
import math
from dataclasses import replace
from pathlib import Path

import pytest

from poseidon.dist.coord.records import LayerRecord
from poseidon.dist.sim import profile as simprofile
from poseidon.dist.sim.cost import (Shape, algorithm1_plan, layer_times, paper_scheme,
                                   predicted_plan)
from poseidon.dist.sim.simulate import MODES, Network, simulate
from poseidon.dist.units import parse_rate

from tests.dist.test_simulate import one_layer_profile, poseidon

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("vgg19", "vgg19_22k", "googlenet", "resnet152")
SINGLE = ("wfbp", "allreduce", "sfb")


@pytest.fixture(scope="module")
def profiles():
    return {m: simprofile.load_profile(m) for m in MODELS}


def net_at(bandwidth, **kw):
    return Network(bandwidth=parse_rate(bandwidth), **kw)


# ------------------------------------------------------------------------------------------------
# the choice by predicted time
# ------------------------------------------------------------------------------------------------
# (nodes, bandwidth): slow and fast networks at small and larger node counts; 32 nodes at 40 GbE
# for VGG19-22K, the case where Algorithm 1's float count loses to PS alone
GRID = {"vgg19": ((4, "1Gbit"), (16, "10GbE")),
        "vgg19_22k": ((8, "10GbE"), (32, "40Gbit")),
        "googlenet": ((2, "1Gbit"), (8, "40Gbit")),
        "resnet152": ((4, "2.5Gbit"), (8, "40Gbit"))}


@pytest.mark.parametrize("model", MODELS)
def test_by_time_never_below_the_best_single_scheme(profiles, model):
    print(f"\n{model:10s} {'nodes':>5s} {'network':>8s} " + " ".join(f"{m:>9s}" for m in SINGLE)
          + f" {'by time':>9s} {'priority':>9s}  plan")
    for nodes, bandwidth in GRID[model]:
        net = net_at(bandwidth)
        single = {m: simulate(profiles[model], nodes, m, net).speedup for m in SINGLE}
        fifo = simulate(profiles[model], nodes, "ps-sfb-ar", net)
        prio = simulate(profiles[model], nodes, "ps-sfb-ar-priority", net)
        print(f"{model:10s} {nodes:5d} {bandwidth:>8s} "
              + " ".join(f"{v:8.2f}x" for v in single.values())
              + f" {fifo.speedup:8.2f}x {prio.speedup:8.2f}x  {fifo.plan}")
        best = max(single.values())
        assert fifo.speedup >= best * (1 - 1e-9), (model, nodes, bandwidth, single, fifo.speedup)
        assert prio.speedup >= best * (1 - 1e-9), (model, nodes, bandwidth, single, prio.speedup)
        assert fifo.speedup <= nodes * (1 + 1e-9) and prio.speedup <= nodes * (1 + 1e-9)


def test_the_prediction_counts_the_sfb_rebuild(profiles):
    # VGG19-22K, 32 nodes, 40 GbE at its full line rate (TCP and the host stack not in the way):
    # Algorithm 1 sends fc6-fc8 by SFB on a float count, and loses to PS alone; the prediction
    # counts the rebuild GEMM (and the backward PS hides under) and keeps them off SFB. At 10 GbE
    # the bytes dominate and SFB is the prediction's choice too.
    prof = profiles["vgg19_22k"]
    fc = {rec.index: rec.name for rec in prof["description"]["layers"] if rec.sfb}
    fast = net_at("40Gbit", tcp_efficiency=1.0, stack_rate=math.inf)
    plan = predicted_plan(prof, 32, fast)
    assert {plan[li] for li in fc} != {"sfb"}
    assert {algorithm1_plan(prof, 32, 32)[li] for li in fc} == {"sfb"}
    paper = simulate(prof, 32, "poseidon", fast).speedup
    wfbp = simulate(prof, 32, "wfbp", fast).speedup
    by_time = simulate(prof, 32, "ps-sfb-ar", fast)
    assert paper < wfbp <= by_time.speedup
    assert by_time.plan == "by predicted time"          # the prediction alone, not the check
    slow = predicted_plan(prof, 32, net_at("10GbE"))
    assert slow[min(fc, key=lambda li: -rec_size(prof, li))] == "sfb"     # fc6, 103 M weights


def rec_size(prof, li):
    rec = next(r for r in prof["description"]["layers"] if r.index == li)
    return rec.M * rec.N


def test_predicted_times_by_hand():
    # one 1000 x 3000 InnerProduct at K = 16 on 4 nodes, 1 GB/s, 1e-4 s a message, 1e12 FLOP/s
    rec = LayerRecord(index=0, name="fc", type="InnerProduct", M=1000, N=3000, K=16, sfb=True,
                      params=(0,))
    nbytes, count = 1000 * 3000 * 4, 1000 * 3000
    net = Network.ideal(bandwidth=1e9, latency=1e-4)
    t = layer_times(rec, nbytes, count, Shape(4, 4), net, 1e12, 4)
    assert t["ps"].link == pytest.approx(2e-4 + nbytes * 6 / 4 / 1e9)
    assert t["ps"].gpu == 0
    assert t["allreduce"].link == pytest.approx(6e-4 + 2 * 3 / 4 * nbytes / 1e9)
    assert t["allreduce"].gpu == pytest.approx((3 / 4 * count + 4 * count) / 1e12)
    assert t["sfb"].link == pytest.approx(1e-4 + 3 * 16 * 4000 * 4 / 1e9)
    assert t["sfb"].gpu == pytest.approx(2 * 1000 * 3000 * 16 * 3 / 1e12)
    assert "sfb" not in layer_times(replace(rec, sfb=False), nbytes, count, Shape(4, 4), net, 1e12, 4)


def test_paper_scheme_is_table_1():
    rec = LayerRecord(index=0, name="fc", type="InnerProduct", M=4096, N=4096, K=32, sfb=True,
                      params=())
    for P in (2, 8, 32, 64):
        sfb = 2 * 32 * (P - 1) * (4096 + 4096)
        ps = 2 * 4096 * 4096 * (2 * P - 2) / P
        assert paper_scheme(rec, P, P) == ("sfb" if sfb <= ps else "ps")
    assert paper_scheme(replace(rec, sfb=False), 8, 8) == "ps"


# ------------------------------------------------------------------------------------------------
# all-reduce
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_allreduce_moves_2_p1_minus_1_over_p1_of_the_layer(P):
    M, N = 512, 1024
    r = simulate(one_layer_profile(M, N, 32, bias=False), P, "allreduce", Network())
    layer = M * N * 4
    assert r.node_bytes_sent == [2 * (P - 1) * layer // P] * P
    assert r.node_bytes_received == r.node_bytes_sent
    assert set(r.schemes.values()) == {"allreduce"}


def test_allreduce_takes_its_bytes_and_2_p1_minus_1_latencies_by_hand():
    prof = one_layer_profile(200, 500, 32, bias=False)
    size = 200 * 500 * 4
    for P in (2, 4):
        r = simulate(prof, P, "allreduce", Network.ideal(bandwidth=1e9, latency=1e-4))
        hand = 0.030 + 2 * (P - 1) * size / P / 1e9 + 2 * (P - 1) * 1e-4
        assert r.iteration_s == pytest.approx(hand, rel=1e-9), P
    # the reduction and the update run on every worker at the given FLOP rate
    r = simulate(prof, 2, "allreduce", Network.ideal(gemm_rate=1e9))
    assert r.iteration_s == pytest.approx(0.030 + (0.5 + 4) * 200 * 500 / 1e9, rel=1e-9)


# ------------------------------------------------------------------------------------------------
# priority
# ------------------------------------------------------------------------------------------------
def test_priority_never_slower_than_fifo(profiles):
    for model, nodes, bandwidth in (("vgg19", 8, "10GbE"), ("vgg19_22k", 8, "2.5Gbit"),
                                    ("googlenet", 8, "2.5Gbit"), ("resnet152", 4, "10GbE")):
        net = net_at(bandwidth)
        fifo = simulate(profiles[model], nodes, "ps-sfb-ar", net).iteration_s
        prio = simulate(profiles[model], nodes, "ps-sfb-ar-priority", net).iteration_s
        assert prio <= fifo * (1 + 1e-9), (model, nodes, bandwidth, fifo, prio)


def test_priority_lets_the_next_forward_start_while_upper_layers_sync():
    # two equal layers, backward top first: under FIFO the lower layer's sync waits behind the
    # upper one's, and the next forward waits for it; with priority the lower layer's chunks go
    # first (after the chunk on the wire), and its forward overlaps the upper layer's sync
    prof = two_layer_profile()
    net = Network.ideal(bandwidth=1e9, latency=0.0)
    fifo = simulate(prof, 2, "ps-sfb-ar", net)
    prio = simulate(prof, 2, "ps-sfb-ar-priority", net)
    assert prio.iteration_s < fifo.iteration_s
    assert prio.layer_done_s["a"] < prio.layer_done_s["b"]
    assert fifo.layer_done_s["b"] < fifo.layer_done_s["a"]


def two_layer_profile():
    one = one_layer_profile(1000, 4000, 8, bias=False, forward_ms=5.0, backward_ms=5.0)
    desc = one["description"]
    params = [desc["params"][0], replace(desc["params"][0], id=1, name="b.0", layer=1,
                                         owner=(1, 0))]
    layers = [replace(desc["layers"][0], name="a", sfb=False),
              replace(desc["layers"][0], index=1, name="b", sfb=False, params=(1,))]
    timed = [dict(one["layers"][0], name=n) for n in ("a", "b")]
    return {"model": "two", "batch": 8, "layers": timed,
            "description": dict(desc, params=params, layers=layers)}


# ------------------------------------------------------------------------------------------------
# leaders: G devices per node
# ------------------------------------------------------------------------------------------------
def test_two_devices_per_node_by_hand():
    # all-reduce on 2 nodes of 2 devices: a local ring into the leader (2·(G−1)/G of the layer
    # over the intra-node link), the ring between the leaders, the broadcast back
    prof = one_layer_profile(200, 500, 32, bias=False)
    size = 200 * 500 * 4
    net = Network.ideal(bandwidth=1e9, latency=0.0, intra_bandwidth=2e9)
    r = simulate(prof, 2, "allreduce", net, devices=2)
    hand = 0.030 + size / 2e9 + size / 1e9 + size / 2e9
    assert r.iteration_s == pytest.approx(hand, rel=1e-9)
    assert r.speedup == pytest.approx(4 * 0.030 / hand, rel=1e-9)
    assert r.devices == 2


def test_leaders_with_a_free_local_link_double_the_speedup(profiles):
    # PS and all-reduce send a node's reduced gradient: the inter-node traffic of N leaders is
    # that of N single-device nodes, so with a free local link the speedup doubles exactly
    for mode in ("wfbp", "allreduce"):
        one = simulate(profiles["vgg19"], 4, mode, net_at("10GbE"))
        two = simulate(profiles["vgg19"], 4, mode, net_at("10GbE", intra_bandwidth=math.inf),
                       devices=2)
        assert two.speedup == pytest.approx(2 * one.speedup, rel=1e-9), mode
    # SFB: a node's message carries both devices' factors, so it cannot do as well
    one = simulate(profiles["vgg19"], 4, "sfb", net_at("10GbE"))
    two = simulate(profiles["vgg19"], 4, "sfb", net_at("10GbE", intra_bandwidth=math.inf),
                   devices=2)
    assert two.speedup < 2 * one.speedup
    assert sum(two.node_bytes_sent) > sum(one.node_bytes_sent)


def test_leaders_beat_as_many_single_device_nodes_on_a_slow_network(profiles):
    slow = net_at("10GbE")
    leaders = simulate(profiles["vgg19_22k"], 4, "ps-sfb-ar", slow, devices=2)
    flat = simulate(profiles["vgg19_22k"], 8, "ps-sfb-ar", slow)
    assert leaders.speedup > flat.speedup


# ------------------------------------------------------------------------------------------------
# the ResNet-152 profile
# ------------------------------------------------------------------------------------------------
def test_resnet152_profile_has_its_layers(profiles):
    prof = profiles["resnet152"]
    assert prof["model"] == "resnet152" and prof["batch"] == 32
    assert len(prof["layers"]) == 671                      # Input + the deploy file's 670 layers
    synced = prof["description"]["layers"]
    types = [rec.type for rec in synced]
    assert (types.count("Convolution"), types.count("Scale"), types.count("InnerProduct")) == \
        (155, 155, 1)
    # 152 weight layers on the main path: the convolutions but the 4 projection shortcuts, and fc
    main = [rec for rec in synced if rec.type != "Scale" and "branch1" not in rec.name]
    assert len(main) == 152
    assert sum(p.count for p in prof["description"]["params"]) == 60_192_808
    batch, rate, _ = simprofile.OTHER_SINGLE_GPU["resnet152"]
    step = sum(r["forward_ms"] + r["backward_ms"] for r in prof["layers"])
    assert step == pytest.approx(1e3 * batch / rate, rel=1e-9)
    assert "cnn-benchmarks" in prof["source"]
    rebuilt = simprofile.shipped_profile("resnet152", str(ROOT / "prototxt"))
    assert rebuilt["description"] == prof["description"]
    assert [r["forward_ms"] for r in rebuilt["layers"]] == \
        pytest.approx([r["forward_ms"] for r in prof["layers"]], rel=1e-9)


# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------
def test_cli_names_every_mode():
    from poseidon.tools.commands.simulate import MODE_NAMES
    assert MODE_NAMES == tuple(MODES)


def test_cli_runs_the_new_modes_with_leaders(tmp_path):
    r = poseidon("simulate", "--model", "googlenet", "--nodes", "2,4", "--bandwidth", "10GbE",
                 "--modes", "allreduce,ps-sfb-ar-priority", "--devices-per-node", "2",
                 "--intra-bandwidth", "6GB/s", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "2 devices per node" in r.stdout
    header = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["nodes"])
    assert header.split() == ["nodes", "allreduce", "ps-sfb-ar-priority"]
    assert "ps-sfb-ar-priority (PS+SFB+all-reduce, priority):" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (("--devices-per-node", "0"), "--devices-per-node"),
    (("--intra-bandwidth", "fast"), "cannot read --intra-bandwidth 'fast'"),
    (("--gemm-rate", "quick"), "cannot read --gemm-rate 'quick'"),
])
def test_cli_rejects_bad_leader_values_with_one_line(tmp_path, args, needle):
    r = poseidon("simulate", "--model", "googlenet", "--nodes", "2", *args, cwd=tmp_path)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
