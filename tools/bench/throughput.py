"""a. Training throughput (images/s): the engine (engine.solvers, forward + backward + update)
beside PyTorch on the same architecture, batch and threads, interleaved run by run.

Each net: warm-up, then the iteration count per run is chosen so one run lasts about `run_s`
seconds (from one timed step), then `runs` rounds of [engine run, torch run] (the order alternates
every round, so neither side always runs right after the other). Each run gives batch*iterations /
seconds; the figure is the median of the runs with their min and max.
"""
import time

import numpy

from . import nets
from .env import stats


def _sync(xp):
    if xp is not numpy:
        xp.cuda.Stream.null.synchronize()


class EngineRunner:
    def __init__(self, bench_net, xp=None):
        self.solver = nets.make_solver(bench_net, xp=xp)
        self.xp = self.solver.net.xp

    def timed(self, iterations):
        _sync(self.xp)
        t = time.perf_counter()
        self.solver.step(iterations)
        _sync(self.xp)
        return time.perf_counter() - t


def _iterations_for(seconds_per_step, run_s, minimum=2):
    return max(minimum, int(round(run_s / max(seconds_per_step, 1e-6))))


def measure(bench_nets, threads, runs=5, run_s=2.0, torch_device="cpu", xp=None, log=print,
            with_torch=True, tf32=False):
    from . import torch_ref
    torch_ok, torch_reason = torch_ref.available() if with_torch else (False, "--no-torch")
    results = {}
    for bn in bench_nets:
        data, label = nets.synthetic_batch(bn)
        row = {"net": bn.title, "batch": bn.batch, "threads": threads}
        # the engine runs its own threads (POSEIDON_THREADS, set by the command)
        engine = EngineRunner(bn, xp=xp)
        engine.timed(2)                                      # warm-up: buffers, caches
        step_s = engine.timed(1)
        tnet = None
        if torch_ok:
            tnet = torch_ref.TorchNet(bn, threads, device=torch_device, tf32=tf32)
            tnet.set_batch(data, label)
            tnet.timed(2)
            torch_step_s = tnet.timed(1)
        e_iters = _iterations_for(step_s, run_s)
        t_iters = _iterations_for(torch_step_s, run_s) if tnet else 0
        e_rates, t_rates = [], []
        for r in range(runs):
            order = ("engine", "torch") if r % 2 == 0 else ("torch", "engine")
            for side in order:
                if side == "engine":
                    e_rates.append(bn.batch * e_iters / engine.timed(e_iters))
                elif tnet is not None:
                    t_rates.append(bn.batch * t_iters / tnet.timed(t_iters))
        row["engine"] = dict(stats(e_rates), iterations_per_run=e_iters)
        if tnet is not None:
            row["torch"] = dict(stats(t_rates), iterations_per_run=t_iters)
            row["ratio"] = row["engine"]["median"] / row["torch"]["median"]
        else:
            row["torch"] = None
            row["ratio"] = None
            row["torch_note"] = torch_reason
        log(f"  {bn.key}: engine {row['engine']['median']:.0f} img/s"
            + (f", torch {row['torch']['median']:.0f} img/s, ratio {row['ratio']:.2f}"
               if tnet is not None else f" (no torch: {torch_reason})"))
        results[bn.key] = row
        del engine, tnet
    return results
