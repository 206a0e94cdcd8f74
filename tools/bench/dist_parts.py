"""The distributed parts of the bench, through the real launcher (`poseidon train --workers P1
--servers P2`, child processes on loopback) and the stats/timeline files it writes:

  c. single_node_overhead: 1 worker + 1 server through the distributed path vs the plain engine;
  d. transport: KV-store push + pull of a 64 MB parameter set vs raw ZeroMQ on the same loopback,
     with CURVE on both sides (the default between hosts) and without (`--insecure`, plain
     ZeroMQ), both over TCP (`--ipc off`); and over Unix sockets (the default on one host);
  e. scaling: 2 and 4 workers on fc_heavy and cifar10_quick under `--bandwidth` (default 1Gbit),
     for `--no-overlap --sync ps`, `--sync ps` (WFBP) and `--sync hybrid` (WFBP + HybComm).

Each part first checks that `dist` is importable and has the options it needs (`status()`); when it
has not, the part is reported as not measured with the reason, never estimated. The nets here are
fed from Input layers that nobody fills (zeros): compute and message sizes do not depend on values.
Reading a job's stats and timeline is job_records.py's; part d's raw ZeroMQ side, zmq_baseline.py's.
"""
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Optional

import numpy

from poseidon.dist.job.spawn import module_command

from . import nets
from .env import cpu_count, median_interval, stats
from .job_records import hidden_share, iteration_times
from .zmq_baseline import raw_zmq

NEEDED_OPTIONS = ("workers", "servers", "sync", "no_overlap", "stats", "timeline", "bandwidth",
                  "kv_pair_bytes", "ipc")


def status():
    """(True, None) when dist can run the jobs these parts need, else (False, reason)."""
    try:
        from poseidon import dist  # noqa: F401
        from poseidon.dist.job.options import DistOptions
        import poseidon.dist.job.launch  # noqa: F401
    except Exception as e:
        return False, f"the distributed package is not importable ({type(e).__name__}: {e})"
    missing = [o for o in NEEDED_OPTIONS if o not in DistOptions.FIELDS]
    if missing:
        return False, f"dist has no option(s) {', '.join(missing)} yet"
    return True, None


def not_measured(reason):
    return {"status": "not measured", "reason": reason}


