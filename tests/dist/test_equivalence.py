"""Equivalence: P1 workers of batch K (with P2 servers, any --sync, with and without overlap) end
with the parameters of ONE process trained on the combined batch P1*K, in float64.

Every role runs as a thread of this process over real ZeroMQ sockets (tests/dist/helpers.py). The
nets: an FC-heavy one (three InnerProducts) and a cifar10_quick-style conv net, both on a small
LMDB; 20 iterations of SGD with momentum, weight decay, lr_mult 2 biases and a step lr policy, so
the servers' and the SFB workers' use of the solver rule (state, lr by iteration, multipliers) is
exercised. Also: the replicas are bitwise identical to each other.

Run: python -m pytest tests/dist/test_equivalence.py -q
"""
import itertools
import json

import numpy
import pytest

from .helpers import (assert_params_close, conv_net, fc_net, make_lmdb, params_of, reference,
                      run_processes, run_threads, solver_param)

ITERS = 20
NETS = {"fc": (fc_net, 8), "conv": (conv_net, 2)}      # builder, per-worker batch K


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


@pytest.fixture(scope="module")
def references(data, tmp_path_factory):
    cache = {}
    folder = tmp_path_factory.mktemp("init")

    def get(net, P1):
        if (net, P1) not in cache:
            build, K = NETS[net]
            weights = str(folder / f"{net}-{P1}.caffemodel")
            want = reference(solver_param(build(data, P1 * K), max_iter=ITERS), weights_out=weights)
            cache[(net, P1)] = (weights, want)
        return cache[(net, P1)]
    return get


CASES = list(itertools.product(["fc", "conv"], [2, 4], [1, 2], ["ps", "sfb", "hybrid"],
                               [False, True]))


@pytest.mark.slow
@pytest.mark.parametrize("net,P1,P2,sync,no_overlap", CASES,
                         ids=[f"{n}-w{a}-s{b}-{s}{'-noov' if o else ''}" for n, a, b, s, o in CASES])
def test_equals_one_process_on_the_combined_batch(data, references, net, P1, P2, sync, no_overlap):
    build, K = NETS[net]
    weights, want = references(net, P1)
    solvers = run_threads(solver_param(build(data, K), max_iter=ITERS), P1, P2, weights=weights,
                          sync=sync, no_overlap=no_overlap)
    schemes = {rec.name: rec.scheme for rec in solvers[0].book.layers}
    if net == "conv":         # never SFB; under hybrid the cheaper of PS and the ring, which
        # moves the bias too: PS at 2 workers, the ring at 4 (3·168 floats against 2·162·(P1 +
        # P2 − 2)/P2 for conv1)
        want_conv = "allreduce" if sync == "hybrid" and P1 == 4 else "ps"
        assert schemes["conv1"] == schemes["conv2"] == want_conv
    if sync != "hybrid":
        assert all(s == sync for n, s in schemes.items() if not n.startswith("conv"))
    for s in solvers:
        assert s.solver.iter == ITERS
        assert_params_close(params_of(s), want, rtol=1e-5, label=f"{net} P1={P1} P2={P2} {sync}")
    first = params_of(solvers[0])
    for s in solvers[1:]:
        for a, b in zip(params_of(s), first):
            assert numpy.array_equal(a, b), "replicas differ"


@pytest.mark.slow
def test_processes_equal_one_process_on_the_combined_batch(data, tmp_path, monkeypatch):
    """The matrix's conv-w2-s2-hybrid case as `poseidon train` processes (convolutions by PS, the
    InnerProducts by SFB): the same tolerance against one process on the combined batch, and
    every worker's replica bitwise worker 0's (by the digest in its cursor file)."""
    monkeypatch.setenv("POSEIDON_CONV", "im2col")     # the route the processes are pinned to
    build, K = NETS["conv"]
    P1, P2 = 2, 2
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(build(data, P1 * K), max_iter=ITERS), weights_out=weights)
    got = run_processes(solver_param(build(data, K), max_iter=ITERS), P1, P2, tmp_path,
                        weights=weights, sync="hybrid")
    assert_params_close(got, want, rtol=1e-5, label="processes: conv P1=2 P2=2 hybrid")


@pytest.mark.slow
def test_hybrid_mixes_schemes_on_the_fc_net(data, references):
    """At K=8, P1=4, P2=2 BestScheme sends the two big layers by SFB and the 5x24 classifier by
    the ring (3·125 floats against PS's 2·120·4/2 and SFB's 2·8·3·29)."""
    weights, _ = references("fc", 4)
    solvers = run_threads(solver_param(fc_net(data, 8), max_iter=2), 4, 2, weights=weights)
    schemes = [rec.scheme for rec in solvers[0].book.layers]
    assert schemes == ["sfb", "sfb", "allreduce"]


@pytest.mark.slow
def test_sum_gradients_is_the_papers_sum(data, tmp_path):
    """--sum-gradients: the update uses the SUM of the workers' gradients, i.e. one process with
    P1 x base_lr and weight_decay / P1 (momentum SGD)."""
    P1, K = 2, 8
    ref = solver_param(fc_net(data, P1 * K), max_iter=6, base_lr=0.05 * P1, weight_decay=0.001 / P1)
    weights = str(tmp_path / "init.caffemodel")
    want = reference(ref, weights_out=weights)
    for sync in ("ps", "sfb"):
        solvers = run_threads(solver_param(fc_net(data, K), max_iter=6), P1, 1, weights=weights,
                              sync=sync, sum_gradients=True)
        assert_params_close(params_of(solvers[0]), want, rtol=1e-5, label=f"sum {sync}")


