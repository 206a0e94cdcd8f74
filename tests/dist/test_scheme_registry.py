"""A synchronisation scheme defined here alone, with no edit under dist/: registered with
@register_scheme, BestScheme picks it for the layers where its cost is the lowest, `--sync NAME` runs
it for every layer, and either way P workers end with the parameters of one process on the combined
batch (float64, 1e-5).

The scheme: every worker sends its whole gradient of the layer to every peer (an all-gather), adds
the P1 gradients in rank order and applies the solver's rule itself, as SFB does with its factors.
"""
from dataclasses import replace

import numpy
import pytest

from poseidon.dist.coord.records import LayerRecord
from poseidon.dist.cost.formulas import ps_cost
from poseidon.dist.errors import DistError
from poseidon.dist.schemes import SCHEMES, Scheme, choose_scheme, register_scheme, sync_choices
from poseidon.dist.transport import Msg

from .helpers import (assert_params_close, conv_net, fc_net, make_lmdb, params_of, reference,
                      run_threads, solver_param)

NAME = "allgather-test"
CHEAP_FOR = set()          # layer names whose cost the scheme claims to be zero


class AllGatherScheme(Scheme):
    name = NAME

    @staticmethod
    def applies_to(rec):
        return True

    @staticmethod
    def cost(rec, P1, P2):
        if rec.name in CHEAP_FOR:
            return 0.0
        return 2 * ps_cost(rec.M, rec.N, P1, max(P2, 1)) + 1.0   # never cheapest otherwise

    @staticmethod
    def peer_arrays(rec, arrays):
        shapes = [tuple(s) for s in rec.shapes]
        return (shapes if len(arrays) == len(shapes) else None), str(shapes)

    def send(self, it, stats):
        ctx, net = self.ctx, self.ctx.net
        self.own = [numpy.array(net.learnable_params[pid].diff) for pid in self.syncer.pids]
        self.receipts = []
        for peer in ctx.roles.worker_ranks():
            if peer != ctx.rank:
                receipt = ctx.transport.send(peer, Msg.SF, iteration=it, key=self.syncer.li,
                                             arrays=self.own)
                stats.sent(receipt)
                self.receipts.append(receipt)

    def receive(self, it, stats):
        ctx, net = self.ctx, self.ctx.net
        peers = [r for r in ctx.roles.worker_ranks() if r != ctx.rank]
        msgs = ctx.transport.receive(Msg.SF, self.syncer.li, it, count=len(peers), senders=peers,
                                     what=f"layer '{self.syncer.name}' gradients") if peers else []
        by_rank = {m.sender: m.arrays for m in msgs}
        by_rank[ctx.rank] = self.own
        for k, pid in enumerate(self.syncer.pids):
            total = sum(by_rank[r][k] for r in ctx.roles.worker_ranks())    # rank order
            p = ctx.book.params[pid]
            blob = net.learnable_params[pid]
            ctx.rule.update(blob.data, total.reshape(blob.data.shape), ctx.history[pid], it,
                            p.lr_mult, p.decay_mult, ctx.grad_scale)
        for r in self.receipts:
            r.wait()


@pytest.fixture
def registered():
    register_scheme(AllGatherScheme)
    yield AllGatherScheme
    SCHEMES.pop(NAME, None)
    CHEAP_FOR.clear()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


def check_equivalence(data, tmp_path, build, K, P1, P2, **options):
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(build(data, P1 * K), max_iter=6), weights_out=weights)
    solvers = run_threads(solver_param(build(data, K), max_iter=6), P1, P2, weights=weights,
                          **options)
    for s in solvers:
        assert_params_close(params_of(s), want, rtol=1e-5, label=str(options))
    return {rec.name: rec.scheme for rec in solvers[0].book.layers}


def test_registration_is_checked(registered):
    assert NAME in sync_choices()
    register_scheme(AllGatherScheme)                  # the same class again: harmless

    class Impostor(AllGatherScheme):
        pass
    with pytest.raises(DistError, match=f"scheme '{NAME}' is registered twice"):
        register_scheme(Impostor)


def test_best_scheme_picks_it_where_it_is_cheapest(registered):
    rec = LayerRecord(index=0, name="ip2", type="InnerProduct", M=4096, N=4096, K=32, sfb=True,
                      params=())
    assert choose_scheme(rec, 4, 2) == "sfb"
    CHEAP_FOR.add("ip2")
    assert choose_scheme(rec, 4, 2) == NAME
    assert choose_scheme(replace(rec, name="ip1"), 4, 2) == "sfb"
    assert choose_scheme(rec, 4, 2, relaxed="--staleness") == "ps"      # BSP only


@pytest.mark.slow
def test_hybrid_runs_it_on_the_layer_it_is_cheapest_for(registered, data, tmp_path):
    CHEAP_FOR.add("ip2")
    schemes = check_equivalence(data, tmp_path, fc_net, 8, 3, 1)
    assert schemes["ip2"] == NAME
    assert schemes["ip1"] != NAME and schemes["ip3"] != NAME


@pytest.mark.slow
@pytest.mark.parametrize("no_overlap", [False, True])
def test_sync_name_runs_it_for_every_layer(registered, data, tmp_path, no_overlap):
    schemes = check_equivalence(data, tmp_path, conv_net, 2, 2, 1, sync=NAME,
                                no_overlap=no_overlap)
    assert set(schemes.values()) == {NAME}
