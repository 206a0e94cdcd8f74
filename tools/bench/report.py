"""Writing the bench results: results.json (everything), results.md (the tables) and PNG plots.

This module holds the report's frame, its targets table and the sections of parts c-e, which
share their figures' wording with the targets; the engine's sections come from report_engine.py,
parts g and h from report_hosts.py and report_schemes.py, the plots from report_plots.py.
"""
import json
from pathlib import Path

from . import report_engine, report_hosts, report_schemes
from .report_format import mm, why
from .report_plots import plots

TARGETS = (
    ("cifar10_quick training vs PyTorch CPU", ">= 1.0x"),
    ("fc_heavy training vs PyTorch CPU", ">= 1.2x"),
    ("Convolution + InnerProduct GEMM time vs GEMM peak", ">= 70%"),
    ("single-node overhead of the distributed path", "<= 1%"),
    ("KV-store push+pull vs raw ZeroMQ", ">= 70%"),
    ("1 Gbit, 4 workers, fc_heavy: hybrid vs no-overlap PS iteration time", "<= 1/3"),
)


def targets(results):
    """[(target, goal, measured text, met: True/False/None)] from the results."""
    rows = []
    thr = results.get("throughput") or {}

    def ratio_row(key, goal, threshold):
        r = thr.get(key)
        if not r or r.get("ratio") is None:
            return (goal, "not measured" + (f" ({r.get('torch_note')})" if r else ""), None)
        return (goal, f"{r['ratio']:.2f}x ({r['engine']['median']:.0f} vs "
                      f"{r['torch']['median']:.0f} img/s)", r["ratio"] >= threshold)

    rows.append((TARGETS[0][0],) + ratio_row("cifar10_quick", TARGETS[0][1], 1.0))
    rows.append((TARGETS[1][0],) + ratio_row("fc_heavy", TARGETS[1][1], 1.2))
    layers = results.get("layers") or {}
    if layers:
        # judged on the GEMM calls (metered inside the layers, against the peak of the threads
        # one call runs on); the whole layers' share of the machine peak is shown beside them
        calls, whole = [], []
        met = True
        for key, net in layers.items():
            share = net.get("gemm_layers_peak_share")
            call = net.get("gemm_calls_share")
            if share is not None:
                whole.append(f"{key} {100 * share:.0f}%")
            if call is not None:
                calls.append(f"{key} {100 * call:.0f}%")
                met = met and call >= 0.70
        text = (f"GEMM calls: {', '.join(calls)} of the per-call peak" if calls else
                "GEMM calls not metered")
        if whole:
            text += f"; whole conv/IP layers: {', '.join(whole)} of the machine peak"
        rows.append((TARGETS[2][0], TARGETS[2][1], text, met if calls else None))
    else:
        rows.append((TARGETS[2][0], TARGETS[2][1], "not measured", None))
    d = results.get("distributed") or {}
    c = d.get("single_node_overhead") or {}
    variants_text = "".join(
        f"; with `{flag}` {100 * v['overhead']:+.1f}%{_interval(v)}"
        for flag, _, v in _overhead_variants(d) if v.get("status") == "measured")
    rows.append((TARGETS[3][0], TARGETS[3][1],
                 f"{100 * c['overhead']:+.1f}%{_interval(c)}{variants_text}"
                 if c.get("status") == "measured"
                 else why(c), c["overhead"] <= 0.01 if c.get("status") == "measured" else None))
    t = d.get("transport") or {}
    rows.append((TARGETS[4][0], TARGETS[4][1],
                 transport_text(t) if t.get("status") == "measured" else why(t),
                 t["ratio"] >= 0.70 if t.get("status") == "measured" else None))
    s = d.get("scaling") or {}
    ratio = scaling_ratio(s)
    rows.append((TARGETS[5][0], TARGETS[5][1],
                 f"{ratio:.2f}" if ratio is not None else why(s),
                 ratio <= 1 / 3 if ratio is not None else None))
    return rows