@pytest.mark.slow
def test_adam_state_lives_on_servers_and_workers(data, tmp_path):
    """A two-state rule (Adam): history kept per KV pair and per SFB layer still gives one process."""
    P1, K = 2, 8
    extra = dict(solver_type="Adam", base_lr=0.01, momentum=0.9, momentum2=0.999, delta=1e-8)
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(fc_net(data, P1 * K), max_iter=8, **extra), weights_out=weights)
    solvers = run_threads(solver_param(fc_net(data, K), max_iter=8, **extra), P1, 2,
                          weights=weights, sync="hybrid")
    assert_params_close(params_of(solvers[1]), want, rtol=1e-5, label="adam")


@pytest.mark.slow
def test_iter_size_accumulates_then_syncs_once(data, tmp_path):
    """iter_size 2: gradients of two passes accumulate, the sync runs after the last one (SFB needs
    one pass's factors, so every layer goes by PS) and equals one process with iter_size 2."""
    P1, K = 2, 4
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(conv_net(data, P1 * K), max_iter=6, iter_size=2),
                     weights_out=weights)
    solvers = run_threads(solver_param(conv_net(data, K), max_iter=6, iter_size=2), P1, 1,
                          weights=weights)
    assert {rec.scheme for rec in solvers[0].book.layers} == {"ps"}
    assert solvers[0].book.data["grad_scale"] == 1 / (P1 * 2)
    assert_params_close(params_of(solvers[0]), want, rtol=1e-5, label="iter_size 2")


@pytest.mark.slow
def test_fused_messages_change_nothing_but_the_message_count(data, references, tmp_path):
    """A layer's pairs on a server travel as one message (--fusion-bytes, default the pair size):
    with it and with one message per pair (--fusion-bytes 0), the same bits come out, and the
    fused run sends fewer messages."""
    weights, want = references("conv", 2)
    build, K = NETS["conv"]
    runs = {}
    for fusion in (None, 0):
        extra = {} if fusion is None else {"fusion_bytes": fusion}
        stats = str(tmp_path / f"stats-{fusion}.jsonl")
        solvers = run_threads(solver_param(build(data, K), max_iter=ITERS), 2, 2, weights=weights,
                              sync="ps", stats=stats, **extra)
        book = solvers[0].book
        with open(stats.replace(".jsonl", ".worker-0.jsonl"), encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        sent = sum(layer["messages_sent"] for r in records for layer in r["layers"].values())
        runs[fusion] = (params_of(solvers[0]), sent, len(book.bundles), len(book.pairs))
    (fused, sent_fused, n_fused, pairs), (flat, sent_flat, n_flat, _) = runs[None], runs[0]
    for a, b in zip(fused, flat):
        assert numpy.array_equal(a, b), "fusion changed the arithmetic"
    assert_params_close(fused, want, rtol=1e-5, label="fused")
    assert n_flat == pairs and n_fused < pairs          # every conv/ip bias rides with its weight
    assert sent_flat == ITERS * pairs and sent_fused == ITERS * n_fused


@pytest.mark.slow
@pytest.mark.parametrize("no_overlap", [False, True], ids=["wfbp", "no-overlap"])
def test_buckets_change_nothing_but_the_message_count(data, references, tmp_path, no_overlap):
    """--bucket-bytes: small layers share one sync, started after the lowest of them is back.
    The same bits come out as with every layer alone, worker 0's stats name the bucket (its
    layers in backward order, joined by '+'), and it sends fewer messages an iteration."""
    weights, want = references("conv", 2)
    build, K = NETS["conv"]
    runs = {}
    for bucket in (0, 64 << 20):
        stats = str(tmp_path / f"stats-{bucket}-{no_overlap}.jsonl")
        solvers = run_threads(solver_param(build(data, K), max_iter=ITERS), 2, 2, weights=weights,
                              sync="ps", stats=stats, bucket_bytes=bucket, no_overlap=no_overlap)
        with open(stats.replace(".jsonl", ".worker-0.jsonl"), encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        runs[bucket] = (params_of(solvers[0]), records, solvers[0].book)
    (alone, rec_alone, book_alone), (bucketed, rec_bucket, book) = runs[0], runs[64 << 20]
    for a, b in zip(alone, bucketed):
        assert numpy.array_equal(a, b), "a bucket changed the arithmetic"
    assert_params_close(bucketed, want, rtol=1e-5, label="bucketed")
    assert len(book.synced_layers()) == 1 < len(book_alone.synced_layers())
    names = [rec.name for rec in sorted(book.layers, key=lambda r: -r.index)]
    (key,) = rec_bucket[-1]["layers"]
    assert key == "+".join(names)                         # in backward order
    sent = {b: sum(layer["messages_sent"] for r in recs for layer in r["layers"].values())
            for b, recs in ((0, rec_alone), (1, rec_bucket))}
    assert sent[1] == ITERS * len(book.bundles) < sent[0] == ITERS * len(book_alone.bundles)