# ----- running one job ----------------------------------------------------------------------------
def run_job(solver_path, workers, servers, folder, extra=(), timeout=300, threads=None):
    """Run `poseidon train` with the distributed flags; returns (worker-0 stats records, timeline
    dict or None, seconds, error text or None)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    solver_path = Path(solver_path).resolve()
    stats_path = folder / "stats.jsonl"
    timeline_path = folder / "timeline.json"
    cmd = module_command("poseidon.tools.cli", "train", "--solver", solver_path,
                         "--no-progress", "--workers", workers, "--servers", servers,
                         "--stats", stats_path, "--timeline", timeline_path, *extra)
    env = dict(os.environ)
    if threads:   # BLAS's threads and the engine's own (engine/parallel.py)
        env["OPENBLAS_NUM_THREADS"] = str(threads)
        env["OMP_NUM_THREADS"] = str(threads)
        env["POSEIDON_THREADS"] = str(threads)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=str(folder), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout, text=True)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return [], None, time.perf_counter() - t0, f"timed out after {timeout} s: {out[-800:]}"
    seconds = time.perf_counter() - t0
    (folder / "output.log").write_text(proc.stdout or "")
    if proc.returncode != 0:
        return [], None, seconds, f"exit status {proc.returncode}: {(proc.stdout or '')[-800:]}"
    worker0 = folder / "stats.worker-0.jsonl"
    records = []
    if worker0.exists():
        records = [json.loads(line) for line in worker0.read_text().splitlines() if line.strip()]
    timeline = None
    if timeline_path.exists():
        try:
            timeline = json.loads(timeline_path.read_text())
        except ValueError:
            timeline = None
    return records, timeline, seconds, None


# ----- c. single-node overhead ---------------------------------------------------------------------
class OverheadVariant(NamedTuple):
    """One of part c's figures besides the default. The default on one host (--bucket-bytes
    auto) holds all of cifar10_quick's 0.58 MB of parameters in one bucket: one sync an
    iteration."""
    key: str                 # results key suffix: single_node_overhead_<key>
    flag: str                # the flag as users give it
    options: dict            # DistOptions for both processes
    note: str                # what it does, for the report
    threads: Optional[int]   # compute threads of both sides (None: the machine's)


def overhead_variants(quick=False):
    """The option sets part c measures after the default one (none in --quick)."""
    if quick:
        return []
    variants = [OverheadVariant(
        "ipc_links", "--ipc links", {"ipc": "links"},
        "the KV arrays on the direct links instead of the server's shared memory: the worker's "
        "parameters and gradients copied through a socket each way, "
        "dist/transport/onehost/kvshm.py", None),
        OverheadVariant(
        "ipc_zmq", "--ipc zmq", {"ipc": "zmq"},
        "every message through ZeroMQ: no direct links for the KV pushes and their answers, "
        "dist/transport/onehost/directlink.py", None)]
    variants.append(OverheadVariant(
        "layers_alone", "--bucket-bytes 0", {"bucket_bytes": 0},
        "each layer synced alone right after its backward: the paper's WFBP, the default across "
        "hosts; on one host `auto` puts layers of up to 1 MB in all into one sync, "
        "dist/coord/book.sync_groups", None))
    if cpu_count() > 1:
        variants.append(OverheadVariant(
            "one_thread", "POSEIDON_THREADS=1", {},
            "both sides train on one thread (BLAS too), so a core is left to the sync path and "
            "the server, as on a machine with cores to spare: what the round trip costs when it "
            "takes no core from training", 1))
    return variants


# Rounds of part c, whatever --runs (its figure is a median over rounds, not over runs). One
# round's ratio moves by far more than the 1% goal on a shared machine, and the median's interval
# narrows only with the square root of the rounds: this many bring it to about the goal's size
# while a round stays a fraction of a second (docs/performance.md, "The parts").
ROUNDS = 96
# The variants beside it (overhead_variants) are shown, not judged: a third of the rounds each, a
# wider interval, keeps the whole bench within the quarter of an hour its docs promise.
VARIANT_ROUNDS = 32


def single_node_overhead(workdir, quick=False, threads=None, block=2, warmup=3, options=None,
                         rounds=ROUNDS):
    """The plain engine and 1 worker + 1 server (`--sync ps`) on the same solver file, in one
    child process taking turns in blocks of `block` iterations (tools/bench/overhead_ab.py), the
    order swapped every round, `rounds` rounds (4 with `quick`). Per round the ratio of the two
    blocks' medians; the overhead is the median of those ratios."""
    ok, reason = status()
    if not ok:
        return not_measured(reason)
    net = nets.cifar10_quick(20 if quick else 100)
    rounds = 4 if quick else rounds
    folder = Path(workdir) / "overhead"
    solver_path = nets.write_solver_files(net, folder, 10 ** 6)
    env = dict(os.environ)
    if threads:
        env.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                   POSEIDON_THREADS=str(threads))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(module_command("poseidon.tools.bench.overhead_ab", solver_path,
                                             rounds, block, warmup, json.dumps(options or {})),
                              cwd=str(folder), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=600,
                              text=True)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": "the overhead measurement timed out after 600 s"}
    if proc.returncode != 0:
        return {"status": "failed", "reason": f"exit status {proc.returncode}: "
                                              f"{proc.stderr[-800:]}"}
    blocks = json.loads(proc.stdout.strip().splitlines()[-1])
    plain = [float(numpy.median(b)) for b in blocks["plain"]]
    dist_ = [float(numpy.median(b)) for b in blocks["distributed"]]
    ratios = [d / p - 1.0 for p, d in zip(plain, dist_)]
    return {"status": "measured", "net": net.title, "rounds": len(ratios),
            "where_it_goes": _overhead_parts(blocks),
            "iterations_per_block": block,
            "plain_engine_s": stats(plain), "distributed_s": stats(dist_),
            "overhead": float(numpy.median(ratios)), "overhead_rounds": stats(ratios),
            "overhead_interval95": median_interval(ratios),
            "job_seconds": time.perf_counter() - t0,
            "note": f"The plain engine's solver.step vs the same solver file as worker 0 of "
                    f"`--workers 1 --servers 1 --sync ps` (KV server in its own process, reached "
                    f"as processes on one host are by default: a Unix socket, the KV arrays "
                    f"in the server's shared memory), in one "
                    f"child process taking turns in blocks of {block} iterations after "
                    f"{warmup} warm-up ones each, the order swapped every round "
                    f"(tools/bench/overhead_ab.py); overhead = median over {len(ratios)} rounds "
                    f"of the round's ratio of block medians. An A/A run of the same method (two "
                    f"plain solvers) gave -0.2% with an interquartile range of +-12% per round at "
                    f"load 6 on this machine: read it with the load average"}


