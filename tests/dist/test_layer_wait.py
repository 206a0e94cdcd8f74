"""The per-layer wait (dist/worker/layerwait.py): the next forward of layer l waits for the syncs it
depends on, not for every sync of the last iteration.

Equivalence with one process on the combined batch (float64, 1e-5) under ps, sfb, allreduce and
hybrid with 2 and 3 workers; the map of what each forward waits for (a shared parameter too); a
probe (a Python layer that notes when its forward ran, right above the bottom InnerProduct) showing that layer's forward of
the next iteration under way before the top layer's slow sync (a big top layer under a bandwidth
cap, --priority on) of the last one ended, and not under --no-overlap; and equivalence with that
slow top layer, whose gradient (PS) or bottom data (SFB) is sent zero-copy while the next
iteration's forward runs: it fails if the gradients were cleared, or the top layer's input
overwritten, before the sync had sent them.

Run: python -m pytest tests/dist/test_layer_wait.py -x -q
"""
import json

import pytest

from poseidon.dist.worker.timeline import role_path

from .helpers import (assert_params_close, fc_net, make_lmdb, params_of, reference,
                      run_processes, run_threads, solver_param)

ITERS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train", n=48)


def slow_top_net(source, batch):
    """ip1 (192 x 2) with a stamp above it, under two big layers (ip2: 2 x 4096, ip3: 4096 x 5)
    and a pause in the backward under ip3 (its sync starts first for sure)."""
    return f"""
name: "slow_top"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param {{ num_output: 2 weight_filler {{ type: "gaussian" std: 0.05 }} }} }}
layer {{ name: "stamp" type: "Python" bottom: "ip1" top: "stamped"
  python_param {{ module: "tests.dist.fault_layers" layer: "Stamp" }} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "stamped" top: "ip2"
  inner_product_param {{ num_output: 4096 weight_filler {{ type: "gaussian" std: 0.05 }} }} }}
layer {{ name: "pause" type: "Python" bottom: "ip2" top: "paused"
  python_param {{ module: "tests.dist.fault_layers" layer: "SlowBackward"
    param_str: '{{"seconds": 0.03}}' }} }}
layer {{ name: "ip3" type: "InnerProduct" bottom: "paused" top: "ip3"
  inner_product_param {{ num_output: 5 weight_filler {{ type: "gaussian" std: 0.05 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss" }}
"""


# slices of 64 KiB: as large as the transport sends zero-copy (zmq_transport.ZERO_COPY_BYTES), so
# ip3's gradient leaves from the diff itself, slice by slice, under the cap
CAPPED = dict(bucket_bytes=0, slice_bytes=65536, bandwidth="2MB", priority="on")


@pytest.mark.slow
@pytest.mark.parametrize("P1", [2, 3])
@pytest.mark.parametrize("sync", ["ps", "sfb", "allreduce", "hybrid"])
def test_equals_one_process_with_the_per_layer_wait(data, tmp_path, sync, P1):
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(fc_net(data, P1 * 4), max_iter=ITERS), weights_out=weights)
    solvers = run_threads(solver_param(fc_net(data, 4), max_iter=ITERS), P1, 1, weights=weights,
                          sync=sync)
    assert solvers[0].hooks.layer_wait
    if sync != "hybrid":
        assert {rec.scheme for rec in solvers[0].book.layers} == {sync}
    for s in solvers:
        assert s.iter == ITERS
        assert_params_close(params_of(s), want, rtol=1e-5, label=f"{sync} P1={P1}")
        assert s.last_sync["iter"] == ITERS - 1          # the last iteration's syncs all landed


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["ps", "sfb"])
def test_each_forward_waits_for_its_own_sync_and_for_those_that_send_what_it_writes(data, sync):
    """fc_net: data, ip1, relu1 (in place on ip1), ip2, relu2, ip3, loss. Under PS a forward
    waits for its own layer's sync; SFB sends each InnerProduct's bottom data too, so the forward
    that writes it (the layer below, or an in-place ReLU on it) waits for the sync above."""
    solvers = run_threads(solver_param(fc_net(data, 4), max_iter=1), 2, 1, sync=sync,
                          bucket_bytes=0)
    hooks = solvers[0].hooks
    names = hooks.net.layer_names
    got = {names[li]: sorted(names[k] for k in keys)
           for li, keys in hooks.wfbp.forward_waits.items()}
    if sync == "ps":
        want = {"data": [], "ip1": ["ip1"], "relu1": [], "ip2": ["ip2"], "relu2": [],
                "ip3": ["ip3"], "loss": []}
    else:
        want = {"data": ["ip1"], "ip1": ["ip1", "ip2"], "relu1": ["ip2"], "ip2": ["ip2", "ip3"],
                "relu2": ["ip3"], "ip3": ["ip3"], "loss": []}
    assert got == want


@pytest.mark.slow
def test_a_forward_waits_for_a_sync_that_sends_a_split_of_what_it_writes(data):
    """ip2's output feeds ip3 and an InnerProduct off the loss path (aux, to an Accuracy), so the
    net splits it: ip3's bottom is a Split's top, another Blob over the same memory. SFB sends
    that memory as ip3's X, so ip2's and relu2's forwards, which write it, wait for ip3's sync
    (compared by object alone they did not, and the next forward overwrote X while it was still
    being sent: replicas that differed now and then)."""
    text = fc_net(data, 4).replace(
        'layer { name: "loss"',
        'layer { name: "aux" type: "InnerProduct" bottom: "ip2" top: "aux"\n'
        '  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }\n'
        'layer { name: "aux_accuracy" type: "Accuracy" bottom: "aux" bottom: "label" '
        'top: "aux_accuracy" }\nlayer { name: "loss"')
    solvers = run_threads(solver_param(text, max_iter=1), 2, 1, sync="sfb", bucket_bytes=0)
    hooks = solvers[0].hooks
    names = hooks.net.layer_names
    got = {names[li]: sorted(names[k] for k in keys)
           for li, keys in hooks.wfbp.forward_waits.items()}
    assert any("split" in n for n in names), names
    assert "ip3" in got["ip2"] and "ip3" in got["relu2"], got


