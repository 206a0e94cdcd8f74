"""`poseidon simulate` and its discrete-event model (dist/sim/simulate.py, dist/sim/profile.py).

* limits: free communication gives speedup P1 in every mode; WFBP never loses to no overlap;
  less bandwidth never helps.
* hand calculations: one SFB message and one PS round trip on 2 nodes, and two workers sharing one
  server's NIC, against bytes/bandwidth + latency worked out by hand.
* Algorithm 1: the simulator's schemes are dist.book's, and what crosses the wire is Table 1's.
* the shape walker agrees with the real Net (describe_net) on CIFAR-10 quick and with the
  parameter counts of the paper's models.
* the paper's headline figures within 15%, printed.
* the CLI: a table, a JSON file, a measured profile, one-line errors.
"""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from poseidon.dist.sim import profile as simprofile
from poseidon.dist.coord.book import describe_net
from poseidon.dist.coord.records import description_from_wire
from poseidon.dist.schemes import best_scheme
from poseidon.dist.cost.formulas import ps_cost, sfb_cost
from poseidon.dist.sim.simulate import MODES, Network, simulate
from poseidon.dist.units import parse_latency, parse_rate

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15          # the paper's figures are read off plots; the model is coarse


@pytest.fixture(scope="module")
def profiles():
    return {m: simprofile.load_profile(m) for m in ("vgg19", "vgg19_22k", "googlenet")}


def one_layer_profile(M, N, K, bias=True, forward_ms=10.0, backward_ms=20.0):
    """A net of one InnerProduct layer, described by hand in describe_net's format (as records)."""
    params = [{"id": 0, "name": "fc.0", "layer": 0, "owner": [0, 0], "shape": [M, N],
               "count": M * N, "lr_mult": 1.0, "decay_mult": 1.0, "shared": False, "synced": True}]
    if bias:
        params.append({"id": 1, "name": "fc.1", "layer": 0, "owner": [0, 1], "shape": [M],
                       "count": M, "lr_mult": 2.0, "decay_mult": 0.0, "shared": False,
                       "synced": True})
    desc = description_from_wire({
        "net": "one", "dtype": "float32", "iter_size": 1, "params": params,
        "layers": [{"index": 0, "name": "fc", "type": "InnerProduct", "M": M, "N": N, "K": K,
                    "sfb": True, "params": [p["id"] for p in params],
                    "shapes": [p["shape"] for p in params]}]})
    return {"model": "one", "batch": K, "description": desc,
            "layers": [{"name": "fc", "type": "InnerProduct", "forward_ms": forward_ms,
                        "backward_ms": backward_ms}]}


# ------------------------------------------------------------------------------------------------
# limits
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["vgg19_22k", "googlenet"])
def test_free_communication_gives_linear_speedup(profiles, model):
    for mode in MODES:
        for p in (1, 3, 8):
            r = simulate(profiles[model], p, mode, Network.ideal())
            assert r.speedup == pytest.approx(p, rel=0.01), (model, mode, p, r.speedup)


def test_wfbp_never_slower_than_no_overlap(profiles):
    for model, p, gbit in (("vgg19", 8, 10), ("vgg19_22k", 4, 40), ("googlenet", 8, 2)):
        net = Network(bandwidth=gbit * 1e9 / 8)
        for overlap, no_overlap in (("wfbp", "ps-nooverlap"), ("poseidon", "hybrid-nooverlap")):
            a = simulate(profiles[model], p, overlap, net).iteration_s
            b = simulate(profiles[model], p, no_overlap, net).iteration_s
            assert a <= b * (1 + 1e-9), (model, p, overlap, a, b)


def test_halving_bandwidth_never_speeds_up(profiles):
    for mode in ("ps-nooverlap", "wfbp", "poseidon"):
        times = [simulate(profiles["vgg19"], 4, mode, Network(bandwidth=g * 1e9 / 8)).iteration_s
                 for g in (40, 20, 10, 5, 2.5)]
        assert all(a <= b * (1 + 1e-9) for a, b in zip(times, times[1:])), (mode, times)
        assert times[-1] > times[0], (mode, times)


