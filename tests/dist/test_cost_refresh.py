"""The measured cost model over many refresh windows: the Planner driven through the refresh
protocol with scripted sync times (the choices of a report take effect one window after it, so a
window runs the choices published two reports back), then a real job counting its switches.

- constant true costs: a layer's choice changes at most once, then holds;
- the same with every window's times off by up to ±15%: no flip-flopping;
- a step in a scheme's true cost: the choice follows within two windows;
- two workers training the fc net with --cost-model measured: each layer switches scheme rarely.

Run: python -m pytest tests/dist/test_cost_refresh.py -q
"""
import random
from types import SimpleNamespace

import pytest

from poseidon.dist.coord.records import LayerRecord
from poseidon.dist.cost.model import Corrections, Planner, modelled_seconds, scheme_seconds
from poseidon.dist.job.roles import Roles
from poseidon.dist.schemes import scheme_class

from .helpers import fc_net, make_lmdb, run_threads, solver_param

GBIT = 1.25e8          # bytes a second of a 1 Gbit/s link
ROLES = Roles(2, 1)
REFRESH = 4


def fc(K, index=0, M=512, N=512):
    return LayerRecord(index=index, name=f"fc{index}", type="InnerProduct", M=M, N=N, K=K,
                       sfb=True, params=(), candidates=("ps", "sfb"))


# On these links a 512x512 layer at K=300 is predicted 16.8 ms by PS and 19.7 ms by SFB (so the
# probe picks PS); at K=128, 16.8 ms and 8.4 ms.
PROBE = {w: {"links": {str(t): {"alpha": 1e-5, "beta": GBIT} for t in range(ROLES.size) if t != w},
             "flops": 1e13, "encrypt_cost": 0.0} for w in ROLES.worker_ranks()}


def alone(layer, scheme, planner):
    """The model's seconds for `scheme` syncing `layer` alone (no contention, no correction)."""
    transfer, compute = scheme_seconds(scheme_class(scheme), layer, ROLES, planner.table, 4)
    return transfer + compute


def drive(layers, true_seconds, windows, noise=0.0, seed=0, refresh=REFRESH):
    """Run `windows` refresh windows of the protocol on a Planner: the probe's choices are in
    force from iteration 0; after window k (iterations kN .. kN+N-1) every worker reports its
    layers' sync seconds, and the choices planned from them are in force from (k+2)N. A worker's
    seconds are true_seconds(k, layer, choices, planner), `choices` the {layer: scheme} in force,
    times 1 ± noise (uniform, each worker its own). Returns the choices in force in each window."""
    rng = random.Random(seed)
    planner = Planner(ROLES)
    book = SimpleNamespace(layers=layers, data={"itemsize": 4}, options={"cost_refresh": refresh})
    published = [planner.decide(book, PROBE, 0)]
    ran = []
    for k in range(windows):
        now = [p for p in published if p["from"] <= k * refresh][-1]
        choices = {int(li): name for li, name in now["choices"].items()}
        ran.append(choices)
        reports = {w: {"observed": {
            str(rec.index): true_seconds(k, rec, choices, planner)
            * (1 + rng.uniform(-noise, noise)) for rec in layers}} for w in ROLES.worker_ranks()}
        published.append(planner.decide(book, reports, (k + 2) * refresh))
    return ran


def switches(ran, li):
    """The windows at which layer li runs another scheme than in the window before."""
    return [k for k in range(1, len(ran)) if ran[k][li] != ran[k - 1][li]]


def ps_three_times(k, rec, choices, planner):
    """PS really takes 3x its prediction, SFB exactly its own: SFB is 2.5x faster at K=300."""
    scheme = choices[rec.index]
    return alone(rec, scheme, planner) * (3.0 if scheme == "ps" else 1.0)