def transport_text(t):
    """The target's figure: KV with CURVE (the default) vs raw ZeroMQ with CURVE, then --insecure
    KV vs plain raw. Results written before both were measured compared KV with plain raw."""
    gb = lambda key: t[key]["median"] / 1e9                       # noqa: E731
    if not t.get("raw_zmq_curve_frames_Bps"):
        return (f"{100 * t['ratio']:.0f}% ({gb('kv_push_pull_Bps'):.2f} vs "
                f"{gb('raw_zmq_frames_Bps'):.2f} GB/s)")
    text = (f"{100 * t['ratio']:.0f}% with CURVE on both ({gb('kv_push_pull_Bps'):.2f} vs "
            f"{gb('raw_zmq_curve_frames_Bps'):.2f} GB/s); --insecure vs plain "
            f"{100 * t['ratio_insecure']:.0f}% ({gb('kv_push_pull_insecure_Bps'):.2f} vs "
            f"{gb('raw_zmq_frames_Bps'):.2f} GB/s)")
    if t.get("kv_push_pull_ipc_Bps"):
        text += (f"; Unix sockets {100 * t['ratio_ipc']:.0f}% "
                 f"({gb('kv_push_pull_ipc_Bps'):.2f} vs {gb('raw_zmq_ipc_frames_Bps'):.2f} GB/s)")
    if t.get("kv_push_pull_shared_Bps"):
        text += (f"; shared memory (the default on one host) {gb('kv_push_pull_shared_Bps'):.2f}"
                 f" GB/s, {100 * t['ratio_shared']:.0f}% of raw on a Unix socket")
    return text


def _overhead_variants(d):
    """[(flag as given, what it does, part c result)] of the variants part c measured after the
    default."""
    from .dist_parts import overhead_variants
    return [(v.flag, v.note, d[f"single_node_overhead_{v.key}"] or {})
            for v in overhead_variants() if f"single_node_overhead_{v.key}" in d]


def _interval(c):
    """' (95% interval of the median +a…+b%)' for part c, or '' when it has none."""
    iv = c.get("overhead_interval95")
    if not iv:
        return ""
    return f" (95% interval of the median {100 * iv[0]:+.1f}…{100 * iv[1]:+.1f}%)"


def _overhead_parts(parts):
    """Part c's split of the overhead, as a sentence ('' when the part has none)."""
    if not parts:
        return ""

    def ms(key):
        v = parts.get(key)
        return "n/a" if v is None else f"{v:.1f} ms"
    text = (f" Where it goes, per iteration (medians): this process's CPU {ms('worker_cpu_plain_ms')}"
            f" plain vs {ms('worker_cpu_distributed_ms')} distributed, the server process "
            f"{ms('server_cpu_ms')} of CPU (a mean over the blocks), and "
            f"{ms('exposed_sync_ms')} of exposed sync (from the end of backward until every sync "
            f"is done).")
    threads = parts.get("threads_cpu_ms") or {}
    dist_side, plain_side = threads.get("distributed") or {}, threads.get("plain") or {}
    if dist_side:
        def side(label):
            d = f"{dist_side[label]:.2f}"
            return f"{label} {d} / {plain_side[label]:.2f}" if label in plain_side else \
                f"{label} {d}"
        shown = [side(k) for k in sorted(dist_side, key=lambda k: -dist_side[k])
                 if dist_side[k] >= 0.05]
        server = [f"{k} {v:.2f}" for k, v in sorted((threads.get("server") or {}).items(),
                                                     key=lambda kv: -kv[1]) if v >= 0.05]
        text += (f" CPU per thread, ms per iteration (distributed / plain): {', '.join(shown)}"
                 + (f"; server: {', '.join(server)}" if server else "") + ".")
    return text


def scaling_ratio(scaling):
    """fc_heavy, 4 workers: hybrid / no-overlap ps iteration time, the median of the per-round
    ratios (each round ran both jobs close together), else the ratio of the medians."""
    if scaling.get("status") != "measured":
        return None
    per_round = (scaling.get("hybrid_over_no_overlap") or {}).get("fc_heavy-4")
    if per_round:
        return per_round["median"]
    found = {}
    for row in scaling["rows"]:
        if row["net"] == "fc_heavy" and row["workers"] == 4 and row.get("iteration_s"):
            found[row["mode"]] = row["iteration_s"]["median"]
    if "hybrid" in found and "no-overlap ps" in found:
        return found["hybrid"] / found["no-overlap ps"]
    return None


def part_times_text(part_seconds):
    """'a 69 s, b 21 s, ...': where a run's time went, part by part."""
    return ", ".join(f"{part} {s:.0f} s" for part, s in part_seconds.items())


