"""Part h of `poseidon bench`: the synchronisation schemes side by side across emulated hosts, with
PyTorch DDP (gloo) beside them on the same links and nets.

Layout: `hosts` network namespaces (tools/netns) on one bridge, each link capped both ways by tbf;
worker i and server i share host i (every node both a worker and a server, as the paper's cost
model has it), so a node's own KV shard never crosses its link. One thread a process. Per net,
one job per mode, the order of the modes rotated every round:

    ps, sfb, allreduce      one scheme for every layer it applies to (PS elsewhere)
    paper hybrid            Algorithm 1 as published: BestScheme over PS and SFB on the static
                            float count, sends in FIFO order
    hybrid                  BestScheme over every registered scheme on measured link costs, lower
                            layers first on the wire
    ddp                     torch DistributedDataParallel over gloo (tools/bench/ddp_ref.py)

Then the slow-host case, on `slow_nets`: every rank on a host of its own (workers and servers
apart), the last server's host capped at `slow` (the others at `bandwidth`); the hybrid with the
static cost model against the measured one. A slow server host is what a static count cannot see:
the KV pairs it holds cross its link from every worker, while a scheme without servers (the ring,
SFB) never touches it; colocated, a slow host slows every scheme alike.

A row's iteration time: the median over rounds of each job's median iteration (worker 0's --stats
records, or DDP rank 0's own timings; the first iteration left out as warm-up).
"""
import json
import time
from pathlib import Path

import numpy

from poseidon.dist.transport.bandwidth import parse_bandwidth

from . import dist_parts, nets
from .env import stats
from .hosts_part import why_no_hosts

HOSTS = 4
SKIP = 1
JOB_TIMEOUT_S = 420
# net key -> (builder with the benchmark's batch a worker, measured iterations a job)
# (vgg_block, a conv block alone, is compute-bound here: its row measures the convolutions)
NETS = {"fc_heavy": (lambda: nets.fc_heavy(32), 3), "vgg_mini": (lambda: nets.vgg_mini(8), 3),
        "vgg_block": (lambda: nets.vgg_block(8), 3)}
HYBRID = ["--sync", "hybrid", "--cost-model", "measured", "--priority", "on"]
MODES = (("ps", ["--sync", "ps", "--priority", "off"]),
         ("sfb", ["--sync", "sfb", "--priority", "off"]),
         ("allreduce", ["--sync", "allreduce", "--priority", "off"]),
         ("paper hybrid", ["--sync", "ps+sfb", "--cost-model", "static", "--priority", "off"]),
         ("hybrid", HYBRID))
SINGLE = ("ps", "sfb", "allreduce", "paper hybrid")     # what the hybrid is compared against
SLOW_MODES = (("hybrid static", ["--sync", "hybrid", "--cost-model", "static", "--priority", "on"]),
              ("hybrid measured", HYBRID))
DDP_PORT = 29511


def _tiny():
    return dict(net_keys=("fc_heavy",), slow_nets=(), hosts=2, iterations=1, runs=1, with_ddp=False,
                modes=MODES[-1:], slow=None, builders={"fc_heavy": lambda: nets.fc_heavy(4)})