def _overhead_parts(blocks):
    """In ms per iteration: the medians of this process's CPU on each side and of the
    distributed side's exposed sync (from the end of backward until every sync is done: at
    least the last layer's round trip); the mean of the server process's CPU (None without
    /proc; where the kernel keeps no schedstat, a block's figure comes in whole clock ticks, 0
    or 10 ms, and only the mean says how much); and the mean CPU per iteration of each thread
    (label) of this process on each side and of the server ({} without /proc)."""
    def ms(values, how=numpy.median):
        values = [v for v in values if v is not None]
        return round(float(how(values)) * 1e3, 2) if values else None
    threads = {side: {label: round(seconds * 1e3, 2) for label, seconds in per.items()}
               for side, per in (blocks.get("threads") or {}).items()}
    return {"worker_cpu_plain_ms": ms(blocks.get("cpu", {}).get("plain", [])),
            "worker_cpu_distributed_ms": ms(blocks.get("cpu", {}).get("distributed", [])),
            "server_cpu_ms": ms(blocks.get("server_cpu", []), numpy.mean),
            "exposed_sync_ms": ms(blocks.get("exposed_s", [])),
            "threads_cpu_ms": threads}


# ----- d. transport ---------------------------------------------------------------------------------
KV_NET = """
name: "kv_64mb"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 1 dim: {n} }} }} }}
layer {{ name: "label" type: "Input" top: "label" input_param {{ shape {{ dim: 1 }} }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
  inner_product_param {{ num_output: {m} bias_term: false weight_filler {{ type: "constant" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }}
"""


# The sides of part d, rotated every round: (name, KV job flags or None for raw, security), the
# security being "curve" or "plain" over TCP, or "ipc" (Unix sockets). kv_shared is the KV job
# as one host runs it by default (the arrays in the server's shared memory,
# dist/transport/onehost/kvshm.py): no socket carries its bytes, so it is shown beside raw ZeroMQ
# on a Unix socket, not as a like.
TRANSPORT_SIDES = (("kv", ["--sync", "ps", "--ipc", "off"], "curve"),
                   ("raw_curve", None, "curve"),
                   ("kv_insecure", ["--sync", "ps", "--insecure", "--ipc", "off"], "plain"),
                   ("raw", None, "plain"),
                   ("kv_ipc", ["--sync", "ps", "--ipc", "links"], "ipc"),
                   ("raw_ipc", None, "ipc"),
                   ("kv_shared", ["--sync", "ps"], "ipc"))


