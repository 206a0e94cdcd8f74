"""The distributed parts of the bench, through the real launcher (`poseidon train --workers P1
--servers P2`, child processes on loopback) and the stats/timeline files it writes:

  c. single_node_overhead: 1 worker + 1 server through the distributed path vs the plain engine;
  d. transport: KV-store push + pull of a 64 MB parameter set vs raw ZeroMQ on the same loopback;
  e. scaling: 2 and 4 workers on fc_heavy and cifar10_quick under `--bandwidth` (default 1Gbit),
     for `--no-overlap --sync ps`, `--sync ps` (WFBP) and `--sync hybrid` (WFBP + HybComm).

Each part first checks that `dist` is importable and has the options it needs (`status()`); when it
has not, the part is reported as not measured with the reason, never estimated. The nets here are
fed from Input layers that nobody fills (zeros): compute and message sizes do not depend on values.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy

from . import nets
from .env import stats

ROOT = Path(__file__).resolve().parents[2]
NEEDED_OPTIONS = ("workers", "servers", "sync", "no_overlap", "stats", "timeline", "bandwidth",
                  "kv_pair_bytes")


def status():
    """(True, None) when dist can run the jobs these parts need, else (False, reason)."""
    try:
        import dist  # noqa: F401
        from dist.options import DistOptions
        import dist.launch  # noqa: F401
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
    cmd = [sys.executable, "-m", "tools.cli", "train", "--solver", str(solver_path),
           "--no-progress", "--workers", str(workers), "--servers", str(servers),
           "--stats", str(stats_path), "--timeline", str(timeline_path)] + list(extra)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if threads:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
        env["OMP_NUM_THREADS"] = str(threads)
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


def iteration_times(records, skip):
    """Per-iteration wall time of worker 0 from consecutive stats records (after `skip`)."""
    times = [r["time"] for r in records]
    return [b - a for a, b in zip(times[skip:], times[skip + 1:])]


def hidden_share(timeline, skip):
    """Share of worker 0's sync time (union of its layers' sync intervals) that falls inside its
    backward pass, per iteration: 1.0 = all communication hidden under backward."""
    if not timeline:
        return None
    per_iter = {}
    for ev in timeline.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("pid") != 0:
            continue
        it = (ev.get("args") or {}).get("iter")
        if it is None:
            continue
        cat = ev.get("cat", "")
        span = (ev["ts"], ev["ts"] + ev["dur"])
        slot = per_iter.setdefault(it, {"backward": [], "sync": []})
        if cat == "backward":
            slot["backward"].append(span)
        elif cat.startswith("sync"):
            slot["sync"].append(span)
    shares = []
    for it in sorted(per_iter)[skip:]:
        slot = per_iter[it]
        if not slot["sync"] or not slot["backward"]:
            continue
        b0 = min(s for s, _ in slot["backward"])
        b1 = max(e for _, e in slot["backward"])
        union = _union(slot["sync"])
        total = sum(e - s for s, e in union)
        inside = sum(max(0.0, min(e, b1) - max(s, b0)) for s, e in union)
        if total > 0:
            shares.append(inside / total)
    return stats(shares) if shares else None


def _union(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


# ----- c. single-node overhead ---------------------------------------------------------------------
def single_node_overhead(workdir, quick=False, runs=5, threads=None):
    ok, reason = status()
    if not ok:
        return not_measured(reason)
    net = nets.cifar10_quick(20 if quick else 100)
    iters, skip = (4, 1) if quick else (3 + 6 * runs, 3)
    solver_path = nets.write_solver_files(net, Path(workdir) / "overhead", iters)
    # the plain engine, in this process: per-iteration times of solver.step(1)
    solver = nets.make_solver(net)
    solver.step(skip)
    plain = []
    for _ in range(iters - skip):
        t = time.perf_counter()
        solver.step(1)
        plain.append(time.perf_counter() - t)
    del solver
    records, _, seconds, error = run_job(solver_path, 1, 1, Path(workdir) / "overhead" / "job",
                                         extra=["--sync", "ps"], threads=threads)
    if error:
        return {"status": "failed", "reason": error}
    dist_times = iteration_times(records, skip)
    if not dist_times:
        return {"status": "failed", "reason": "the job wrote no per-iteration stats"}
    p, d = stats(plain), stats(dist_times)
    return {"status": "measured", "net": net.title, "iterations": len(dist_times),
            "plain_engine_s": p, "distributed_s": d,
            "overhead": d["median"] / p["median"] - 1.0, "job_seconds": seconds,
            "note": "1 worker + 1 KV server process through `poseidon train --workers 1 "
                    "--servers 1 --sync ps` vs the engine's solver.step in one process; "
                    "iteration time = median of worker 0's consecutive stats records"}


# ----- d. transport ---------------------------------------------------------------------------------
def _echo(ctx, address, rounds, ready):
    import zmq
    sock = ctx.socket(zmq.PAIR)
    sock.bind(address)
    ready.set()
    for _ in range(rounds):
        parts = sock.recv_multipart(copy=False)
        sock.send_multipart(parts, copy=False)
    sock.close(linger=1000)


def raw_zmq(total_bytes, frame_bytes, runs):
    """Round trips of total_bytes as frames of frame_bytes over a PAIR socket on TCP loopback to an
    echo thread (pyzmq releases the GIL while it moves frames, and frames go zero-copy); bytes/s
    counts both directions, as a push + pull does."""
    import threading
    import zmq
    from dist.transport import free_port
    address = f"tcp://127.0.0.1:{free_port()}"
    n = max(1, total_bytes // frame_bytes)
    payload = [numpy.ones(frame_bytes // 4, numpy.float32) for _ in range(n)]
    ctx = zmq.Context()
    ready = threading.Event()
    echo = threading.Thread(target=_echo, args=(ctx, address, runs + 1, ready), daemon=True)
    echo.start()
    ready.wait(30)
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    rates = []
    try:
        for r in range(runs + 1):
            t = time.perf_counter()
            sock.send_multipart(payload, copy=False)
            sock.recv_multipart(copy=False)
            dt = time.perf_counter() - t
            if r:
                rates.append(2 * n * frame_bytes / dt)
    finally:
        sock.close(linger=0)
        echo.join(30)
        ctx.term()
    return stats(rates)


KV_NET = """
name: "kv_64mb"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 1 dim: {n} }} }} }}
layer {{ name: "label" type: "Input" top: "label" input_param {{ shape {{ dim: 1 }} }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
  inner_product_param {{ num_output: {m} bias_term: false weight_filler {{ type: "constant" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }}
"""


def transport(workdir, quick=False, runs=5, megabytes=64, threads=None):
    ok, reason = status()
    if not ok:
        return not_measured(reason)
    from engine import prototxt
    if quick:
        megabytes = 4
    side = int((megabytes * 2 ** 20 // 4) ** 0.5)            # a side x side float32 weight
    param = prototxt.parse_net_text(KV_NET.format(n=side, m=side))
    bench_net = nets.BenchNet("kv", f"one {side}x{side} float32 parameter", param, 1,
                              {"base_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}, {}, side)
    skip = 1 if quick else 2
    iters = skip + (2 if quick else runs)
    solver_path = nets.write_solver_files(bench_net, Path(workdir) / "transport", iters)
    records, _, seconds, error = run_job(solver_path, 1, 1, Path(workdir) / "transport" / "job",
                                         extra=["--sync", "ps"], threads=threads)
    if error:
        return {"status": "failed", "reason": error}
    rates, payload = [], None
    for rec in records[skip:]:
        layer = rec["layers"].get("fc")
        if not layer or not layer["sync_s"]:
            continue
        payload = layer["sent_payload"] + layer["recv_payload"]
        rates.append(payload / layer["sync_s"])
    if not rates:
        return {"status": "failed", "reason": "the job wrote no sync stats for the parameter"}
    from dist.placement import DEFAULT_PAIR_BYTES
    total = side * side * 4
    raw_frames = raw_zmq(total, DEFAULT_PAIR_BYTES, runs=2 if quick else runs)
    raw_one = raw_zmq(total, total, runs=2 if quick else runs)
    kv = stats(rates)
    return {"status": "measured", "parameter_bytes": total, "kv_pair_bytes": DEFAULT_PAIR_BYTES,
            "kv_push_pull_Bps": kv, "raw_zmq_frames_Bps": raw_frames,
            "raw_zmq_one_frame_Bps": raw_one,
            "ratio": kv["median"] / raw_frames["median"], "payload_per_sync": payload,
            "note": "KV: 1 worker + 1 server, --sync ps; (sent + received payload) / the layer's "
                    "sync time (push, server sum + update, pull). Raw: a PAIR socket round trip "
                    "of the same bytes as frames of the KV pair size to an echo thread"}


# ----- e. scaling under a bandwidth cap ---------------------------------------------------------------
MODES = (("no-overlap ps", ["--no-overlap", "--sync", "ps"]),
         ("wfbp ps", ["--sync", "ps"]),
         ("hybrid", ["--sync", "hybrid"]))


def scaling(workdir, quick=False, bandwidth="1Gbit", worker_counts=(2, 4), iterations=None):
    ok, reason = status()
    if not ok:
        return not_measured(reason)
    if quick:
        return not_measured("skipped in --quick (it starts 12 jobs of up to 8 processes)")
    results = []
    for bench_net, iters in ((nets.fc_heavy(), iterations or 4),
                             (nets.cifar10_quick(), iterations or 8)):
        skip = 1
        for p1 in worker_counts:
            folder = Path(workdir) / "scaling" / f"{bench_net.key}-{p1}"
            solver_path = nets.write_solver_files(bench_net, folder, iters + skip + 1)
            for mode, flags in MODES:
                extra = flags + ["--bandwidth", bandwidth] if bandwidth else flags
                records, timeline, seconds, error = run_job(
                    solver_path, p1, p1, folder / mode.replace(" ", "_"), extra=extra,
                    timeout=420, threads=1)
                row = {"net": bench_net.key, "workers": p1, "servers": p1, "mode": mode,
                       "bandwidth": bandwidth, "job_seconds": seconds}
                if error:
                    row.update(status="failed", reason=error)
                else:
                    it_s = iteration_times(records, skip)
                    sent = [r.get("sent_payload", 0) + r.get("sent_header", 0)
                            for r in records[skip:]]
                    recv = [r.get("recv_payload", 0) + r.get("recv_header", 0)
                            for r in records[skip:]]
                    row.update(status="measured" if it_s else "failed",
                               iteration_s=stats(it_s) if it_s else None,
                               bytes_sent_per_iter=float(numpy.median(sent)) if sent else None,
                               bytes_recv_per_iter=float(numpy.median(recv)) if recv else None,
                               hidden_share=hidden_share(timeline, skip),
                               barrier_wait_s=stats([r["barrier_wait_s"] for r in records[skip:]])
                               if records[skip:] else None)
                results.append(row)
    return {"status": "measured", "rows": results,
            "note": f"P1 workers and P2 = P1 servers on this machine, each process capped at "
                    f"{bandwidth} of sends (--bandwidth), 1 BLAS thread per process; iteration "
                    f"time = worker 0's consecutive stats records; bytes = worker 0's payload + "
                    f"headers; hidden = share of worker 0's sync time inside its backward "
                    f"(timeline)"}


def workdir():
    return tempfile.mkdtemp(prefix="poseidon-bench-")