# ----- what a window's times are credited to -----------------------------------------------------
def test_a_window_is_credited_to_the_choices_that_ran_in_it():
    """The report after window k plans for window k+2, so the window after a switch was published
    still ran the old scheme: its times correct the old scheme, not the new one. The first window
    (the start's) corrects nothing."""
    planner = Planner(ROLES)
    layer = fc(300)
    book = SimpleNamespace(layers=[layer], data={"itemsize": 4}, options={"cost_refresh": REFRESH})
    assert planner.decide(book, PROBE, 0)["choices"] == {"0": "ps"}
    ran = ["ps", "ps", "ps", "ps", "sfb"]            # windows 0..4: the switch is in force from 16
    for k, scheme in enumerate(ran):
        seconds = alone(layer, scheme, planner) * (3.0 if scheme == "ps" else 1.0)
        got = planner.decide(book, {w: {"observed": {"0": seconds}} for w in ROLES.worker_ranks()},
                             (k + 2) * REFRESH)
        if k == 2:
            assert got["choices"] == {"0": "sfb"}    # on two windows of PS 3x its prediction
    assert planner.corrections.ratios[(0, "ps")] == pytest.approx([3.0] * 3)
    assert planner.corrections.ratios[(0, "sfb")] == pytest.approx([1.0])


def test_a_change_on_two_schemes_at_once_is_the_load():
    """Layer 1 runs PS and layer 3 SFB; layer 1 ran SFB before, at a factor of 1.2. Two windows
    with both live pairs 3x slower: the load, so layer 1's SFB factor moves 3x too. The same rise
    on PS alone is PS's own: layer 1's SFB factor stays."""
    def history(rise_sfb):
        c = Corrections()
        c.add({(1, "sfb"): 1.2})
        for k in range(6):
            c.add({(1, "ps"): 1.0, (3, "sfb"): 1.0})
        for k in range(2):
            c.add({(1, "ps"): 3.0, (3, "sfb"): 3.0 if rise_sfb else 1.0})
        return c
    load, own = history(True), history(False)
    assert load.factor(1, "ps") == own.factor(1, "ps") == pytest.approx(3.0)
    assert load.factor(1, "sfb") == pytest.approx(3.6)
    assert own.factor(1, "sfb") == pytest.approx(1.2) and own.factor(3, "sfb") == 1.0


# ----- constant costs: one change at most, then it holds ----------------------------------------
def test_truthful_costs_the_model_gets_right_change_nothing():
    ran = drive([fc(300)], lambda k, rec, choices, p: alone(rec, choices[rec.index], p), 30)
    assert switches(ran, 0) == [] and ran[0][0] == "ps"


def test_constant_costs_move_a_layer_once_and_it_stays():
    """PS 3x its prediction: the layer leaves PS for SFB once and stays there for good (before, the
    correction alternated between 3 and 1 and the layer with it, window after window)."""
    ran = drive([fc(300)], ps_three_times, 40)
    assert ran[0][0] == "ps"
    assert len(switches(ran, 0)) == 1 and ran[-1][0] == "sfb"
    assert switches(ran, 0)[0] <= 8              # warm-up, two windows of PS, the protocol's delay


def test_constant_costs_with_contention_settle_every_layer():
    """Three layers of different sizes sharing the links (the model's backlog), every scheme's
    truth off by its own factor, contention included: each layer changes at most once, and none
    after the first few windows."""
    layers = [fc(300, index=1), fc(128, index=3), fc(200, index=5)]
    factor = {"ps": 2.5, "sfb": 1.2}

    def truth(k, rec, choices, planner):
        modelled = modelled_seconds(layers, ROLES, planner.table, 4, choices)
        return modelled[rec.index][choices[rec.index]] * factor[choices[rec.index]]

    ran = drive(layers, truth, 40)
    for rec in layers:
        moved = switches(ran, rec.index)
        assert len(moved) <= 1 and all(k < 12 for k in moved), (rec.index, moved)


# ----- noisy costs: no flip-flopping ------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_noisy_constant_costs_do_not_flip_flop(seed):
    """Every worker's times off by up to ±15% in every window: still one move at most."""
    ran = drive([fc(300)], ps_three_times, 40, noise=0.15, seed=seed)
    assert len(switches(ran, 0)) <= 1 and ran[-1][0] == "sfb"


@pytest.mark.parametrize("sfb_ms", [28.0, 30.0, 32.0])
@pytest.mark.parametrize("seed", range(6))
def test_noise_does_not_move_a_layer_between_near_equal_schemes(seed, sfb_ms):
    """PS takes 30 ms, 1.8x its prediction, so the layer tries SFB (predicted 19.7 ms); SFB then
    measures within 7% of PS. With ±15% noise on every window, the layer never moves again
    whichever of the two is the cheaper."""
    def truth(k, rec, choices, planner):
        return (30.0 if choices[rec.index] == "ps" else sfb_ms) * 1e-3
    ran = drive([fc(300)], truth, 50, noise=0.15, seed=seed)
    assert len(switches(ran, 0)) == 1 and ran[-1][0] == "sfb", switches(ran, 0)