# ------------------------------------------------------------------------------------------------
# hand calculations on 2 nodes
# ------------------------------------------------------------------------------------------------
def net_for_hand(bandwidth=1e9, latency=1e-4, **kw):
    return Network.ideal(bandwidth=bandwidth, latency=latency, **kw)


@pytest.mark.parametrize("M,N,K", [(1000, 3000, 16), (1000, 1000, 1000)])
def test_one_sfb_message_takes_bytes_over_bandwidth_plus_latency(M, N, K):
    # the second case is 8 MB: four chunks pipelined through the two NICs, still one latency
    prof = one_layer_profile(M, N, K)
    r = simulate(prof, 2, "sfb", net_for_hand())
    message = (K * (M + N) + M) * 4
    hand = 0.030 + message / 1e9 + 1e-4
    print(f"SFB {M}x{N} K={K}: {message} B, simulated {r.iteration_s * 1e3:.4f} ms, "
          f"by hand {hand * 1e3:.4f} ms")
    assert r.schemes == {"fc": "sfb"}
    assert r.iteration_s == pytest.approx(hand, rel=1e-9)
    assert r.node_bytes_sent == [message, message]


def test_one_ps_round_trip_takes_twice_bytes_over_bandwidth_plus_latency():
    # 100,000 floats without bias: one KV pair, placed on server 0 (node 0): worker 1 pushes it
    # over the wire and pulls it back; worker 0 talks to its own node's server for free
    prof = one_layer_profile(200, 500, 32, bias=False)
    r = simulate(prof, 2, "wfbp", net_for_hand())
    size = 200 * 500 * 4
    hand = 0.030 + 2 * (size / 1e9 + 1e-4)
    assert r.iteration_s == pytest.approx(hand, rel=1e-9)
    assert r.node_bytes_sent == [size, size]


def test_two_workers_share_the_servers_nic():
    # a server on its own node: both pushes queue on its downlink, both pulls on its uplink
    prof = one_layer_profile(200, 500, 32, bias=False)
    r = simulate(prof, 2, "wfbp", net_for_hand(separate_servers=True), servers=1)
    size = 200 * 500 * 4
    hand = 0.030 + 4 * size / 1e9 + 2 * 1e-4
    assert r.iteration_s == pytest.approx(hand, rel=1e-9)
    assert r.node_bytes_received[2] == 2 * size and r.node_bytes_sent[2] == 2 * size


def test_host_costs_add_when_not_overlapped():
    # PCIe and the server's add + apply on one node, with no network at all: by hand
    prof = one_layer_profile(200, 500, 32, bias=False)
    size = 200 * 500 * 4
    r = simulate(prof, 1, "ps-nooverlap", Network.ideal(pcie=4e9, update_rate=2e9))
    assert r.iteration_s == pytest.approx(0.030 + 2 * size / 4e9 + 2 * size / 2e9, rel=1e-9)


# ------------------------------------------------------------------------------------------------
# Algorithm 1 and Table 1
# ------------------------------------------------------------------------------------------------
def test_schemes_are_algorithm_1(profiles):
    for model, prof in profiles.items():
        for p in (2, 4, 8, 16, 32):
            r = simulate(prof, p, "poseidon", Network.ideal())
            want = {rec.name: best_scheme(rec.sfb, rec.M, rec.N, rec.K, p, p)
                    for rec in prof["description"]["layers"]}
            assert r.schemes == want, (model, p)
            for rec in prof["description"]["layers"]:
                by_cost = ("sfb" if rec.type == "InnerProduct" and
                           sfb_cost(rec.M, rec.N, rec.K, p) <=
                           ps_cost(rec.M, rec.N, p, p) else "ps")
                assert r.schemes[rec.name] == by_cost, (model, p, rec.name)
    # GoogLeNet's only FC layer (1000 x 1024, K = 128) stays on PS from 8 nodes up
    for p in (8, 16, 32):
        assert set(simulate(profiles["googlenet"], p, "poseidon", Network.ideal())
                   .schemes.values()) == {"ps"}