def schemes_across_hosts(workdir, bandwidth="1Gbit", slow="100Mbit", runs=1,
                         net_keys=("fc_heavy", "vgg_mini"), slow_nets=("vgg_mini",),
                         hosts=HOSTS, iterations=None,
                         modes=MODES, with_ddp=True, builders=None, tiny=False, log=None):
    if tiny:
        return schemes_across_hosts(workdir, bandwidth, log=log, **_tiny())
    reason = why_no_hosts()
    if reason:
        return dist_parts.not_measured(reason)
    from poseidon.tools import netns
    builders = builders or {k: v[0] for k, v in NETS.items()}
    unknown = [k for k in tuple(net_keys) + tuple(slow_nets if slow else ()) if k not in builders]
    if unknown:
        return dist_parts.not_measured(f"unknown net(s) {', '.join(unknown)} for part h "
                                       f"(known: {', '.join(builders)})")
    try:
        rates = {"link": parse_bandwidth(bandwidth), "slow": parse_bandwidth(slow) if slow else None}
    except ValueError as e:
        return dist_parts.not_measured(f"--bandwidth: {e}")
    ddp_reason = _ddp_unavailable() if with_ddp else "not asked for"
    folder = Path(workdir) / "schemes"
    rows = []
    with netns.sigterm_as_exit():
        for key in dict.fromkeys(tuple(net_keys) + tuple(slow_nets if slow else ())):
            bench_net = builders[key]()
            total = (iterations or NETS.get(key, (None, 3))[1]) + SKIP + 1
            where = folder / bench_net.key
            solver = nets.write_solver_files(bench_net, where, total)
            if key in net_keys:
                caps = [rates["link"]] * hosts
                jobs = _rounds(where / "even", solver, bench_net, hosts, caps, modes, runs, total,
                               ddp_reason is None, log, key)
                rows += [_row(key, mode, bandwidth, None, jobs[mode]) for mode in jobs]
            if rates["slow"] and key in slow_nets:
                caps = [rates["link"]] * (2 * hosts - 1) + [rates["slow"]]
                jobs = _rounds(where / "slow", solver, bench_net, hosts, caps, SLOW_MODES, runs,
                               total, False, log, f"{key}, server {hosts - 1}'s host at {slow}",
                               colocate=False)
                rows += [_row(key, mode, bandwidth, slow, jobs[mode]) for mode in jobs]
    return _summary(rows, bandwidth, slow, hosts, runs, ddp_reason)


def _ddp_unavailable():
    try:
        import torch.distributed as dist
        return None if dist.is_available() and dist.is_gloo_available() else \
            "torch.distributed without gloo"
    except Exception as e:
        return f"torch is not importable ({type(e).__name__}); pip install torch for the DDP row"


def _rounds(folder, solver, bench_net, hosts, caps, modes, runs, total, with_ddp, log, label,
            colocate=True):
    """{mode: [job result per round]} with the mode order rotated every round."""
    order = list(modes) + ([("ddp", None)] if with_ddp else [])
    jobs = {mode: [] for mode, _ in order}
    for r in range(max(1, int(runs))):
        for mode, flags in order[r % len(order):] + order[:r % len(order)]:
            run = folder / f"{mode.replace(' ', '_')}-{r}"
            if flags is None:
                result = _ddp_job(run, bench_net, hosts, caps, total)
            else:
                result = _poseidon_job(run, solver, hosts, caps, flags, colocate)
            jobs[mode].append(result)
            if log:
                log(f"  {label}, {mode}: {_text(result)}")
    return jobs


def _network(hosts, caps):
    from poseidon.tools import netns
    network = netns.Network(hosts)
    for host, rate in zip(network.hosts, caps):
        network.cap(host, netns.tbf_rate(rate), burst=f"{max(int(rate * 0.01), 64 * 1024)}b",
                    latency="200ms")
    return network


