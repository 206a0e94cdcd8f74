"""Stragglers: BSP with drop (--straggler-timeout) and bounded staleness (--staleness), with one
worker slowed on purpose by a Python layer that sleeps on its rank (tests/dist/fault_layers.py).

Every role runs as a thread of this process over real ZeroMQ sockets (tests/dist/helpers.py);
the counters come from the servers' and workers' --stats files, the drop lines from the log.

Run: python -m pytest tests/dist/test_stragglers.py -q -s
"""
import json
import logging

import numpy
import pytest

from poseidon.dist.coord.book import InformationBook
from poseidon.dist.coord.records import description_from_wire
from poseidon.dist.errors import DistError
from poseidon.dist.job.options import DistOptions
from poseidon.engine.solvers import get_solver

from .helpers import (fc_net, make_lmdb, params_of, reference, run_processes, run_threads,
                      solver_param)

P1, K, ITERS = 3, 4, 20


def slowed(net_text, rank, iters, seconds):
    """The net with a pass-through layer on its data that sleeps on `rank` at `iters`."""
    config = json.dumps({"rank": rank, "iters": list(iters), "seconds": seconds})
    layer = (f'layer {{ name: "slow" type: "Python" bottom: "data" top: "data" python_param {{ '
             f'module: "tests.dist.fault_layers" layer: "SleepOnRank" param_str: \'{config}\' }} }}\n')
    return net_text.replace('layer { name: "ip1"', layer + 'layer { name: "ip1"', 1)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Data, worker 0's initial weights and one process's result on the combined batch."""
    folder = tmp_path_factory.mktemp("stragglers")
    data = make_lmdb(folder / "train")
    weights = str(folder / "init.caffemodel")
    want = reference(solver_param(fc_net(data, P1 * K), max_iter=ITERS), weights_out=weights)
    return {"data": data, "weights": weights, "want": want, "folder": folder}


def run(job, net_text, **options):
    return run_threads(solver_param(net_text, max_iter=ITERS), P1, 1, weights=job["weights"],
                       **options)


def records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def max_relative_error(got, want):
    return max(float(numpy.abs(g - w).max() / max(numpy.abs(w).max(), 1e-12))
               for g, w in zip(got, want))


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings():
    handler = Lines()
    logger = logging.getLogger("poseidon")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def train_loss(job, params):
    """Loss of `params` over the whole training set (one process, combined batches)."""
    solver = get_solver(solver_param(fc_net(job["data"], P1 * K)), dtype=numpy.float64)
    for blob, value in zip(solver.net.learnable_params, params):
        blob.data[...] = value
    batches = 96 // (P1 * K)
    loss = sum(solver.net.Forward() for _ in range(batches)) / batches
    solver.net.shutdown()
    return loss


def test_options_and_schemes():
    """One relaxation at a time, a drop deadline under --timeout, every layer by PS under either,
    and --staleness 0 leaving Algorithm 1's choice as it is."""
    with pytest.raises(DistError, match="cannot be combined"):
        DistOptions(straggler_timeout=1.0, staleness=2)
    with pytest.raises(DistError, match="below --timeout"):
        DistOptions(straggler_timeout=30.0, timeout=30.0)
    layer = {"index": 1, "name": "ip", "type": "InnerProduct", "M": 4096, "N": 4096, "K": 32,
             "sfb": True, "params": [0], "shapes": [[4096, 4096]]}
    desc = description_from_wire({
        "net": "n", "dtype": "float32", "layers": [layer],
        "params": [{"id": 0, "name": "w", "layer": 1, "owner": [1, 0], "shape": [4096, 4096],
                    "count": 4096 * 4096, "lr_mult": 1.0, "decay_mult": 1.0, "shared": False,
                    "synced": True}]})
    schemes = {}
    for name, extra in (("bsp", {}), ("s0", {"staleness": 0}), ("s2", {"staleness": 2}),
                        ("drop", {"straggler_timeout": 1.0})):
        opts = DistOptions(workers=8, servers=8, **extra).shared()
        book = InformationBook.build(desc, 8, 8, opts)
        schemes[name] = (book.layers[0].scheme, book.best_scheme(1))
    print(f"\nschemes of a 4096x4096 InnerProduct, 8 workers: {schemes}")
    assert schemes["bsp"] == schemes["s0"] == ("sfb", "sfb")
    assert schemes["s2"] == schemes["drop"] == ("ps", "ps")
    with pytest.raises(DistError, match="--sync sfb cannot be combined with --staleness"):
        InformationBook.build(desc, 8, 8, DistOptions(workers=8, servers=8, sync="sfb",
                                                      staleness=1).shared())
    with pytest.raises(DistError, match="--straggler-timeout sends every layer"):
        InformationBook.build(desc, 8, 0, DistOptions(workers=8, servers=0,
                                                      straggler_timeout=1.0).shared())


@pytest.mark.slow
def test_without_stragglers_both_options_equal_bsp_bitwise(job):
    """--straggler-timeout with nobody late, and --staleness 0, change no bit."""
    net = fc_net(job["data"], K)
    bsp_ps = run(job, net, sync="ps")
    drop = run(job, net, straggler_timeout=5.0)             # every layer by PS
    bsp = run(job, net)                                     # hybrid: SFB where Algorithm 1 says
    s0 = run(job, net, staleness=0)
    pairs = [("--straggler-timeout 5 vs BSP --sync ps", drop, bsp_ps),
             ("--staleness 0 vs BSP", s0, bsp)]
    for label, got, want in pairs:
        diff = max(float(numpy.abs(g - w).max())
                   for g, w in zip(params_of(got[0]), params_of(want[0])))
        print(f"\n{label}: max |difference| of the parameters {diff:g}")
        assert diff == 0.0, label


