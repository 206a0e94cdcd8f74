"""The papers' baseline figures beside the simulator's, with shipped defaults and no flags: each
mode runs under its system's figures (dist/sim/systems.py). Rows the mechanisms reach are held to
±10%; the others are printed with their gap, and docs/simulate.md says what is missing. The order
the papers report (Poseidon >= WFBP >= PS) is checked wherever the model reproduces it.
"""
import pytest

from poseidon.dist.sim import profile as simprofile
from poseidon.dist.sim.simulate import Network, simulate
from poseidon.dist.sim.systems import PAPER_HOST_COPY_RATE, host_copy_rate
from poseidon.dist.units import parse_rate

TOLERANCE = 0.10
# near linear, the SFB rebuild can leave Poseidon a few percent under WFBP where the paper's plots
# show both at the line; a mode counts as not slower than the one before within this
TIE = 0.05

# (label, model, nodes, line rate, mode, paper's speedup, within ±10%)
ROWS = [
    ("VGG19-22K 40 GbE, Caffe+WFBP", "vgg19_22k", 32, "40Gbit", "wfbp", 21.5, False),
    ("VGG19-22K 40 GbE, Poseidon", "vgg19_22k", 32, "40Gbit", "poseidon", 29.5, True),
    ("VGG19-22K 40 GbE, Caffe+PS", "vgg19_22k", 16, "40Gbit", "ps-nooverlap", 4.0, False),
    ("VGG19 10 GbE, PS (WFBP)", "vgg19", 16, "10Gbit", "wfbp", 8.0, True),
    ("VGG19 20 GbE, PS (WFBP)", "vgg19", 16, "20Gbit", "wfbp", 12.0, True),
    ("VGG19 20 GbE, WFBP", "vgg19", 16, "20Gbit", "wfbp", 14.0, True),
    ("VGG19 30 GbE, PS (WFBP)", "vgg19", 16, "30Gbit", "wfbp", 15.0, True),
    ("Inception-v3 40 GbE, TF+WFBP", "inception_v3", 32, "40Gbit", "wfbp", 22.0, False),
    ("Inception-v3 40 GbE, stock TF", "inception_v3", 32, "40Gbit", "tf", 20.0, False),
    ("Inception-v3 40 GbE, Poseidon-TF", "inception_v3", 32, "40Gbit", "poseidon", 31.5, True),
    ("AlexNet 40 GbE, no DWBP (2015, fitted)", "alexnet", 8, "40Gbit", "nodwbp-2015", 2.2, True),
    ("AlexNet 40 GbE, DWBP (2015)", "alexnet", 8, "40Gbit", "dwbp-2015", 4.0, False),
    ("AlexNet 40 GbE, DWBP+SACP (2015)", "alexnet", 8, "40Gbit", "sacp-2015", 6.0, False),
    ("Inception-v3 25 GbE, Horovod", "inception_v3", 128, "25Gbit", "horovod", 113.0, False),
]
# (model, nodes, line rate): modes from slowest to fastest as the papers order them
ORDERS = [
    ("vgg19_22k", 32, "40Gbit", ("wfbp", "poseidon")),
    ("vgg19_22k", 16, "40Gbit", ("ps-nooverlap", "wfbp", "poseidon")),
    ("vgg19", 16, "10Gbit", ("ps-nooverlap", "wfbp", "poseidon")),
    ("vgg19", 16, "20Gbit", ("ps-nooverlap", "wfbp", "poseidon")),
    ("vgg19", 16, "30Gbit", ("ps-nooverlap", "wfbp", "poseidon")),
    ("inception_v3", 32, "40Gbit", ("tf", "wfbp", "poseidon")),
    ("alexnet", 8, "40Gbit", ("nodwbp-2015", "dwbp-2015", "sacp-2015")),
]


@pytest.fixture(scope="module")
def profiles():
    return {m: simprofile.load_profile(m)
            for m in ("vgg19", "vgg19_22k", "inception_v3", "alexnet")}


def speedup(profiles, model, nodes, line, mode):
    return simulate(profiles[model], nodes, mode, Network(bandwidth=parse_rate(line))).speedup


def test_host_copy_rate_comes_from_the_single_node_figures():
    assert PAPER_HOST_COPY_RATE == pytest.approx((2.3077e9 + 1.9138e9) / 2, rel=1e-3)
    assert host_copy_rate(8e8, 32, 32.0, 16.0) == pytest.approx(1.6e9)


@pytest.mark.parametrize("model,paper", [("vgg19_22k", 18.5), ("vgg19", 21.3)])
def test_single_node_caffe_ps_rate(profiles, model, paper):
    prof = profiles[model]
    r = simulate(prof, 1, "ps-nooverlap", Network())
    img_s = prof["batch"] / r.iteration_s
    print(f"\n{model}, one node, Caffe+PS: {img_s:.1f} img/s (paper {paper})")
    assert img_s == pytest.approx(paper, rel=TOLERANCE)
    # Poseidon hides the same copies under the backward pass (paper: 34.2 of Caffe's 34.6)
    assert simulate(prof, 1, "wfbp", Network()).speedup > 0.97


def test_baseline_rows(profiles):
    print(f"\n{'row':36s} {'nodes':>5s} {'paper':>7s} {'sim':>7s} {'gap':>6s}")
    failures = []
    for label, model, nodes, line, mode, paper, held in ROWS:
        got = speedup(profiles, model, nodes, line, mode)
        gap = got / paper - 1
        print(f"{label:36s} {nodes:5d} {paper:6.1f}x {got:6.1f}x {100 * gap:+5.0f}%"
              f"{'' if held else '  (outside, see docs)'}")
        if held and abs(gap) > TOLERANCE:
            failures.append((label, paper, got))
    assert not failures, failures


@pytest.mark.parametrize("model,nodes,line,modes", ORDERS)
def test_papers_order(profiles, model, nodes, line, modes):
    got = [speedup(profiles, model, nodes, line, m) for m in modes]
    assert all(b >= a * (1 - TIE) for a, b in zip(got, got[1:])), dict(zip(modes, got))