def probe(data, folder, **options):
    """(worker 0's stamp times per iteration, its sync spans of ip3 per iteration) of a 4-iteration
    job of 2 workers whose top layer's sync is slow; checks worker 0's --stats lines."""
    stats = str(folder / "stats.jsonl")
    solvers = run_threads(solver_param(slow_top_net(data, 4), max_iter=4), 2, 1, sync="ps",
                          timeline=str(folder / "trace.json"), stats=stats, **CAPPED, **options)
    hooks = solvers[0].hooks
    stamps = hooks.net.layers[hooks.net.layer_names.index("stamp")].stamps
    ip3 = {args["iter"]: (start, end) for name, _, start, end, _, args in hooks.timeline.events()
           if name == "sync ip3"}
    records = [json.loads(line) for line in open(role_path(stats, "worker", 0))]
    assert [r["iter"] for r in records] == [0, 1, 2, 3]       # every iteration's, once it settled
    for r in records:
        assert r["exposed_sync_s"] >= r["barrier_wait_s"] >= 0
        assert r["layers"]["ip3"]["sync_s"] > 0.05
    return stamps, ip3


@pytest.mark.slow
def test_the_bottom_layers_next_forward_runs_while_the_top_layers_sync_is_on_the_wire(data,
                                                                                      tmp_path):
    stamps, ip3 = probe(data, tmp_path)
    assert len(stamps) == 4 and sorted(ip3) == [0, 1, 2, 3]
    for it in range(3):
        start, end = ip3[it]
        assert end - start > 0.05, f"iteration {it}: ip3's sync took {end - start:.3f} s"
        assert stamps[it + 1] < end, (f"iteration {it + 1}: the forward above ip1 ran "
                                      f"{stamps[it + 1] - end:.3f} s after ip3's sync of "
                                      f"iteration {it} ended")


@pytest.mark.slow
def test_without_overlap_the_next_forward_waits_for_every_sync(data, tmp_path):
    """--no-overlap keeps the full barrier: the same probe sees the forward after ip3's sync."""
    stamps, ip3 = probe(data, tmp_path, no_overlap=True)
    for it in range(3):
        assert stamps[it + 1] > ip3[it][1]


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["ps", "sfb"])
def test_a_slow_zero_copy_sync_is_not_overwritten_by_the_next_iteration(data, tmp_path, sync):
    """PS sends each diff zero-copy (the clearing of the gradients must wait for it), SFB each
    layer's bottom data (the forward below must wait for it), while ip3's sync crawls."""
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(slow_top_net(data, 2 * 4), max_iter=4), weights_out=weights)
    solvers = run_threads(solver_param(slow_top_net(data, 4), max_iter=4), 2, 1, weights=weights,
                          sync=sync, **CAPPED)
    assert {rec.scheme for rec in solvers[0].book.layers} == {sync}
    for s in solvers:
        assert_params_close(params_of(s), want, rtol=1e-5, label=f"slow ip3, {sync}")


@pytest.mark.slow
def test_a_slow_zero_copy_sync_between_processes_is_not_overwritten(data, tmp_path):
    """The capped job above under --sync ps as `poseidon train` processes: each diff leaves
    zero-copy while the next iteration runs, and the job still equals one process (1e-5), every
    replica bitwise worker 0's."""
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(slow_top_net(data, 2 * 4), max_iter=4), weights_out=weights)
    got = run_processes(solver_param(slow_top_net(data, 4), max_iter=4), 2, 1, tmp_path,
                        weights=weights, sync="ps", **CAPPED)
    assert_params_close(got, want, rtol=1e-5, label="processes: slow ip3, ps")


def test_a_layer_sharing_a_parameter_waits_for_the_owners_sync(data):
    """ipB uses ipA's weight (shared by name): its forward needs the sync that updates it."""
    from types import SimpleNamespace

    from google.protobuf import text_format

    from poseidon.dist.worker.layerwait import forward_waits
    from poseidon.engine.layer import TRAIN
    from poseidon.engine.net import Net
    from poseidon.engine.proto import caffe_pb2
    text = fc_net(data, 4).replace(
        'layer { name: "loss"', '''layer { name: "ipB" type: "InnerProduct" bottom: "data" top: "ipB"
  param { name: "w" } param { lr_mult: 2 } inner_product_param { num_output: 48 } }
layer { name: "loss"''')
    text = text.replace('''param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }''',
                        '''param { name: "w" } param { lr_mult: 2 decay_mult: 0 }''')
    param = caffe_pb2.NetParameter()
    text_format.Parse(text, param)
    net = Net(param, TRAIN)
    try:
        names = net.layer_names
        syncers = {}                          # one per layer, holding the parameters it owns
        for pid, spec in enumerate(net.learnable_param_specs):
            li = next(i for i, specs in enumerate(net.layer_param_specs)
                      if any(s.name == spec.name for s in specs))
            syncers.setdefault(li, SimpleNamespace(pids=[], members=[li])).pids.append(pid)
        waits = forward_waits(net, syncers, lambda s: False)
        ipa, ipb = names.index("ip1"), names.index("ipB")
        assert waits[ipa] == (ipa,)
        assert waits[ipb] == (ipa, ipb)       # the shared weight's owner, and its own bias
    finally:
        net.shutdown()