def _poseidon_job(folder, solver, hosts, caps, flags, colocate=True):
    from poseidon.tools.netns.ranks import HostJob
    job = HostJob(folder, solver, hosts, hosts, threads=1, colocate=colocate,
                  flags=list(flags) + ["--ipc", "off", "--stats", "stats.jsonl"])
    t0 = time.perf_counter()
    with _network(job.hosts, caps) as network:
        failure = job.finish(job.start(network), JOB_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    if failure:
        return {"error": failure.splitlines()[0] + " " + failure[-300:], "seconds": seconds}
    records = job.stats("worker", 0)
    return {"iteration_s": dist_parts.iteration_times(records, SKIP), "seconds": seconds,
            "bytes_sent": [r.get("sent_payload", 0) + r.get("sent_header", 0)
                           for r in records[SKIP:]],
            "schemes": {name: layer.get("scheme") for name, layer in
                        records[-1].get("layers", {}).items()} if records else None}


def _ddp_job(folder, bench_net, hosts, caps, total):
    from poseidon.tools.netns.ranks import environment
    import sys
    folder = Path(folder)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    out = folder / "ddp.json"
    t0 = time.perf_counter()
    with _network(hosts, caps) as network:
        master = f"{network.hosts[0].address}:{DDP_PORT}"
        procs = [network.spawn(host, [sys.executable, "-m", "poseidon.tools.bench.ddp_ref",
                                      "--rank", r, "--world", hosts, "--master", master,
                                      "--net", bench_net.key, "--batch", bench_net.batch,
                                      "--iterations", total, "--threads", 1,
                                      "--interface", "eth0", "--out", out],
                               folder / "logs" / f"rank-{r}.log", env=environment(threads=1))
                 for r, host in enumerate(network.hosts)]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except Exception:
                codes.append(None)
    seconds = time.perf_counter() - t0
    if any(c != 0 for c in codes) or not out.exists():
        log = (folder / "logs" / "rank-0.log").read_text(errors="replace")[-300:]
        return {"error": f"DDP ranks ended with {codes}: {log}", "seconds": seconds}
    timings = json.loads(out.read_text())
    return {"iteration_s": timings["iteration_s"][SKIP:], "seconds": seconds,
            "torch": timings.get("torch")}


def _text(result):
    if result.get("error"):
        return f"failed ({result['error'][:160]})"
    it = result["iteration_s"]
    return f"{numpy.median(it):.3f} s an iteration" if it else "no iterations"


def _row(net, mode, bandwidth, slow, jobs):
    row = {"net": net, "mode": mode, "bandwidth": bandwidth, "slow_host": slow,
           "job_seconds": [j["seconds"] for j in jobs]}
    errors = [j["error"] for j in jobs if j.get("error")]
    per_round = [float(numpy.median(j["iteration_s"])) for j in jobs
                 if not j.get("error") and j["iteration_s"]]
    if errors or not per_round:
        row.update(status="failed", reason=errors[0] if errors else "no iterations measured")
        return row
    sent = [b for j in jobs for b in j.get("bytes_sent", [])]
    row.update(status="measured", iteration_s=stats(per_round), iteration_s_by_round=per_round,
               bytes_sent_per_iter=float(numpy.median(sent)) if sent else None,
               schemes=jobs[-1].get("schemes"))
    return row


def _summary(rows, bandwidth, slow, hosts, runs, ddp_reason):
    by = {(r["net"], r["mode"], r["slow_host"]): r for r in rows}
    verdicts = {}
    for net in sorted({r["net"] for r in rows}):
        def median(mode, where=None):
            row = by.get((net, mode, where))
            return row["iteration_s"]["median"] if row and row["status"] == "measured" else None
        hybrid, ddp = median("hybrid"), median("ddp")
        singles = {m: median(m) for m in SINGLE if median(m) is not None}
        v = verdicts[net] = {}
        if hybrid and singles:
            best = min(singles, key=singles.get)
            low = by[(net, "hybrid", None)]["iteration_s"]["min"]
            v["hybrid_over_best_single"] = hybrid / singles[best]
            v["best_single"] = best
            v["hybrid_within_spread_or_faster"] = low <= by[(net, best, None)]["iteration_s"]["max"]
        if hybrid and ddp:
            v["throughput_over_ddp"] = ddp / hybrid
        static, measured = median("hybrid static", slow), median("hybrid measured", slow)
        if static and measured:
            v["slow_host_measured_over_static"] = measured / static
            v["slow_host_choices"] = {m: by[(net, m, slow)].get("schemes")
                                      for m in ("hybrid static", "hybrid measured")}
    failed = [f"{r['net']} {r['mode']}: {r['reason']}" for r in rows if r["status"] != "measured"]
    return {"status": "measured" if len(failed) < len(rows) else "failed",
            **({"reason": failed[0]} if failed else {}),
            "bandwidth": bandwidth, "slow_host": slow, "hosts": hosts, "rounds": max(1, int(runs)),
            "ddp": "measured" if ddp_reason is None else f"not measured: {ddp_reason}",
            "rows": rows, "verdicts": verdicts,
            "note": f"{hosts} hosts in network namespaces, each link capped both ways by tbf at "
                    f"{bandwidth}; worker i and server i on host i; `poseidon train` over TCP "
                    f"with CURVE (--ipc off), one thread a process; DDP: torch "
                    f"DistributedDataParallel over gloo, one thread a rank, same net and batch; "
                    f"{max(1, int(runs))} round(s) of one job per mode, the order rotated; "
                    f"iteration time = median over rounds of each job's median iteration, the "
                    f"first left out. Slow host: every rank on a host of its own, server "
                    f"{hosts - 1}'s link at {slow}, the other links at {bandwidth}"}