@pytest.mark.slow
def test_a_late_worker_is_dropped_and_the_replicas_stay_identical(job, warnings):
    """Worker 2 sleeps 3 s at iteration 4; the others go on without its gradient after 1 s."""
    stats = str(job["folder"] / "drop.jsonl")
    net = slowed(fc_net(job["data"], K), rank=2, iters=[4], seconds=3.0)
    solvers = run(job, net, straggler_timeout=1.0, stats=stats)
    drops = [line for line in warnings if "missed the" in line]
    print("\n" + "\n".join(drops))
    assert "server 0: iteration 4: worker 2 (rank 2) missed the 1.0 s deadline; averaged 2 of 3 " \
           "gradients" in drops
    server = records(stats.replace(".jsonl", ".server-0.jsonl"))
    assert [r["iter"] for r in server] == list(range(ITERS))        # every iteration closed
    dropped = {r["iter"]: r["dropped"] for r in server if "dropped" in r}
    late = sum(r.get("late_pushes", 0) for r in server)
    print(f"iterations with a gradient left out: {sorted(dropped)}; late pushes dropped: {late}")
    assert dropped[4]["2"] == server[4]["pairs"]                    # worker 2, every pair
    assert late >= server[4]["pairs"]            # its iteration-4 pushes came, and were dropped
    for rank in range(P1):                       # every worker finished every iteration
        mine = records(stats.replace(".jsonl", f".worker-{rank}.jsonl"))
        assert [r["iter"] for r in mine] == list(range(ITERS))
        assert mine[4]["averaged"] == 2
    final = [params_of(s) for s in solvers]
    for rank in range(1, P1):
        for g, w in zip(final[rank], final[0]):
            assert numpy.array_equal(g, w), f"worker {rank}'s replica differs from worker 0's"
    print(f"relative distance to BSP on the combined batch: "
          f"{max_relative_error(final[0], job['want']):.3g}")


@pytest.mark.slow
def test_a_late_worker_process_is_dropped_and_the_replicas_stay_identical(job, tmp_path):
    """The case above as `poseidon train` processes, shorter (worker 2 sleeps 1.8 s at iteration
    4, the deadline is 1 s): the server leaves its gradient out there, every iteration closes,
    and every replica is bitwise worker 0's (by the digests in the cursor files)."""
    stats = str(tmp_path / "drop.jsonl")
    net = slowed(fc_net(job["data"], K), rank=2, iters=[4], seconds=1.8)
    run_processes(solver_param(net, max_iter=ITERS), P1, 1, tmp_path, weights=job["weights"],
                  straggler_timeout=1.0, stats=stats)
    server = records(stats.replace(".jsonl", ".server-0.jsonl"))
    assert [r["iter"] for r in server] == list(range(ITERS))
    dropped = {r["iter"]: r["dropped"] for r in server if "dropped" in r}
    assert dropped[4]["2"] == server[4]["pairs"]                    # worker 2, every pair
    mine = records(stats.replace(".jsonl", ".worker-2.jsonl"))
    assert [r["iter"] for r in mine] == list(range(ITERS)) and mine[4]["averaged"] == 2


@pytest.mark.slow
def test_bounded_staleness_with_a_slow_worker(job):
    """--staleness 2, worker 2 sleeping 0.3 s at iterations 2..9: nobody runs more than 2
    iterations ahead of it, training still reduces the loss and ends near BSP."""
    stats = str(job["folder"] / "ssp.jsonl")
    net = slowed(fc_net(job["data"], K), rank=2, iters=range(2, 10), seconds=0.3)
    solvers = run(job, net, staleness=2, stats=stats)
    server = records(stats.replace(".jsonl", ".server-0.jsonl"))
    assert [r["iter"] for r in server] == list(range(ITERS))
    leads = [r.get("max_lead", 0) for r in server]
    held = sum(r.get("held_replies", 0) for r in server)
    workers = [records(stats.replace(".jsonl", f".worker-{r}.jsonl")) for r in range(P1)]
    worker_leads = [max(r["lead"] for r in recs) for recs in workers]
    print(f"\nlargest lead over the slowest worker per iteration: {leads}")
    print(f"replies held back: {held}; largest lead each worker saw: {worker_leads}")
    assert max(leads) <= 2 and max(worker_leads) <= 2
    assert max(leads) >= 1 and held > 0          # the bound was actually reached and enforced
    final = params_of(solvers[0])
    start = train_loss(job, _initial(job))
    end, bsp_end = train_loss(job, final), train_loss(job, job["want"])
    distance = max_relative_error(final, job["want"])
    print(f"training-set loss: {start:.4f} at the start, {end:.4f} after SSP, {bsp_end:.4f} "
          f"after BSP; relative distance of the parameters to BSP {distance:.3g}")
    assert end < start - 0.5 * (start - bsp_end)     # at least half of BSP's progress
    assert distance < 0.5


def _initial(job):
    solver = get_solver(solver_param(fc_net(job["data"], P1 * K)), dtype=numpy.float64)
    solver.net.copy_from(job["weights"])
    params = params_of(solver)
    solver.net.shutdown()
    return params
