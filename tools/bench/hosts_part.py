"""Part g of `poseidon bench`: part e's jobs across emulated hosts, beside part e's token bucket.

Part e runs every process of a job on loopback and caps what each one sends with a token bucket
inside the transport (`--bandwidth`, dist/transport/bandwidth.py). That stands for a network only
as far as a cap on sends behaves like a link. Here each rank of the same job runs in a network
namespace of its own (poseidon.tools.netns), its link capped by tc's tbf at the same rate both
ways, with no `--bandwidth`: the kernel's TCP, the bridge and the cap on what a host receives come
into play. Beside each job stands the same job on loopback under `--bandwidth`: part e's row of
the same bench run where part e measured it (the default run, so that part g costs only its own
jobs), else a twin run right after each netns job, so that the machine's drift touches both sides
of a pair alike. The figure per mode is the ratio of the two iteration times (netns / token
bucket): per round for twins, of the medians against part e.

What a row holds, per side: iteration time = median over rounds of each job's median iteration
(worker 0's consecutive --stats records, the first left out as warm-up), as in part e; bytes per
iteration of worker 0 from its --stats, and (netns side) from `tc -s` on its link, read when its
stats file reaches the first measured iteration and again at the last; and over the whole job, per
host and direction, tc's TCP payload against the payload + headers the job counted.
"""
import time
from pathlib import Path

import numpy

from poseidon.dist.transport.bandwidth import parse_bandwidth

from . import dist_parts, nets
from .env import stats

# net key -> (builder, measured iterations per job): as part e's, whose rows these stand beside
HOST_NETS = {"fc_heavy": (nets.fc_heavy, 3), "cifar10_quick": (nets.cifar10_quick, 6)}
TARGET = ("fc_heavy", 4)        # the row whose hybrid / no-overlap PS ratio is part e's target
SKIP = 1                        # warm-up iterations left out, as part e
JOB_TIMEOUT_S = 420             # one job, either side (fc_heavy's PS at 1 Gbit: ~2 s an iteration)
POLL_S = 0.01                   # how often worker 0's stats file is looked at for the tc window
# tbf's burst: 10 ms of the rate, at least 64 KiB, as the token bucket's own (TokenBucket); its
# queue: 200 ms of the rate, so that the cap delays a burst rather than dropping it
BURST_S, LATENCY = 0.01, "200ms"


def _tiny():
    """The test's and a smoke run's job: cifar10_quick at batch 20, 2 workers, one mode."""
    return dict(net_keys=("cifar10_quick",), worker_counts=(2,), iterations=2,
                modes=[m for m in dist_parts.MODES if m[0] == "wfbp ps"], batch=20)


def emulated_hosts(workdir, bandwidth="1Gbit", runs=1, net_keys=("fc_heavy", "cifar10_quick"),
                   worker_counts=(2, 4), iterations=None, modes=dist_parts.MODES, batch=None,
                   part_e=None, tiny=False, log=None):
    """Per net and worker count (as many servers), `runs` rounds of one netns job per mode, the
    order of the modes rotated every round. The token bucket's side of a row is part e's row when
    `part_e` (part e's result from the same run, same bandwidth) has it measured; else a loopback
    twin run right after each netns job. `tiny`: one small job (_tiny), its twin beside it."""
    if tiny:
        return emulated_hosts(workdir, bandwidth, 1, log=log, **_tiny())
    reason = why_no_hosts()
    if reason:
        return dist_parts.not_measured(reason)
    from poseidon.tools import netns
    unknown = [k for k in net_keys if k not in HOST_NETS]
    if unknown:
        return dist_parts.not_measured(f"unknown net(s) {', '.join(unknown)} for part g "
                                       f"(known: {', '.join(HOST_NETS)})")
    try:
        rate = parse_bandwidth(bandwidth)
    except ValueError as e:
        return dist_parts.not_measured(f"--bandwidth: {e}")
    tbf = {"rate": netns.tbf_rate(rate), "burst": f"{max(int(rate * BURST_S), 64 * 1024)}b",
           "latency": LATENCY}
    measured_e = _part_e_rows(part_e, bandwidth)
    with netns.sigterm_as_exit():
        rows = _measure(Path(workdir) / "hosts", bandwidth, tbf, max(1, int(runs)), net_keys,
                        worker_counts, iterations, modes, batch, measured_e, log)
    return _summary(rows, bandwidth, tbf, runs)


def why_no_hosts():
    """Why jobs across emulated hosts cannot run here (the distributed options a part needs, or
    network namespaces: root and iproute2), or None."""
    ok, reason = dist_parts.status()
    if not ok:
        return reason
    from poseidon.tools import netns
    return netns.why_unavailable()


def _part_e_rows(part_e, bandwidth):
    """{(net, workers, mode): row} of part e's measured rows at this bandwidth."""
    if not part_e or part_e.get("status") != "measured":
        return {}
    return {(r["net"], r["workers"], r["mode"]): r for r in part_e.get("rows", [])
            if r.get("status") == "measured" and r.get("bandwidth") == bandwidth}