# ----- costs that really change: followed within two windows ------------------------------------
STEP_AT = 12


def test_a_step_in_the_running_schemes_cost_is_followed_within_two_windows():
    """The model is right until window 12, then PS takes 3x as long: the report of window 12 or
    13 moves the layer to SFB (in force two windows after the report, the protocol's delay)."""
    def truth(k, rec, choices, planner):
        scheme = choices[rec.index]
        return alone(rec, scheme, planner) * (3.0 if scheme == "ps" and k >= STEP_AT else 1.0)
    ran = drive([fc(300)], truth, 30)
    assert switches(ran, 0) == [switches(ran, 0)[0]] and ran[-1][0] == "sfb"
    assert STEP_AT + 2 <= switches(ran, 0)[0] <= STEP_AT + 1 + 2


@pytest.mark.parametrize("seed", range(4))
def test_a_step_is_followed_through_noise(seed):
    def truth(k, rec, choices, planner):
        scheme = choices[rec.index]
        return alone(rec, scheme, planner) * (3.0 if scheme == "ps" and k >= STEP_AT else 1.0)
    ran = drive([fc(300)], truth, 30, noise=0.15, seed=seed)
    assert len(switches(ran, 0)) == 1 and switches(ran, 0)[0] <= STEP_AT + 1 + 2


def test_a_layer_goes_back_when_the_scheme_it_took_gets_dearer():
    """PS 3x its prediction sends the layer to SFB; later SFB takes 4x its own: the layer goes back
    to PS (whose factor it kept while not running it) within two windows."""
    later = 24

    def truth(k, rec, choices, planner):
        scheme = choices[rec.index]
        if scheme == "ps":
            return alone(rec, scheme, planner) * 3.0
        return alone(rec, scheme, planner) * (4.0 if k >= later else 1.0)
    ran = drive([fc(300)], truth, 40)
    moved = switches(ran, 0)
    assert len(moved) == 2 and ran[-1][0] == "ps"
    assert later + 2 <= moved[1] <= later + 1 + 2


def test_one_iteration_windows_need_eight_iterations_of_evidence():
    """With --cost-refresh 1 a window is one iteration: two slow ones in a row (the host busy) do
    not move the layer; PS really 3x slower from iteration 40 does, within the 8 iterations that
    make a span of evidence there (and the protocol's delay)."""
    def burst(k, rec, choices, planner):
        scheme = choices[rec.index]
        return alone(rec, scheme, planner) * (3.0 if k in (20, 21) and scheme == "ps" else 1.0)
    assert switches(drive([fc(300)], burst, 60, refresh=1), 0) == []

    def step(k, rec, choices, planner):
        scheme = choices[rec.index]
        return alone(rec, scheme, planner) * (3.0 if k >= 40 and scheme == "ps" else 1.0)
    moved = switches(drive([fc(300)], step, 60, refresh=1), 0)
    assert len(moved) == 1 and 40 + 8 + 1 <= moved[0] <= 40 + 8 + 2, moved


# ----- a job ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_measured_job_rarely_switches(tmp_path):
    """Two workers train the fc net 200 iterations with --cost-model measured --cost-refresh 4 as
    threads of one process, where every scheme costs about the same (the sync of a small layer is
    mostly the threads' own overhead) and the host's load moves every time: a layer may try
    another scheme and come back, but never flip-flops (before, such a job switched its layers
    tens of times)."""
    iters = 200
    solvers = run_threads(solver_param(fc_net(make_lmdb(tmp_path / "train"), 4), max_iter=iters),
                          2, 1, cost_model="measured", cost_refresh=REFRESH)
    book = solvers[0].book
    counts = {}
    for rec in book.layers:
        seq = [book.best_scheme(rec.index, it) for it in range(iters)]
        counts[rec.name] = sum(a != b for a, b in zip(seq, seq[1:]))
    assert len(counts) == 3 and max(counts.values()) <= 2 and sum(counts.values()) <= 4, counts