def test_wire_bytes_are_table_1():
    M, N, K, P = 4096, 4096, 32, 8
    sfb = simulate(one_layer_profile(M, N, K, bias=False), P, "sfb", Network())
    for sent, got in zip(sfb.node_bytes_sent, sfb.node_bytes_received):
        assert (sent + got) / 4 == sfb_cost(M, N, K, P)
    ps = simulate(one_layer_profile(M, N, K, bias=False), P, "wfbp", Network())
    busiest = max(s + g for s, g in zip(ps.node_bytes_sent, ps.node_bytes_received)) / 4
    # 32 pairs of 2 MB over 8 servers: exactly even, so Table 1 holds on every node
    assert busiest == ps_cost(M, N, P, P)


# ------------------------------------------------------------------------------------------------
# the profiles' shapes
# ------------------------------------------------------------------------------------------------
def test_shape_walker_agrees_with_the_real_net():
    from poseidon.engine import prototxt
    from poseidon.engine.net import Net
    path = ROOT / "prototxt" / "cifar10_quick" / "deploy.prototxt"
    _, walked = simprofile.describe_from_shapes(prototxt.read_net(str(path)))
    real = describe_net(Net(str(path), "TEST"))
    keys = ("name", "type", "M", "N", "K", "sfb", "shapes")
    assert [{k: getattr(r, k) for k in keys} for r in walked["layers"]] == \
        [{k: getattr(r, k) for k in keys} for r in real["layers"]]
    assert [p.count for p in walked["params"]] == [p.count for p in real["params"]]


def test_shipped_profiles_match_the_models(profiles):
    counts = {"vgg19": 143_667_240, "vgg19_22k": 229_052_817, "googlenet": 6_998_552}
    for model, prof in profiles.items():
        assert sum(p.count for p in prof["description"]["params"]) == counts[model]
        batch, rate = simprofile.PAPER_SINGLE_GPU[model]
        step = sum(r["forward_ms"] + r["backward_ms"] for r in prof["layers"])
        assert step == pytest.approx(1e3 * batch / rate, rel=1e-9)
        rebuilt = simprofile.paper_profile(model, str(ROOT / "prototxt"))
        for key in ("forward_ms", "backward_ms"):
            assert [r[key] for r in rebuilt["layers"]] == \
                pytest.approx([r[key] for r in prof["layers"]], rel=1e-9), (model, key)
        assert rebuilt["description"] == prof["description"]


# ------------------------------------------------------------------------------------------------
# the paper
# ------------------------------------------------------------------------------------------------
def test_paper_headline_figures(profiles):
    line40, line10 = Network(bandwidth=parse_rate("40Gbit")), \
        Network(bandwidth=parse_rate("10GbE"))
    # shipped defaults only: each mode's system (dist/sim/systems.py) sets the host, sharding and
    # TCP figures; the 10 GbE runs were tc caps. Fig. 8's "PS" is Poseidon without HybComm: WFBP.
    rows = [
        ("VGG19-22K", 32, "40 GbE", "poseidon", 29.5, profiles["vgg19_22k"], line40),
        ("VGG19", 16, "10 GbE", "wfbp", 8.0, profiles["vgg19"], line10),
        ("VGG19", 16, "10 GbE", "poseidon", 16.0, profiles["vgg19"], line10),
        ("GoogLeNet", 32, "40 GbE", "poseidon", 31.0, profiles["googlenet"], line40),
    ]
    print(f"\n{'model':10s} {'nodes':>5s} {'network':26s} {'mode':13s} {'paper':>6s} {'sim':>6s}")
    failures = []
    for model, p, label, mode, paper, prof, net in rows:
        got = simulate(prof, p, mode, net).speedup
        print(f"{model:10s} {p:5d} {label:26s} {mode:13s} {paper:5.1f}x {got:5.1f}x")
        if abs(got - paper) > TOLERANCE * paper:
            failures.append((model, p, label, mode, paper, got))
    assert not failures, failures
    # GoogLeNet: on PS whatever the mode, near-linear with overlap
    for mode in ("wfbp", "poseidon"):
        assert simulate(profiles["googlenet"], 16, mode, line10).speedup >= 0.9 * 16


