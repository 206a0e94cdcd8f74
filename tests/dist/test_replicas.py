"""Several replicas of the train net in one process (engine/replicas.py): Caffe's `--gpu 0,1`.

* G = 2 replicas of batch K end with the parameters of one net trained on the batch G·K
  (float64), for an FC net (whose weights the solver updates from the replicas' stacked
  sufficient factors) and a conv net, and with iter_size 2 (the mean is taken once, after the
  last pass).
* A weight and bias shared by name between two layers (the same shapes) are reduced once, at
  their lowest user, whose backward adds the last part of their gradient: G replicas still end
  with the parameters of one net on the combined batch.
* The loss the solver gets (and displays) is the mean of the replicas' losses: the loss of one
  net on the combined batch, not G times it.
* The leader's parameters reach the other replica before its next forward.
* A net with Dropout draws the same numbers in every run; a resumed run reads on where every
  replica's data stood (bitwise equal to an uninterrupted one).
* G replicas of a process reading shard (r, n) read shards r·G .. r·G + G - 1 of n·G.
* Bad replica counts and device lists are one-line errors.
* On a GPU (marked `gpu`): two replicas on one device equal the numpy reference.

Run: python -m pytest tests/dist/test_replicas.py -q
"""
import numpy
import pytest

from poseidon.engine import backend
from poseidon.engine.errors import PoseidonError
from poseidon.engine.replicas import check_replicas, plan_devices, replica_shard
from poseidon.engine.solvers import get_solver

from tests.dist.helpers import (assert_params_close, conv_net, fc_net, make_lmdb, params_of, reference,
                           solver_param)

ITERS = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


def trained(param, weights, iters, **kw):
    solver = get_solver(param, dtype=numpy.float64, **kw)
    solver.net.copy_from(weights)
    solver.step(iters)
    solver.net.shutdown()
    solver.replicas.shutdown()
    return solver


@pytest.mark.parametrize("build,K,extra", [(fc_net, 4, {}), (conv_net, 2, {}),
                                          (conv_net, 2, {"iter_size": 2})],
                         ids=["fc", "conv", "conv-iter_size-2"])
def test_two_replicas_equal_one_net_on_the_combined_batch(data, tmp_path, build, K, extra):
    G = 2
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(build(data, G * K), max_iter=ITERS, **extra), weights_out=weights)
    solver = trained(solver_param(build(data, K), max_iter=ITERS, **extra), weights, ITERS,
                     replicas=G)
    assert solver.replicas.count == G and solver.net is solver.replicas.nets[0]
    if build is fc_net:
        assert solver.factored.active(solver.param), "the FC weights should come from factors"
    assert_params_close(params_of(solver), want, rtol=1e-5, label=f"G={G} {extra}")


def shared_net(source, batch, classes=5):
    """Four InnerProducts (192 -> 24 -> 24 -> 24 -> classes) where the middle two, ip2 and ip3,
    share their weight and their bias by name: each shared gradient is the sum of two layers'."""
    shared = ('param { name: "shared_w" } param { name: "shared_b" }\n'
              '  inner_product_param { num_output: 24 weight_filler { type: "gaussian" std: 0.2 }\n'
              '    bias_filler { type: "constant" value: 0.05 } } }')
    return f"""
name: "shared_small"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param {{ num_output: 24 weight_filler {{ type: "gaussian" std: 0.05 }}
    bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  {shared}
layer {{ name: "relu2" type: "ReLU" bottom: "ip2" top: "ip2" }}
layer {{ name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
  {shared}
layer {{ name: "relu3" type: "ReLU" bottom: "ip3" top: "ip3" }}
layer {{ name: "ip4" type: "InnerProduct" bottom: "ip3" top: "ip4"
  inner_product_param {{ num_output: {classes} weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip4" bottom: "label" top: "loss" }}
"""


def test_a_parameter_shared_by_two_layers_is_reduced_at_its_lowest_user(data, tmp_path):
    G, K = 2, 4
    param = solver_param(shared_net(data, K), max_iter=ITERS)
    probe = get_solver(param, dtype=numpy.float64)
    users = {}
    for li, specs in enumerate(probe.net.layer_param_specs):
        for spec in specs:
            users.setdefault(spec.name, []).append(probe.net.layer_names[li])
    probe.net.shutdown()
    assert users["shared_w"] == users["shared_b"] == ["ip2", "ip3"], users
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(shared_net(data, G * K), max_iter=ITERS), weights_out=weights)
    solver = trained(param, weights, ITERS, replicas=G)
    assert_params_close(params_of(solver), want, rtol=1e-5, label="shared parameters, G=2")