def _measure(folder, bandwidth, tbf, runs, net_keys, worker_counts, iterations, modes, batch,
             measured_e, log):
    from poseidon.tools.netns.ranks import make_key_file
    folder.mkdir(parents=True, exist_ok=True)
    keys = make_key_file(folder / "job.keys")        # one key file for every job of the part
    rows = []
    for key in net_keys:
        make, default_iters = HOST_NETS[key]
        bench_net = make(batch) if batch else make()
        total = (iterations or default_iters) + SKIP + 1
        for p1 in worker_counts:
            where = folder / f"{bench_net.key}-{p1}"
            solver = nets.write_solver_files(bench_net, where, total)
            netns_jobs = {mode: [] for mode, _ in modes}
            twins = {mode: [] for mode, _ in modes if (key, p1, mode) not in measured_e}
            for r in range(runs):
                for mode, flags in modes[r % len(modes):] + modes[:r % len(modes)]:
                    run = where / f"{mode.replace(' ', '_')}-{r}"
                    netns_jobs[mode].append(_netns_job(solver, p1, run / "netns", flags, tbf,
                                                       total, keys))
                    if mode in twins:
                        twins[mode].append(dist_parts.run_job(
                            solver, p1, p1, run / "token-bucket", extra=_flags(flags, bandwidth),
                            timeout=JOB_TIMEOUT_S, threads=1))
                    if log:
                        log(f"  {key}, {p1} workers, {mode}: "
                            f"{_pair_text(netns_jobs[mode][-1], twins.get(mode))}")
            for mode, _ in modes:
                rows.append(_row(key, p1, mode, bandwidth, netns_jobs[mode], twins.get(mode),
                                 measured_e.get((key, p1, mode))))
    return rows


def _flags(mode_flags, bandwidth=None):
    """A job's flags: the mode's, over TCP as hosts talk (--ipc off, as part e), and on loopback
    the in-process cap."""
    return list(mode_flags) + ["--ipc", "off"] + (["--bandwidth", bandwidth] if bandwidth else [])


def _netns_job(solver, p1, folder, mode_flags, tbf, total, keys):
    """One job with each rank in its own namespace, every link capped by tbf; its worker-0
    records (as dist_parts.run_job returns them) and what its links carried."""
    from poseidon.tools import netns
    from poseidon.tools.netns.ranks import HostJob
    job = HostJob(folder, solver, p1, p1, flags=_flags(mode_flags) + ["--stats", "stats.jsonl"],
                  threads=1, keys=keys)
    t0 = time.perf_counter()
    with netns.Network(job.size) as network:
        for host in network.hosts:
            network.cap(host, tbf["rate"], burst=tbf["burst"], latency=tbf["latency"])
        procs = job.start(network)
        window = _window(job, network, procs, SKIP + 1, total, JOB_TIMEOUT_S)
        failure = job.finish(procs, max(1.0, JOB_TIMEOUT_S - (time.perf_counter() - t0)))
        seconds = time.perf_counter() - t0
        if failure:
            return {"error": failure, "seconds": seconds, "records": []}
        links = {rank: network.payload(host) for rank, host in enumerate(network.hosts)}
        drops = sum(network.counters(h)["drops"] for h in network.hosts)
        resent = sum(network.tcp_retransmits(h) for h in network.hosts)
    counted = {rank: {"sent": job.counted(rank, "sent"), "received": job.counted(rank, "recv")}
               for rank in links}
    return {"records": job.stats("worker", 0), "seconds": seconds, "error": None,
            "window": window, "links": links, "counted": counted, "drops": drops,
            "resent": resent}


def _window(job, network, procs, first, last, timeout):
    """Worker 0's link payload when its stats file holds `first` records and again at `last`:
    {'records': (n at the first read, n at the second), 'sent', 'received'} for the iterations
    between, or None when the job ended before both were read. Polls every POLL_S, bounded by
    `timeout` and by the job's end."""
    from poseidon.tools.netns import tcp_payload
    path, host = job.stats_path("worker", 0), network.hosts[0]
    header = network.tcp_header_bytes(host)
    marks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(marks) < 2:
        done = path.read_bytes().count(b"\n") if path.exists() else 0
        if done >= (first, last)[len(marks)]:
            got = network.counters(host)
            marks.append((done, {way: tcp_payload(got[way], header)
                                 for way in ("sent", "received")}))
            continue
        if any(p.poll() is not None for p in procs.values()):
            return None
        time.sleep(POLL_S)
    if len(marks) < 2 or marks[1][0] <= marks[0][0]:
        return None
    (n0, a), (n1, b) = marks
    return {"records": [n0, n1], **{way: b[way] - a[way] for way in ("sent", "received")}}


def _pair_text(hosts, twins):
    def median(records, error):
        if error:
            return f"failed ({error.splitlines()[0]})"
        it = dist_parts.iteration_times(records, SKIP)
        return f"{numpy.median(it):.3f} s" if it else "no iterations"
    text = f"netns {median(hosts['records'], hosts['error'])}"
    if twins:
        text += f", token bucket {median(twins[-1][0], twins[-1][3])}"
    return text