def markdown(results):
    """results.md: the run's frame and its targets, then each part's section in the report's
    order (the engine's on one machine, the distributed path's, the extra runs', the plots)."""
    d = results.get("distributed") or {}
    lines = _frame_lines(results) + _targets_lines(results)
    lines += report_engine.peak_lines(results)
    lines += report_engine.throughput_lines(results.get("throughput"))
    lines += report_engine.layers_lines(results.get("layers"))
    lines += report_engine.real_nets_lines(results.get("real_nets"))
    lines += ["## c–e, g. Distributed path", ""]
    lines += _overhead_lines(d)
    lines += _transport_lines(d.get("transport") or {})
    lines += _scaling_lines(d.get("scaling") or {})
    lines += report_hosts.markdown_lines(d.get("emulated_hosts"))
    lines += report_schemes.markdown_lines(d.get("schemes_across_hosts"))
    lines += report_engine.unpinned_lines(results.get("unpinned"))
    lines += report_engine.gpu_lines(results.get("gpu"))
    if results.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in results["plots"]] + [""]
    elif results.get("plots_note"):
        lines += [f"Plots: {results['plots_note']}", ""]
    return "\n".join(lines)


def _frame_lines(results):
    """The title and the run's conditions: command, machine, BLAS, environment, load, PyTorch."""
    m = results["meta"]
    blas = m["blas"]
    parts = results.get("part_seconds") or {}
    return [f"# poseidon bench: {m['date']}", "",
            f"- command: `{m['command']}` ({results.get('runtime_s', 0):.0f} s"
            + (f"; part by part: {part_times_text(parts)}" if parts else "") + ")",
            f"- machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, numpy "
            f"{m['numpy']}; {m['platform']}",
            f"- numpy BLAS: {blas.get('library')} {blas.get('version') or ''}, kernel "
            f"{blas.get('kernel')}, {blas.get('threads')} threads (from {blas.get('source')}); "
            f"threads used: {m['threads']}",
            "- environment: " + ", ".join(f"{k}={v if v is not None else '(unset)'}"
                                          for k, v in m["env"].items()),
            f"- load average at start / end: {m.get('loadavg_start')} / {m.get('loadavg_end')}",
            f"- PyTorch: {_torch_line(m.get('torch') or {})}",
            f"- figures: median of {m['runs']} runs (min–max)", ""]


def _targets_lines(results):
    lines = ["## Targets", "", "| target | goal | measured | met |", "|---|---|---|---|"]
    for name, goal, measured, met in targets(results):
        lines.append(f"| {name} | {goal} | {measured} | "
                     f"{'yes' if met else 'no' if met is not None else '-'} |")
    return lines


def _overhead_lines(d):
    """Part c: the default's overhead and where it goes, then each variant measured beside it."""
    c = d.get("single_node_overhead") or {}
    if c.get("status") != "measured":
        return [f"**c. Single-node overhead**: {why(c)}", ""]
    lines = [f"**c. Single-node overhead** ({c['net']}): plain engine "
             f"{mm(c['plain_engine_s'], '{:.1f}', 1e3)} ms/iter, 1 worker + 1 server "
             f"{mm(c['distributed_s'], '{:.1f}', 1e3)} ms/iter: overhead "
             f"{100 * c['overhead']:+.1f}%{_interval(c)}"
             + (f" (per round {mm(c['overhead_rounds'], '{:+.1f}', 100)}%)"
                if c.get("overhead_rounds") else "") + f". {c['note']}."
             + _overhead_parts(c.get("where_it_goes")), ""]
    for flag, note, v in _overhead_variants(d):
        if v.get("status") == "measured":
            lines += [f"The same with `{flag}` ({note}): "
                      f"overhead {100 * v['overhead']:+.1f}%{_interval(v)}."
                      + _overhead_parts(v.get("where_it_goes")), ""]
    return lines


def _transport_lines(t):
    """Part d: a table of the routes and their security, KV beside raw ZeroMQ (results from
    before the CURVE side was measured: one sentence)."""
    if t.get("status") != "measured":
        return [f"**d. Transport**: {why(t)}", ""]
    if not t.get("raw_zmq_curve_frames_Bps"):
        return [f"**d. Transport** ({t['parameter_bytes'] / 2 ** 20:.0f} MiB parameter): KV "
                f"push+pull {mm(t['kv_push_pull_Bps'], '{:.2f}', 1e-9)} GB/s; raw ZeroMQ "
                f"{mm(t['raw_zmq_frames_Bps'], '{:.2f}', 1e-9)} GB/s as "
                f"{t['kv_pair_bytes'] / 2 ** 20:.0f} MiB frames, "
                f"{mm(t['raw_zmq_one_frame_Bps'], '{:.2f}', 1e-9)} GB/s as one frame; "
                f"ratio {100 * t['ratio']:.0f}%. {t['note']}.", ""]
    pair_mib = t["kv_pair_bytes"] / 2 ** 20
    return ([f"**d. Transport** ({t['parameter_bytes'] / 2 ** 20:.0f} MiB parameter, "
             f"{t['rounds']} rounds; GB/s, both directions counted):", "",
             f"| route and security | KV push+pull | raw ZeroMQ, {pair_mib:.0f} MiB frames "
             f"| KV / raw |",
             "|---|---|---|---|"]
            + _transport_rows(t)
            + ["", f"Plain raw ZeroMQ as one frame: "
                   f"{mm(t['raw_zmq_one_frame_Bps'], '{:.2f}', 1e-9)} GB/s. {t['note']}.", ""])


