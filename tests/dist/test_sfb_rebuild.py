"""SFB's rebuild on the workers: block by block of weight rows, fused with the update, and with
the layer's own weight gradient skipped (dist/schemes/sfb.py: the solver runs the layer's backward
with weight_grad=False).

Roles run as threads of this process over real ZeroMQ sockets (tests/dist/helpers.py), float64.

Run: python -m pytest tests/dist/test_sfb_rebuild.py -q
"""
import numpy
import pytest

from poseidon.engine import parallel

from .helpers import (assert_params_close, fc_net, make_lmdb, params_of, reference,
                      run_processes, run_threads, solver_param)

ITERS = 12
K = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


@pytest.mark.slow
@pytest.mark.parametrize("P1,P2", [(2, 1), (3, 0)])
def test_rebuild_in_small_blocks_equals_one_process(data, tmp_path, monkeypatch, P1, P2):
    """Blocks of 5 rows (ip1: 48 rows = 9 blocks of 5 + one of 3; ip2: 20 + 4) give the
    parameters of one process on the combined batch, the replicas stay bitwise equal, and the
    SFB layers never made their local weight gradient (their weight diffs stay zero)."""
    monkeypatch.setattr(parallel, "MIN_BLOCK_ROWS", 1)
    monkeypatch.setattr(parallel, "WEIGHT_BLOCK_BYTES", 5 * 192 * 8)    # float64 rows of 192
    monkeypatch.setattr(parallel, "ROWS_PER_FACTOR_ROW", 0)
    monkeypatch.setattr(parallel, "PADDED_ROWS_MIN", 0)           # padded rows even here
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(fc_net(data, P1 * K), max_iter=ITERS), weights_out=weights)
    solvers = run_threads(solver_param(fc_net(data, K), max_iter=ITERS), P1, P2,
                          weights=weights, sync="sfb")
    first = params_of(solvers[0])
    assert_params_close(first, want, rtol=1e-5, label=f"sfb P1={P1} P2={P2} in blocks")
    for s in solvers[1:]:
        for a, b in zip(params_of(s), first):
            assert numpy.array_equal(a, b), "replicas differ"
    net = solvers[0].solver.net
    for name in ("ip1", "ip2", "ip3"):
        layer = net.layers[net.layer_names.index(name)]
        assert not layer.blobs[0].diff.any(), f"{name} made its own weight gradient under SFB"
        if len(layer.blobs) > 1:
            assert layer.blobs[1].diff.any()                 # the bias gradient is still made


def wide_net(source, batch):
    """fc_net on 3x16x16 images with an ip1 of 1366 x 768 (just over 2**20 floats): at the
    default block size (twice the L2, at most 8 MiB) its rebuild goes in more than one block,
    of padded rows, with nothing patched."""
    head = 'name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"'
    text = fc_net(source, batch)
    at = text.index(head)
    cut = text.index("num_output: 48", at)
    return text[:cut] + "num_output: 1366" + text[cut + len("num_output: 48"):]


@pytest.mark.slow
def test_rebuild_in_blocks_as_processes_equals_one_process(tmp_path):
    """Three serverless `poseidon train` workers under --sync sfb (the processes cannot have the
    block constants patched, so the layer is made large enough to be cut at the defaults): one
    process on the combined batch within 1e-5, every replica bitwise worker 0's."""
    P1, iters = 3, 4
    rows, row_len = 1366, 3 * 16 * 16
    assert rows * row_len >= parallel.PADDED_ROWS_MIN
    assert parallel.block_rows(rows, row_len, 8, factor_rows=P1 * K) < rows
    source = make_lmdb(tmp_path / "wide", n=64, shape=(3, 16, 16))
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(wide_net(source, P1 * K), max_iter=iters), weights_out=weights)
    got = run_processes(solver_param(wide_net(source, K), max_iter=iters), P1, 0, tmp_path,
                        weights=weights, sync="sfb")
    assert_params_close(got, want, rtol=1e-5, label="processes: sfb P1=3 P2=0, blocked rebuild")


@pytest.mark.slow
def test_layers_by_ps_keep_their_weight_gradient(data, tmp_path):
    """Under --sync ps the InnerProducts compute their weight gradients as usual."""
    solvers = run_threads(solver_param(fc_net(data, K), max_iter=2), 2, 1, sync="ps")
    net = solvers[0].solver.net
    for name in ("ip1", "ip2", "ip3"):
        assert net.layers[net.layer_names.index(name)].blobs[0].diff.any()


@pytest.mark.slow
def test_diffs_cleared_per_layer_per_iteration(data, tmp_path, monkeypatch):
    """Under hybrid (ip1, ip2 by SFB, ip3 by the ring, whose backward writes its weight gradient
    as a PS layer's does) the step clears every diff but the SFB weights,
    which are zeroed once after they may have been written: when the layer went by PS in an
    earlier iteration (simulated here, as the book's scheme is fixed for a job)."""
    solvers = run_threads(solver_param(fc_net(data, K), max_iter=3), 4, 2)
    ds = solvers[0]
    net = ds.solver.net
    assert [rec.scheme for rec in ds.hooks.book.layers] == ["sfb", "sfb", "allreduce"]
    weights = {net.layers[net.layer_names.index(n)].blobs[0] for n in ("ip1", "ip2")}
    params = net.learnable_params
    assert not any(b.diff.any() for b in weights)            # kept at zero through the run
    assert net.layers[net.layer_names.index("ip3")].blobs[0].diff.any()

    def written():                                           # what a backward by PS leaves
        for b in params:
            b.diff[...] = 1.0

    def begin_and_clear():          # the step's plan, then the clear before the first backward
        ds.solver._begin_iteration(ds.solver.iter)
        ds.solver._clear_gradients()

    written()
    begin_and_clear()       # known zero already: SFB's skipped
    for b in params:
        assert b.diff.any() == (b in weights)
    with monkeypatch.context() as m:                         # an iteration where all go by PS
        for syncer in ds.hooks.syncers.values():
            m.setattr(syncer, "prepare", lambda it: False)
        begin_and_clear()
        assert not any(b.diff.any() for b in params)
        written()
    begin_and_clear()       # back to SFB: cleared once
    assert not any(b.diff.any() for b in params)
    written()
    begin_and_clear()
    for b in params:
        assert b.diff.any() == (b in weights)


@pytest.mark.slow
def test_an_inner_product_off_the_loss_path_is_not_rebuilt_from_factors(data, tmp_path):
    """An InnerProduct whose output only feeds an Accuracy runs no backward, so it has no factors:
    it is not SFB-capable, and the job trains as one process on the combined batch does."""
    def with_aux(batch):
        return fc_net(data, batch).replace(
            'layer { name: "loss"',
            'layer { name: "aux" type: "InnerProduct" bottom: "ip2" top: "aux"\n'
            '  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }\n'
            'layer { name: "aux_accuracy" type: "Accuracy" bottom: "aux" bottom: "label" '
            'top: "aux_accuracy" }\nlayer { name: "loss"')
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(with_aux(2 * K), max_iter=3), weights_out=weights)
    solvers = run_threads(solver_param(with_aux(K), max_iter=3), 2, 1, sync="sfb", weights=weights)
    schemes = {rec.name: (rec.weight_grad, rec.scheme) for rec in solvers[0].book.layers}
    assert schemes["aux"] == (False, "ps") and schemes["ip1"] == (True, "sfb")
    assert_params_close(params_of(solvers[0]), want, rtol=1e-5, label="aux")