def _row(net, p1, mode, bandwidth, netns_jobs, twins, part_e_row):
    """One mode's row: each side as part e's rows are (dist_parts.scaling_row), the netns side
    with its links' counts; the token bucket's side from its twins (the ratio netns / token
    bucket then per round) or part e's row (the ratio of the two medians)."""
    ns_jobs = [(h["records"], None, h["seconds"], h["error"]) for h in netns_jobs]
    netns_side = dist_parts.scaling_row(net, p1, mode, bandwidth, ns_jobs, SKIP)
    if netns_side["status"] == "measured":
        netns_side.update(_links(netns_jobs))
    if twins:
        loop_side = dist_parts.scaling_row(net, p1, mode, bandwidth, twins, SKIP)
        source = "twins"
    else:
        loop_side, source = part_e_row, "part e"
    row = {"net": net, "workers": p1, "servers": p1, "mode": mode, "netns": netns_side,
           "token_bucket": loop_side, "token_bucket_from": source}
    a, b = netns_side.get("iteration_s_by_round"), loop_side.get("iteration_s_by_round")
    if a and b and source == "twins" and len(a) == len(b):
        row["netns_over_token_bucket"] = stats([x / y for x, y in zip(a, b)])
    elif a and b:
        row["netns_over_token_bucket"] = stats([netns_side["iteration_s"]["median"]
                                                / loop_side["iteration_s"]["median"]])
    return row


def _links(jobs):
    """The netns side's counts over its rounds: worker 0's bytes per iteration by tc (the polled
    window) and by its stats over the same iterations; and over whole jobs, per host and way, tc's
    TCP payload / the job's counted bytes (min, max), tbf's drops and TCP's retransmissions."""
    per_iter = {"tc_sent": [], "tc_received": [], "stats_sent": [], "stats_received": []}
    ratios, tc_total, counted_total = [], 0, 0
    for job in jobs:
        w = job["window"]
        if w:
            n0, n1 = w["records"]
            inside = job["records"][n0:n1]
            per_iter["tc_sent"].append(w["sent"] / (n1 - n0))
            per_iter["tc_received"].append(w["received"] / (n1 - n0))
            for way, key in (("sent", "stats_sent"), ("recv", "stats_received")):
                per_iter[key].append(sum(r[f"{way}_payload"] + r[f"{way}_header"]
                                         for r in inside) / len(inside))
        for rank, wire in job["links"].items():
            for way in ("sent", "received"):
                mine = job["counted"][rank][way]
                tc_total += wire[way]
                counted_total += mine
                if mine:
                    ratios.append(wire[way] / mine)
    return {"worker0_bytes_per_iter": {k: float(numpy.median(v)) if v else None
                                       for k, v in per_iter.items()},
            "tc_payload_bytes": tc_total, "counted_bytes": counted_total,
            "tc_over_counted": stats(ratios) if ratios else None,
            "tbf_drops": sum(j["drops"] for j in jobs),
            "tcp_retransmits": sum(j["resent"] for j in jobs)}


def _summary(rows, bandwidth, tbf, runs):
    by_mode = {}
    for row in rows:
        if row.get("netns_over_token_bucket"):
            by_mode.setdefault(row["mode"], []).extend(row["netns_over_token_bucket"]["runs"])
    hybrid = {side: dist_parts.per_round_ratios([r[side] for r in rows])
              for side in ("netns", "token_bucket")}
    failed = [f"{r['net']}, {r['workers']} workers, {r['mode']} ({side}): {r[side]['reason']}"
              for r in rows for side in ("netns", "token_bucket")
              if r[side].get("status") != "measured"]
    return {"status": "measured" if len(failed) < 2 * len(rows) else "failed",
            **({"reason": failed[0]} if failed else {}),
            "bandwidth": bandwidth, "tbf": tbf, "rounds": max(1, int(runs)), "rows": rows,
            "netns_over_token_bucket": {m: stats(v) for m, v in by_mode.items()},
            "hybrid_over_no_overlap": hybrid,
            "target_figure": {side: (hybrid[side].get(f"{TARGET[0]}-{TARGET[1]}") or {}).get(
                "median") for side in hybrid},
            "note": f"P1 workers and P2 = P1 servers, each rank `poseidon train --coordinator "
                    f"... --rank R --keys FILE` in a network namespace of its own, on a veth "
                    f"pair to one bridge, its link capped both ways by tbf at {bandwidth} "
                    f"(burst {tbf['burst']}, latency {tbf['latency']}), no --bandwidth; over TCP "
                    f"with CURVE (--ipc off), one thread per process; {max(1, int(runs))} "
                    f"round(s) of one job per mode, the mode order rotated; iteration time = "
                    f"median over rounds of each job's median iteration (worker 0's stats, "
                    f"{SKIP} warm-up iteration left out). Token bucket: the same job on loopback "
                    f"with --bandwidth {bandwidth}, from part e of the same run where it "
                    f"measured the row (ratio of the medians), else run right after each netns "
                    f"job (ratio per round). Worker 0's bytes per iteration from tc -s on its "
                    f"link (TCP payload: bytes less each segment's Ethernet, IPv4 and TCP "
                    f"headers) and from its stats, over the same iterations"}