# ------------------------------------------------------------------------------------------------
# parsing and the command line
# ------------------------------------------------------------------------------------------------
def test_parse_rate_and_latency():
    assert parse_rate("40Gbit") == 5e9
    assert parse_rate("10GbE") == 1.25e9
    assert parse_rate("1.25GB/s") == 1.25e9
    assert parse_rate("100Mbps") == 12.5e6
    assert parse_rate("1.5gbps") == 1.5e9 / 8
    assert parse_rate("1000000000bit") == parse_rate("1Gbit") == 125e6   # as tc writes it
    assert parse_rate("inf", infinite=True) == math.inf
    assert parse_latency("5us") == pytest.approx(5e-6)
    assert parse_latency("0.1ms") == pytest.approx(1e-4)
    for bad in ("fast", "40", "-3Gbit", "0Gbit", "10 parsecs", "inf"):
        with pytest.raises(ValueError, match="--bandwidth"):
            parse_rate(bad, "--bandwidth")
    with pytest.raises(ValueError, match="'40' has no unit: 40bit means bits, 40B bytes"):
        parse_rate("40", "--bandwidth")


def poseidon(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "poseidon.tools.cli", *map(str, args)], cwd=str(cwd),
                          env=env, capture_output=True, text=True, timeout=120)


def test_cli_prints_a_table_and_writes_json(tmp_path):
    r = poseidon("simulate", "--model", "vgg19", "--nodes", "1,4,16", "--bandwidth", "10GbE",
                 "--json", tmp_path / "s.json", cwd=tmp_path)
    print(r.stdout)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["nodes"])
    assert header.split() == ["nodes", "ps-nooverlap", "wfbp", "poseidon"]
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["4"], ["16"])]
    assert [row[0] for row in rows] == ["1", "4", "16"]
    data = json.loads((tmp_path / "s.json").read_text())
    assert set(data["results"]) == {"ps-nooverlap", "wfbp", "poseidon"}
    speedups = [float(v) for v in re.findall(r"([0-9.]+)x", " ".join(rows[2]))]
    assert len(speedups) == 3
    assert data["results"]["poseidon"]["16"]["speedup"] == pytest.approx(speedups[2], abs=0.01)
    assert speedups[0] < speedups[1] < speedups[2] <= 16


def test_cli_measures_a_prototxt_here(tmp_path):
    prof = tmp_path / "p.json"
    r = poseidon("simulate", "--model", ROOT / "prototxt" / "cifar10_quick" / "deploy.prototxt",
                 "--measure", "--iterations", "1", "--nodes", "1,4", "--modes", "wfbp,sfb",
                 "--bandwidth", "1Gbit", "--write-profile", prof, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "measured with the engine" in r.stdout
    again = poseidon("simulate", "--profile", prof, "--nodes", "4", "--modes", "wfbp",
                     cwd=tmp_path)
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("args,needle", [
    (("--model", "resnet9000"), "no profile 'resnet9000'"),
    (("--model", "vgg19", "--bandwidth", "fast"), "cannot read --bandwidth 'fast'"),
    (("--model", "vgg19", "--pcie", "12"), "cannot read --pcie '12'"),
    (("--model", "vgg19", "--nodes", "0,4"), "--nodes"),
    (("--model", "vgg19", "--modes", "wfbp,magic"), "unknown mode 'magic'"),
    (("--profile", "missing.json"), "no profile 'missing.json'"),
])
def test_cli_rejects_bad_values_with_one_line(tmp_path, args, needle):
    r = poseidon("simulate", *args, cwd=tmp_path)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