def transport(workdir, quick=False, runs=5, megabytes=64, threads=None):
    """Like for like, three times: over TCP (`--ipc off`, as between hosts) the KV job with CURVE
    (the default there) against raw ZeroMQ with CURVE, and the KV job with --insecure against
    plain raw ZeroMQ; and the KV job over Unix sockets (`--ipc links`) against raw ZeroMQ on a
    Unix socket, with the KV job as one host runs it by default (shared memory) beside them.
    Rounds of the seven sides, the order rotated every round; per round the KV rate
    is the median over the job's iterations after the warm-up, a raw rate the median of its
    round trips, and the round's ratios KV / raw of the same security. The figures are medians
    over rounds; the target is the CURVE ratio (both sides over TCP loopback, encrypted)."""
    ok, reason = status()
    if not ok:
        return not_measured(reason)
    from poseidon.dist.coord.placement import DEFAULT_PAIR_BYTES
    if quick:
        megabytes = 4
    bench_net, total = _kv_net(megabytes)
    skip = 1 if quick else 2
    measured = 2 if quick else 5
    rounds = 1 if quick else max(1, min(int(runs), 3))
    folder = Path(workdir) / "transport"
    solver_path = nets.write_solver_files(bench_net, folder, skip + measured)
    got = {name: [] for name, _, _ in TRANSPORT_SIDES}
    one_rounds, payload = [], None
    for r in range(rounds):
        k = r % len(TRANSPORT_SIDES)
        for name, flags, security in TRANSPORT_SIDES[k:] + TRANSPORT_SIDES[:k]:
            if flags is None:
                got[name].append(raw_zmq(total, DEFAULT_PAIR_BYTES, runs=measured,
                                         curve=security == "curve",
                                         ipc=security == "ipc")["median"])
                if security == "plain":
                    one_rounds.append(raw_zmq(total, total, runs=2 if quick else 3)["median"])
                continue
            records, _, seconds, error = run_job(solver_path, 1, 1, folder / f"{name}-{r}",
                                                 extra=flags, threads=threads)
            if error:
                return {"status": "failed", "reason": f"{name}: {error}"}
            rates, payload = _kv_rates(records, skip)
            if not rates:
                return {"status": "failed",
                        "reason": f"{name}: the job wrote no sync stats for the parameter"}
            got[name].append(float(numpy.median(rates)))
    return _transport_figures(got, one_rounds, payload, total, DEFAULT_PAIR_BYTES, rounds)