def _transport_rows(t):
    """Part d's table rows: TCP with CURVE and without, then the one-host routes where measured."""
    def gb(key):
        return mm(t[key], '{:.2f}', 1e-9)

    def pct(key):
        return mm(t[key], '{:.0f}', 100)
    rows = [f"| TCP, CURVE (the default between hosts; the target) | "
            f"{gb('kv_push_pull_Bps')} | {gb('raw_zmq_curve_frames_Bps')} | "
            f"{pct('ratio_rounds')}% |",
            f"| TCP, none (`--insecure`, plain ZeroMQ) | "
            f"{gb('kv_push_pull_insecure_Bps')} | {gb('raw_zmq_frames_Bps')} | "
            f"{pct('ratio_insecure_rounds')}% |"]
    if t.get("kv_push_pull_ipc_Bps"):
        rows.append(f"| Unix sockets (`--ipc links`) | {gb('kv_push_pull_ipc_Bps')} | "
                    f"{gb('raw_zmq_ipc_frames_Bps')} | {pct('ratio_ipc_rounds')}% |")
    if t.get("kv_push_pull_shared_Bps"):
        rows.append(f"| shared memory (the default on one host; no socket carries the arrays) | "
                    f"{gb('kv_push_pull_shared_Bps')} | "
                    f"{gb('raw_zmq_ipc_frames_Bps')} (Unix socket) | "
                    f"{pct('ratio_shared_rounds')}% |")
    return rows


def _scaling_lines(s):
    """Part e: each net, worker count and mode under the bandwidth cap, then the per-round
    hybrid / no-overlap ratios."""
    if s.get("status") != "measured":
        return [f"**e. Scaling under a bandwidth cap**: {why(s)}", ""]
    lines = ["**e. Scaling under a bandwidth cap**", "",
             "| net | workers | mode | iteration s | MB sent/recv per iter (worker 0) | "
             "sync hidden under backward | exposed sync wait s |",
             "|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        if r.get("status") != "measured":
            lines.append(f"| {r['net']} | {r['workers']} | {r['mode']} | {r['status']}: "
                         f"{(r.get('reason') or '')[:120]} | | | |")
            continue
        hid = mm(r["hidden_share"], "{:.0f}", 100) + " %" if r.get("hidden_share") else "-"
        lines.append(f"| {r['net']} | {r['workers']} | {r['mode']} | "
                     f"{mm(r['iteration_s'], '{:.3f}')} | "
                     f"{(r['bytes_sent_per_iter'] or 0) / 1e6:.1f} / "
                     f"{(r['bytes_recv_per_iter'] or 0) / 1e6:.1f} | {hid} | "
                     f"{mm(r['barrier_wait_s'], '{:.3f}')} |")
    ratios = s.get("hybrid_over_no_overlap") or {}
    if ratios:
        lines += ["", "hybrid / no-overlap ps iteration time, per round: " + "; ".join(
            f"{k.replace('-', ', ')} workers {mm(v, '{:.2f}')}"
            for k, v in sorted(ratios.items()))]
    return lines + ["", s["note"] + ".", ""]


def _torch_line(t):
    if not t.get("available"):
        return t.get("reason", "not available")
    return (f"{t['version']}, {t.get('cpu_capability', '?')} kernels, mkldnn "
            f"{t.get('mkldnn')}")


def write(results, out_dir, with_plots=True):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results["targets"] = [{"target": t, "goal": g, "measured": m, "met": met}
                          for t, g, m, met in targets(results)]
    if with_plots:
        results["plots"] = plots(results, out_dir)
    else:
        results["plots"] = []
        results.setdefault("plots_note", "not written (--no-plots)")
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=float))
    (out_dir / "results.md").write_text(markdown(results))
    return out_dir
