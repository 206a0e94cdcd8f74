"""InnerProduct weights updated from sufficient factors, block by block
(engine/solvers/factored.py).

The reference is the solver's other path, which writes each weight gradient into the diff and
updates from it (itself checked against Caffe's formulas in test_solver_rules.py and against
finite differences in tests/engine/layers): the same training run both ways must give the same parameters
and solver state, for every update rule, both weight layouts, with many blocks and on 1 and 2
threads. Float64, so the only possible difference is the order of additions.
"""
import numpy
import pytest
from google.protobuf import text_format

from poseidon.engine.errors import PoseidonError
from poseidon.engine import parallel
from poseidon.engine.proto import caffe_pb2
from poseidon.engine.solvers import Solver

ITERS = 6

RULES = {
    "SGD": 'type: "SGD" momentum: 0.9',
    "Nesterov": 'type: "Nesterov" momentum: 0.9',
    "AdaGrad": 'type: "AdaGrad"',
    "RMSProp": 'type: "RMSProp" rms_decay: 0.9',
    "AdaDelta": 'type: "AdaDelta" momentum: 0.95 base_lr: 1.0',
    "Adam": 'type: "Adam" momentum: 0.9 momentum2: 0.999',
}


def net_text(share=False, freeze=False, side=False):
    """ToyData (tests/engine/test_solver.py) -> ip1 (transpose: true) -> ReLU -> ip2 -> ip3 -> loss.
    `share`: ip3 reads ip1 too and uses ip2's weight, their outputs summed; `freeze`: ip2's
    weight has lr_mult 0; `side`: an InnerProduct on ip1 whose output reaches no loss."""
    ip2_param = ('param { name: "w2" lr_mult: %g } param { lr_mult: 2 decay_mult: 0 }'
                 % (0 if freeze else 1))
    if share:
        tail = """
layer { name: "ip3" type: "InnerProduct" bottom: "ip1" top: "ip3"
  param { name: "w2" } param { lr_mult: 2 }
  inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "sum" type: "Eltwise" bottom: "ip2" bottom: "ip3" top: "sum" }
layer { name: "ip4" type: "InnerProduct" bottom: "sum" top: "ip4"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip4" bottom: "label" top: "loss" }"""
    else:
        tail = """
layer { name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss" }"""
    return f"""
name: "factored"
layer {{ name: "data" type: "Python" top: "data" top: "label"
  python_param {{ module: "tests.engine.test_solver" layer: "ToyData" param_str: "8 0.5" }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param {{ num_output: 24 transpose: true
                         weight_filler {{ type: "gaussian" std: 0.3 }}
                         bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" {ip2_param}
  inner_product_param {{ num_output: 6 weight_filler {{ type: "xavier" }} }} }}
{tail}
{'layer { name: "side" type: "InnerProduct" bottom: "ip1" top: "side" '
 'inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }' if side else ""}
"""


def make_solver(rule="SGD", extra="", **net):
    text = (f'net_param {{ {net_text(**net)} }} base_lr: 0.05 lr_policy: "fixed" '
            f'weight_decay: 0.01 random_seed: 5 display: 0 max_iter: 100 '
            f'snapshot_after_train: false {RULES[rule]} {extra}')
    return Solver(text_format.Merge(text, caffe_pb2.SolverParameter()), dtype=numpy.float64,
                  xp=numpy)


def train(solver, factored_on):
    if not factored_on:
        solver.factored.entries = []
    solver.step(ITERS)
    return ([b.data.copy() for b in solver.net.learnable_params],
            [h.copy() for state in solver.history for h in state])


def names(solver):
    return [layer.name for _, _, layer in solver.factored.entries]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request, monkeypatch):
    """Run on that many threads, with blocks of 2 rows (ip1's weight, 12 x 24 with transpose,
    is 6 blocks; ip2's 6 x 24 is 3), so the block and thread boundaries are all crossed."""
    pool = parallel.parallel()
    monkeypatch.setattr(pool, "workers", min(request.param, max(pool.workers, 1)))
    monkeypatch.setattr(parallel, "MIN_BLOCK_ROWS", 1)
    monkeypatch.setattr(parallel, "WEIGHT_BLOCK_BYTES", 2 * 24 * 8)
    monkeypatch.setattr(parallel, "ROWS_PER_FACTOR_ROW", 0)
    monkeypatch.setattr(parallel, "PADDED_ROWS_MIN", 0)           # padded rows even here
    return pool.workers