def _kv_net(megabytes):
    """Part d's net: one square float32 parameter of about `megabytes`, fed zeros; returns the
    BenchNet and the parameter's bytes."""
    from poseidon.engine import prototxt
    side = int((megabytes * 2 ** 20 // 4) ** 0.5)            # a side x side float32 weight
    param = prototxt.parse_net_text(KV_NET.format(n=side, m=side))
    bench_net = nets.BenchNet("kv", f"one {side}x{side} float32 parameter", param, 1,
                              {"base_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}, {}, side)
    return bench_net, side * side * 4


def _kv_rates(records, skip):
    """A KV job's push + pull rates, one per iteration after the warm-up: (sent + received
    payload) / the parameter's sync time, from worker 0's stats; and the payload of one sync
    (None when no record has the parameter's sync)."""
    rates, payload = [], None
    for rec in records[skip:]:
        layer = rec["layers"].get("fc")
        if layer and layer["sync_s"]:
            payload = layer["sent_payload"] + layer["recv_payload"]
            rates.append(payload / layer["sync_s"])
    return rates, payload


def _transport_figures(got, one_rounds, payload, total, pair_bytes, rounds):
    """Part d's result from each side's rate per round: the rates' stats and the per-round
    KV / raw ratios of each security."""
    ratios = [kv / raw for kv, raw in zip(got["kv"], got["raw_curve"])]
    ratios_plain = [kv / raw for kv, raw in zip(got["kv_insecure"], got["raw"])]
    ratios_ipc = [kv / raw for kv, raw in zip(got["kv_ipc"], got["raw_ipc"])]
    ratios_shared = [kv / raw for kv, raw in zip(got["kv_shared"], got["raw_ipc"])]
    return {"status": "measured", "parameter_bytes": total, "kv_pair_bytes": pair_bytes,
            "rounds": rounds,
            "kv_push_pull_Bps": stats(got["kv"]),
            "raw_zmq_curve_frames_Bps": stats(got["raw_curve"]),
            "kv_push_pull_insecure_Bps": stats(got["kv_insecure"]),
            "raw_zmq_frames_Bps": stats(got["raw"]),
            "raw_zmq_one_frame_Bps": stats(one_rounds),
            "ratio": float(numpy.median(ratios)), "ratio_rounds": stats(ratios),
            "ratio_insecure": float(numpy.median(ratios_plain)),
            "ratio_insecure_rounds": stats(ratios_plain),
            "kv_push_pull_ipc_Bps": stats(got["kv_ipc"]),
            "raw_zmq_ipc_frames_Bps": stats(got["raw_ipc"]),
            "ratio_ipc": float(numpy.median(ratios_ipc)), "ratio_ipc_rounds": stats(ratios_ipc),
            "kv_push_pull_shared_Bps": stats(got["kv_shared"]),
            "ratio_shared": float(numpy.median(ratios_shared)),
            "ratio_shared_rounds": stats(ratios_shared),
            "compared": "ratio: KV with CURVE over TCP (the default between hosts) / raw ZeroMQ "
                        "with CURVE; ratio_insecure: KV with --insecure over TCP / plain raw "
                        "ZeroMQ; ratio_ipc: KV over Unix sockets (--ipc links) / raw ZeroMQ on "
                        "a Unix socket; ratio_shared: KV in shared memory (the default on one "
                        "host) / the same raw ZeroMQ",
            "payload_per_sync": payload,
            "note": "KV: 1 worker + 1 server, --sync ps, over TCP (--ipc off) once with CURVE "
                    "(the default between hosts) and once with --insecure; over Unix sockets "
                    "(--ipc links, no CURVE); and as one host runs it by default (the arrays in "
                    "the server's shared memory, counted as payload); (sent + received payload) "
                    "/ the layer's sync "
                    "time (push, server sum + update, pull), median over the job's iterations. "
                    "Raw: a PAIR socket round trip of the same bytes as frames of the KV pair "
                    "size to an echo thread, each end with its own one-I/O-thread context, over "
                    "TCP with CURVE set up as the job's sockets are (keys, ZAP handler), over "
                    "plain TCP, and over a Unix socket. Rounds of the seven, the order rotated; a "
                    "ratio = median over rounds of the round's KV / raw of the same security"}


# ----- e. scaling under a bandwidth cap ---------------------------------------------------------------
MODES = (("no-overlap ps", ["--no-overlap", "--sync", "ps"]),
         ("wfbp ps", ["--sync", "ps"]),
         ("hybrid", ["--sync", "hybrid"]))


# net key -> (builder, measured iterations per job, most rounds at TARGET_WORKERS): fc_heavy at 4
# workers carries the target, so it gets the rounds, every other row one; a job's start-up (8
# processes, worker 0's state sent under the cap) is most of a job's time.
SCALING_NETS = {"fc_heavy": (nets.fc_heavy, 3, 3), "cifar10_quick": (nets.cifar10_quick, 6, 1)}
TARGET_WORKERS = 4


def scaling(workdir, quick=False, bandwidth="1Gbit", worker_counts=(2, 4), iterations=None,
            net_keys=("fc_heavy", "cifar10_quick"), runs=3):
    """Per net and worker count, `runs` rounds (at most the net's, SCALING_NETS) of one job per mode,
    the order of the modes rotated every round so that each sees the same disturbances; a job
    measures `iterations` after one warm-up iteration. A row's iteration time is the median over
    rounds of each job's median iteration (min-max over rounds); the hybrid / no-overlap ratio
    is also taken per round (the two jobs of a round ran minutes apart at most)."""
    ok, reason = status()
    if not ok:
        return not_measured(reason)
    if quick:
        return not_measured("skipped in --quick (it starts 18 jobs of up to 8 processes)")
    unknown = [k for k in net_keys if k not in SCALING_NETS]
    if unknown:
        return not_measured(f"unknown net(s) {', '.join(unknown)} for part e (known: "
                            f"{', '.join(SCALING_NETS)})")
    skip = 1
    results, all_rounds = [], {}
    for key in net_keys:
        make, default_iters, most_rounds = SCALING_NETS[key]
        bench_net, iters = make(), iterations or default_iters
        for p1 in worker_counts:
            rounds = all_rounds[f"{key}-{p1}"] = max(1, min(int(runs), most_rounds)) \
                if p1 == TARGET_WORKERS else 1
            folder = Path(workdir) / "scaling" / f"{bench_net.key}-{p1}"
            solver_path = nets.write_solver_files(bench_net, folder, iters + skip + 1)
            jobs = {mode: [] for mode, _ in MODES}
            for r in range(rounds):
                order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                for mode, flags in order:
                    # --ipc off: the processes stand for hosts, so they talk as hosts do
                    extra = flags + ["--ipc", "off"]
                    extra += ["--bandwidth", bandwidth] if bandwidth else []
                    records, timeline, seconds, error = run_job(
                        solver_path, p1, p1, folder / f"{mode.replace(' ', '_')}-{r}",
                        extra=extra, timeout=420, threads=1)
                    jobs[mode].append((records, timeline, seconds, error))
            for mode, _ in MODES:
                results.append(scaling_row(bench_net.key, p1, mode, bandwidth, jobs[mode], skip))
    ratios = per_round_ratios(results)
    rounds = ", ".join(f"{k} {n}" for k, n in all_rounds.items())
    return {"status": "measured", "rows": results, "rounds": all_rounds,
            "hybrid_over_no_overlap": ratios,
            "note": f"P1 workers and P2 = P1 servers on this machine, talking over TCP as "
                    f"separate hosts would (--ipc off), each process capped at "
                    f"{bandwidth} of sends (--bandwidth) and given 1 thread (BLAS and the "
                    f"engine's own: POSEIDON_THREADS=1); rounds of one job per mode ({rounds}), "
                    f"the mode order rotated each round; iteration time = median over rounds of "
                    f"each job's median iteration (worker 0's consecutive stats records, "
                    f"{skip} warm-up iteration left out), min-max over rounds; bytes = worker "
                    f"0's payload + headers; hidden = share of worker 0's sync time inside its "
                    f"backward (timeline)"}


def scaling_row(net, p1, mode, bandwidth, jobs, skip):
    row = {"net": net, "workers": p1, "servers": p1, "mode": mode, "bandwidth": bandwidth,
           "job_seconds": [j[2] for j in jobs]}
    errors = [j[3] for j in jobs if j[3]]
    if errors:
        row.update(status="failed", reason=errors[0])
        return row
    per_round, hidden, waits, sent, recv = [], [], [], [], []
    for records, timeline, _, _ in jobs:
        it_s = iteration_times(records, skip)
        if it_s:
            per_round.append(float(numpy.median(it_s)))
        share = hidden_share(timeline, skip)
        if share:
            hidden += share["runs"]
        waits += [r["barrier_wait_s"] for r in records[skip:]]
        sent += [r.get("sent_payload", 0) + r.get("sent_header", 0) for r in records[skip:]]
        recv += [r.get("recv_payload", 0) + r.get("recv_header", 0) for r in records[skip:]]
    row.update(status="measured" if per_round else "failed",
               iteration_s=stats(per_round) if per_round else None,
               iteration_s_by_round=per_round,
               bytes_sent_per_iter=float(numpy.median(sent)) if sent else None,
               bytes_recv_per_iter=float(numpy.median(recv)) if recv else None,
               hidden_share=stats(hidden) if hidden else None,
               barrier_wait_s=stats(waits) if waits else None)
    if not per_round:
        row["reason"] = "the jobs wrote no per-iteration stats"
    return row


def per_round_ratios(rows):
    """{"<net>-<P1>": stats of hybrid / no-overlap ps per round} where both were measured."""
    out = {}
    by_key = {(r["net"], r["workers"], r["mode"]): r for r in rows}
    for (net, p1, mode), row in by_key.items():
        base = by_key.get((net, p1, "no-overlap ps"))
        if mode != "hybrid" or not base or not row.get("iteration_s") or not base.get("iteration_s"):
            continue
        if len(row["iteration_s_by_round"]) != len(base["iteration_s_by_round"]):
            continue
        pairs = zip(row["iteration_s_by_round"], base["iteration_s_by_round"])
        out[f"{net}-{p1}"] = stats([h / b for h, b in pairs])
    return out


def workdir():
    return tempfile.mkdtemp(prefix="poseidon-bench-")