def test_the_loss_is_the_mean_of_the_replicas_losses(data, tmp_path):
    """The loss the solver gets each iteration (its smoothed, displayed loss, over the last
    average_loss iterations) equals that of one net on the combined batch."""
    G, K, iters = 2, 4, 3
    weights = str(tmp_path / "init.caffemodel")
    one = get_solver(solver_param(fc_net(data, G * K), max_iter=iters, average_loss=iters),
                     dtype=numpy.float64)
    one.net.save(weights)
    one.step(iters)
    one.net.shutdown()
    solver = trained(solver_param(fc_net(data, K), max_iter=iters, average_loss=iters), weights,
                     iters, replicas=G)
    assert 0.1 < one.smoothed_loss < 10
    assert solver.smoothed_loss == pytest.approx(one.smoothed_loss, rel=1e-9), (
        f"replicas' loss {solver.smoothed_loss} != one net's {one.smoothed_loss}")


def test_the_other_replica_takes_the_leaders_parameters_before_its_forward(data, tmp_path):
    solver = get_solver(solver_param(fc_net(data, 4), max_iter=2), dtype=numpy.float64,
                        replicas=2)
    leader, other = solver.replicas.nets
    solver.step(1)                     # the update changed the leader only
    assert not numpy.array_equal(leader.learnable_params[0].data, other.learnable_params[0].data)
    solver.replicas.begin_iteration()  # the next iteration's forward copies them first
    for li in range(len(leader.layers)):
        solver.replicas.forward_layer(li)
    for a, b in zip(leader.learnable_params, other.learnable_params):
        assert numpy.array_equal(a.data, b.data)
    solver.net.shutdown()
    solver.replicas.shutdown()


def dropout_net(data, batch):
    """fc_net with a Dropout after its first ReLU (a layer that draws random numbers)."""
    return fc_net(data, batch).replace(
        'layer { name: "ip2"',
        'layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" }\nlayer { name: "ip2"')


def test_dropout_draws_the_same_numbers_every_run(data):
    """Dropout runs on the replicas in replica order: the run does not depend on thread timing."""
    param = solver_param(dropout_net(data, 4), max_iter=6)
    assert "Dropout" in str(param.net_param)
    runs = []
    for _ in range(3):
        solver = get_solver(param, dtype=numpy.float64, replicas=2)
        solver.step(6)
        runs.append(params_of(solver))
        solver.net.shutdown()
        solver.replicas.shutdown()
    for run in runs[1:]:
        assert all(numpy.array_equal(a, b) for a, b in zip(run, runs[0]))


def test_resume_continues_every_replicas_data(data, tmp_path):
    """A snapshot keeps the other replica's data cursor: 4 iterations equal 2, a snapshot, a
    new solver resumed from it, and 2 more (bitwise)."""
    param = solver_param(fc_net(data, 4), max_iter=4, snapshot_prefix=str(tmp_path / "snap"))
    runs = []
    for split in (False, True):
        solver = get_solver(param, dtype=numpy.float64, replicas=2)
        solver.step(2)
        if split:
            state = solver.snapshot()
            solver.net.shutdown()
            solver.replicas.shutdown()
            solver = get_solver(param, dtype=numpy.float64, replicas=2)
            solver.restore(state)
        solver.step(2)
        runs.append(params_of(solver))
        solver.net.shutdown()
        solver.replicas.shutdown()
    assert all(numpy.array_equal(a, b) for a, b in zip(*runs))


def test_replicas_read_their_own_shards(data):
    assert replica_shard((0, 1), 1, 2) == (1, 2)
    assert [replica_shard((1, 2), g, 2) for g in range(2)] == [(2, 4), (3, 4)]
    solver = get_solver(solver_param(fc_net(data, 4), max_iter=1), shard=(1, 2), replicas=2)
    assert [net.shard for net in solver.replicas.nets] == [(2, 4), (3, 4)]
    solver.net.shutdown()
    solver.replicas.shutdown()


def test_bad_replica_counts_and_device_lists_are_one_line():
    for gpu, count, words in ((None, 0, "--devices-per-node 0"), ("0,1", 3, "lists 2 devices"),
                              ("0,x", None, "comma-separated"), ("-2", 2, ">= 0")):
        with pytest.raises(PoseidonError) as e:
            plan_devices(gpu, count)
        assert words in str(e.value) and "\n" not in str(e.value)
    assert plan_devices(None, 3) == [None] * 3
    assert plan_devices("1", 2) == [1, 1]
    assert plan_devices("0,1") == plan_devices("0,1", 2) == [0, 1]
    for count, devices in ((0, None), (2, [0]), (2, [0, 1])):
        with pytest.raises(PoseidonError) as e:
            check_replicas(count, devices, numpy)
        assert "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("devices", [None, [0, 0]], ids=["default-device", "listed"])
def test_two_replicas_on_one_gpu_equal_the_numpy_reference(data, tmp_path, devices):
    G, K = 2, 2
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(conv_net(data, G * K), max_iter=ITERS), weights_out=weights)
    backend.set_mode_gpu(0)
    try:
        solver = trained(solver_param(conv_net(data, K), max_iter=ITERS), weights, ITERS,
                         replicas=G, devices=devices)
        assert solver.net.xp is not numpy
        assert_params_close(params_of(solver), want, rtol=1e-5, label="gpu G=2")
    finally:
        backend.set_mode_cpu()