@pytest.mark.parametrize("rule", sorted(RULES))
def test_factored_update_equals_update_from_the_diff(rule, threads):
    fused = make_solver(rule)            # each solver seeds the data's noise: train in turn
    assert names(fused) == ["ip1", "ip2", "ip3"]
    got = train(fused, True)
    want = train(make_solver(rule), False)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        numpy.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_weight_diffs_are_neither_cleared_nor_written(threads):
    """The point of the path: no pass over the weights besides the update (their diffs keep
    what was there), while the biases get their gradients as usual."""
    solver = make_solver()
    weights = [layer.blobs[0] for _, _, layer in solver.factored.entries]
    for w in weights:
        w.diff[...] = 7.0
    solver.step(2)
    for w in weights:
        assert (w.diff == 7.0).all()
    assert solver.net.params["ip2"][1].diff.any()


def test_backward_outside_the_solver_makes_weight_gradients():
    """The layers skip their weight gradient only inside a solver step."""
    solver = make_solver()
    solver.step(1)
    solver.net.ClearParamDiffs()
    solver.net.Forward()
    solver.net.Backward()
    for name in ("ip1", "ip2", "ip3"):
        assert solver.net.params[name][0].diff.any()


def test_a_failed_step_leaves_backward_whole():
    """An error between clearing and the update (here the data layer's) must not leave the
    layers skipping their weight gradient."""
    solver = make_solver()
    data = solver.net.layer_dict["data"]

    def broken(bottom, top):
        raise RuntimeError("disk gone")

    data.forward = broken
    with pytest.raises(RuntimeError, match="disk gone"):
        solver.step(1)
    assert_backward_is_whole(solver, data)


def assert_backward_is_whole(solver, data):
    """No plan is left over: an apply_update by hand uses the diffs, and a backward by hand makes
    every weight gradient."""
    assert solver._factored == {}
    if "forward" in vars(data):
        del data.forward                       # the layer's own forward again
    solver.net.ClearParamDiffs()
    solver.net.Forward()
    solver.net.Backward()
    for _, _, layer in solver.factored.entries:
        assert layer.blobs[0].diff.any(), layer.name


@pytest.mark.parametrize("passes", [0, 2])
def test_backward_passes_by_hand_must_be_one(passes):
    """A subclass that runs backward twice (or not at all) between clearing and the update would
    get one pass's (or a stale) weight gradient from the factors: it is told instead."""
    class ByHand(Solver):
        def forward_backward(self):
            loss = 0.0
            for _ in range(passes):
                loss += self.net.Forward()
                self.net.Backward()
            return loss / max(passes, 1)

    text = (f'net_param {{ {net_text()} }} base_lr: 0.05 lr_policy: "fixed" display: 0 '
            f'max_iter: 10 snapshot_after_train: false')
    solver = ByHand(text_format.Merge(text, caffe_pb2.SolverParameter()), dtype=numpy.float64,
                    xp=numpy)
    with pytest.raises(PoseidonError, match=rf"layer 'ip1' ran backward {passes} times since "
                                            r"clear_param_diffs\(\).*set iter_size"):
        solver.step(1)
    assert_backward_is_whole(solver, solver.net.layer_dict["data"])


@pytest.mark.parametrize("extra", ["iter_size: 2", "clip_gradients: 0.5"])
def test_whole_gradient_settings_use_the_diff(extra):
    """iter_size adds several passes' gradients, clip_gradients needs the norm of all of them
    before any update: no weight is updated from factors then (and the run is unchanged)."""
    want = train(make_solver(extra=extra), False)
    solver = make_solver(extra=extra)
    assert solver.factored.active(solver.param) == []
    got = train(solver, True)
    for a, b in zip(got[0], want[0]):
        numpy.testing.assert_array_equal(a, b)


def test_shared_frozen_and_backward_free_weights_are_not_factored():
    assert names(make_solver(share=True)) == ["ip1", "ip4"]     # w2 is used by ip2 and ip3
    assert names(make_solver(freeze=True)) == ["ip1", "ip3"]    # ip2's weight is not learned
    solver = make_solver(side=True)                               # no loss below 'side'
    assert not solver.net.layer_need_backward[solver.net.layer_names.index("side")]
    assert names(solver) == ["ip1", "ip2", "ip3"]


def test_shared_weights_train_as_before():
    got = train(make_solver(share=True), True)
    want = train(make_solver(share=True), False)
    for a, b in zip(got[0], want[0]):
        numpy.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
