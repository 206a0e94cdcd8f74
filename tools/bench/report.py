"""Writing the bench results: results.json (everything), results.md (the tables) and PNG plots.

matplotlib is an optional dependency (the `bench` extra); it is imported only when plots are
written, and its absence is a clear error that names the fix (or run with --no-plots).
"""
import json
from pathlib import Path

from . import report_hosts, report_schemes

TARGETS = (
    ("cifar10_quick training vs PyTorch CPU", ">= 1.0x"),
    ("fc_heavy training vs PyTorch CPU", ">= 1.2x"),
    ("Convolution + InnerProduct GEMM time vs GEMM peak", ">= 70%"),
    ("single-node overhead of the distributed path", "<= 1%"),
    ("KV-store push+pull vs raw ZeroMQ", ">= 70%"),
    ("1 Gbit, 4 workers, fc_heavy: hybrid vs no-overlap PS iteration time", "<= 1/3"),
)


class PlotsUnavailable(RuntimeError):
    pass


def _sampled(peak):
    """How often a peak was measured (tools/bench/env.GemmPeaks), when more than once."""
    n = peak.get("samples", 1)
    return (f", measured {n} times (before part b and after each of its nets; shares are taken "
            f"against the best run)" if n > 1 else "")


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotsUnavailable(
            f"plots need matplotlib, which is not installed ({e}): install the bench extra "
            f"(pip install -e '.[bench]') or run `poseidon bench --no-plots`") from None
    return plt


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
                 else _why(c), c["overhead"] <= 0.01 if c.get("status") == "measured" else None))
    t = d.get("transport") or {}
    rows.append((TARGETS[4][0], TARGETS[4][1],
                 transport_text(t) if t.get("status") == "measured" else _why(t),
                 t["ratio"] >= 0.70 if t.get("status") == "measured" else None))
    s = d.get("scaling") or {}
    ratio = scaling_ratio(s)
    rows.append((TARGETS[5][0], TARGETS[5][1],
                 f"{ratio:.2f}" if ratio is not None else _why(s),
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


def _why(part):
    if not part:
        return "not measured"
    return f"{part.get('status', 'not measured')}: {part.get('reason', '')}".strip()


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


def _mm(s, fmt="{:.0f}", scale=1.0):
    if not s:
        return "-"
    return (fmt.format(s["median"] * scale) + " (" + fmt.format(s["min"] * scale) + "–"
            + fmt.format(s["max"] * scale) + ")")


def part_times_text(part_seconds):
    """'a 69 s, b 21 s, ...': where a run's time went, part by part."""
    return ", ".join(f"{part} {s:.0f} s" for part, s in part_seconds.items())


def markdown(results):
    m = results["meta"]
    blas = m["blas"]
    parts = results.get("part_seconds") or {}
    lines = [f"# poseidon bench: {m['date']}", "",
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
    lines += ["## Targets", "", "| target | goal | measured | met |", "|---|---|---|---|"]
    for name, goal, measured, met in targets(results):
        lines.append(f"| {name} | {goal} | {measured} | "
                     f"{'yes' if met else 'no' if met is not None else '-'} |")
    peak = results.get("gemm_peak")
    if peak:
        lines += ["", f"GEMM peak (float32 {peak['size']}³ numpy matmul, {m['threads']} threads): "
                      f"{peak['peak']:.0f} GFLOP/s best run, {_mm(peak)} over "
                      f"{len(peak['runs'])} runs" + _sampled(peak) + "."]
    call_peak = results.get("gemm_peak_call")
    if call_peak and call_peak.get("threads") != m.get("threads"):
        alone = results.get("gemm_peak_call_alone")
        at_once = (f", {call_peak['calls']} at once, one per core" if call_peak.get("calls")
                   else "")
        lines += ["", f"Per-call GEMM peak ({call_peak['threads']} thread{at_once}: the engine runs "
                      f"one GEMM per core while it splits the batch over cores): "
                      f"{call_peak['peak']:.0f} GFLOP/s best run, {_mm(call_peak)}"
                      + _sampled(call_peak)
                      + (f"; one such call alone on the machine: {alone['peak']:.0f} GFLOP/s"
                         if alone else "") + "."]
    thr = results.get("throughput")
    if thr:
        lines += ["", "## a. Training throughput (images/s, forward + backward + update)", "",
                  "| net | batch | engine | PyTorch CPU | engine / PyTorch |", "|---|---|---|---|---|"]
        for key, r in thr.items():
            lines.append(f"| {r['net']} | {r['batch']} | {_mm(r['engine'])} | "
                         f"{_mm(r['torch']) if r['torch'] else 'not measured'} | "
                         f"{r['ratio']:.2f}x |" if r["ratio"] is not None else
                         f"| {r['net']} | {r['batch']} | {_mm(r['engine'])} | not measured "
                         f"({r.get('torch_note')}) | - |")
    layers = results.get("layers")
    if layers:
        lines += ["", "## b. Per-layer times (ms per iteration) and share of the GEMM peak", ""]
        for key, net in layers.items():
            lines += [f"### {net['net']}", "",
                      "| layer | type | forward ms | backward ms | PyTorch fwd / bwd ms | GFLOP "
                      "fwd/bwd | GFLOP/s fwd/bwd | peak share | GEMM calls GFLOP/s (per-call peak "
                      "share) |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in net["layers"]:
                if r["forward_ms"]["median"] < 0.005 and r["backward_ms"]["median"] < 0.005:
                    continue
                gf = (f"{r['gflop_forward']:.3f} / {r['gflop_backward']:.3f}"
                      if "gflop_forward" in r else "")
                rate = (f"{r['gflops_forward']:.0f} / "
                        f"{r['gflops_backward']:.0f}" if r.get("gflops_forward") and
                        r.get("gflops_backward") else
                        f"{r['gflops_forward']:.0f} / -" if r.get("gflops_forward") else "")
                share = f"{100 * r['peak_share']:.0f}%" if r.get("peak_share") else ""
                call = (f"{r['gemm_call_gflops']:.0f} ({100 * r['gemm_call_share']:.0f}%)"
                        if r.get("gemm_call_gflops") else "")
                torch_ms = (f"{r['torch_forward_ms']['median']:.2f} / "
                            f"{r['torch_backward_ms']['median']:.2f}" if "torch_forward_ms" in r
                            else "")
                kind = r["type"] + (f" ({r['algorithm']})" if r.get("algorithm") else "")
                lines.append(f"| {r['name']} | {kind} | {_mm(r['forward_ms'], '{:.2f}')} | "
                             f"{_mm(r['backward_ms'], '{:.2f}')} | {torch_ms} | {gf} | {rate} | "
                             f"{share} | {call} |")
            lines.append(f"| (solver update) | | | {_mm(net['update_ms'], '{:.2f}')} | | | | | |")
            share = net.get("gemm_layers_peak_share")
            lines += ["", f"Sum: forward {net['forward_ms']:.1f} ms, backward "
                          f"{net['backward_ms']:.1f} ms, update {net['update_ms']['median']:.1f} ms"
                          f" = {net['step_ms']:.1f} ms; Convolution + InnerProduct: "
                          f"{net['gemm_layers_gflop']:.2f} GFLOP in {net['gemm_layers_ms']:.1f} ms"
                          + (f" = {100 * share:.0f}% of the peak." if share else ".")
                          + (f" Inside the GEMM calls: {net['gemm_calls_gflops']:.0f} GFLOP/s per "
                             f"call = {100 * net['gemm_calls_share']:.0f}% of the "
                             f"{net['gemm_call_peak_gflops']:.0f} GFLOP/s one call can reach; "
                             f"the rest of the layers' time is im2col, layout copies and bias."
                             + (" Layers marked (fourier) run in the frequency domain, "
                                "(winograd) by Winograd's F(2x2, 3x3): their GFLOP and peak share "
                                "count a direct convolution's FLOPs (an effective rate), their "
                                "GEMM calls the FLOPs actually done."
                                if any(r.get("algorithm") in ("fourier", "winograd")
                                       for r in net["layers"]) else "")
                             if net.get("gemm_calls_share") else "")
                          + (f" PyTorch, layer by layer on the same inputs: forward "
                             f"{net['torch_layers_ms']['forward']:.1f} ms, backward "
                             f"{net['torch_layers_ms']['backward']:.1f} ms (its loss and update "
                             f"not included)." if net.get("torch_layers_ms") else ""), ""]
    real = results.get("real_nets")
    if real:
        lines += ["## f. Real networks, forward + backward (batch statistics, no update)", "",
                  "| deploy file | batch | engine ms | PyTorch CPU ms | engine / PyTorch (per "
                  "round) | engine's largest layer types, ms forward / backward |",
                  "|---|---|---|---|---|---|"]
        for r in real:
            top = sorted(r["by_type_ms"].items(), key=lambda kv: -sum(kv[1]))[:3]
            kinds = "; ".join(f"{k} {f:.0f} / {b:.0f}" for k, (f, b) in top)
            if r["ratio"] is None:
                lines.append(f"| {r['model']} | {r['batch']} | {_mm(r['engine_ms'])} | not "
                             f"measured ({r.get('torch_note')}) | - | {kinds} |")
                continue
            lines.append(f"| {r['model']} | {r['batch']} | {_mm(r['engine_ms'])} | "
                         f"{_mm(r['torch_ms'])} | {r['ratio']:.2f}x ({min(r['ratio_rounds']):.2f}"
                         f"–{max(r['ratio_rounds']):.2f}) | {kinds} |")
        lines += ["", "PyTorch's graph is built from the same prototxt (tools/bench/model_ref.py): "
                      "a BatchNorm and its Scale as one affine BatchNorm2d, ReLUs in place where "
                      "Caffe's are. `python -m poseidon.tools.bench.model_ref MODEL --profile` gives one "
                      "net's per-type times beside PyTorch's own profile.", ""]
    d = results.get("distributed") or {}
    lines += ["## c–e, g. Distributed path", ""]
    c = d.get("single_node_overhead") or {}
    if c.get("status") == "measured":
        lines += [f"**c. Single-node overhead** ({c['net']}): plain engine "
                  f"{_mm(c['plain_engine_s'], '{:.1f}', 1e3)} ms/iter, 1 worker + 1 server "
                  f"{_mm(c['distributed_s'], '{:.1f}', 1e3)} ms/iter: overhead "
                  f"{100 * c['overhead']:+.1f}%{_interval(c)}"
                  + (f" (per round {_mm(c['overhead_rounds'], '{:+.1f}', 100)}%)"
                     if c.get("overhead_rounds") else "") + f". {c['note']}."
                  + _overhead_parts(c.get("where_it_goes")), ""]
        for flag, note, v in _overhead_variants(d):
            if v.get("status") == "measured":
                lines += [f"The same with `{flag}` ({note}): "
                          f"overhead {100 * v['overhead']:+.1f}%{_interval(v)}."
                          + _overhead_parts(v.get("where_it_goes")), ""]
    else:
        lines += [f"**c. Single-node overhead**: {_why(c)}", ""]
    t = d.get("transport") or {}
    if t.get("status") == "measured" and t.get("raw_zmq_curve_frames_Bps"):
        pair_mib = t["kv_pair_bytes"] / 2 ** 20
        lines += [f"**d. Transport** ({t['parameter_bytes'] / 2 ** 20:.0f} MiB parameter, "
                  f"{t['rounds']} rounds; GB/s, both directions counted):", "",
                  f"| route and security | KV push+pull | raw ZeroMQ, {pair_mib:.0f} MiB frames "
                  f"| KV / raw |",
                  "|---|---|---|---|",
                  f"| TCP, CURVE (the default between hosts; the target) | "
                  f"{_mm(t['kv_push_pull_Bps'], '{:.2f}', 1e-9)} | "
                  f"{_mm(t['raw_zmq_curve_frames_Bps'], '{:.2f}', 1e-9)} | "
                  f"{_mm(t['ratio_rounds'], '{:.0f}', 100)}% |",
                  f"| TCP, none (`--insecure`, plain ZeroMQ) | "
                  f"{_mm(t['kv_push_pull_insecure_Bps'], '{:.2f}', 1e-9)} | "
                  f"{_mm(t['raw_zmq_frames_Bps'], '{:.2f}', 1e-9)} | "
                  f"{_mm(t['ratio_insecure_rounds'], '{:.0f}', 100)}% |"] + ([
                  f"| Unix sockets (`--ipc links`) | "
                  f"{_mm(t['kv_push_pull_ipc_Bps'], '{:.2f}', 1e-9)} | "
                  f"{_mm(t['raw_zmq_ipc_frames_Bps'], '{:.2f}', 1e-9)} | "
                  f"{_mm(t['ratio_ipc_rounds'], '{:.0f}', 100)}% |"]
                  if t.get("kv_push_pull_ipc_Bps") else []) + ([
                  f"| shared memory (the default on one host; no socket carries the arrays) | "
                  f"{_mm(t['kv_push_pull_shared_Bps'], '{:.2f}', 1e-9)} | "
                  f"{_mm(t['raw_zmq_ipc_frames_Bps'], '{:.2f}', 1e-9)} (Unix socket) | "
                  f"{_mm(t['ratio_shared_rounds'], '{:.0f}', 100)}% |"]
                  if t.get("kv_push_pull_shared_Bps") else []) + ["",
                  f"Plain raw ZeroMQ as one frame: "
                  f"{_mm(t['raw_zmq_one_frame_Bps'], '{:.2f}', 1e-9)} GB/s. {t['note']}.", ""]
    elif t.get("status") == "measured":
        lines += [f"**d. Transport** ({t['parameter_bytes'] / 2 ** 20:.0f} MiB parameter): KV "
                  f"push+pull {_mm(t['kv_push_pull_Bps'], '{:.2f}', 1e-9)} GB/s; raw ZeroMQ "
                  f"{_mm(t['raw_zmq_frames_Bps'], '{:.2f}', 1e-9)} GB/s as "
                  f"{t['kv_pair_bytes'] / 2 ** 20:.0f} MiB frames, "
                  f"{_mm(t['raw_zmq_one_frame_Bps'], '{:.2f}', 1e-9)} GB/s as one frame; "
                  f"ratio {100 * t['ratio']:.0f}%. {t['note']}.", ""]
    else:
        lines += [f"**d. Transport**: {_why(t)}", ""]
    s = d.get("scaling") or {}
    if s.get("status") == "measured":
        lines += ["**e. Scaling under a bandwidth cap**", "",
                  "| net | workers | mode | iteration s | MB sent/recv per iter (worker 0) | "
                  "sync hidden under backward | exposed sync wait s |",
                  "|---|---|---|---|---|---|---|"]
        for r in s["rows"]:
            if r.get("status") != "measured":
                lines.append(f"| {r['net']} | {r['workers']} | {r['mode']} | {r['status']}: "
                             f"{(r.get('reason') or '')[:120]} | | | |")
                continue
            hid = _mm(r["hidden_share"], "{:.0f}", 100) + " %" if r.get("hidden_share") else "-"
            lines.append(f"| {r['net']} | {r['workers']} | {r['mode']} | "
                         f"{_mm(r['iteration_s'], '{:.3f}')} | "
                         f"{(r['bytes_sent_per_iter'] or 0) / 1e6:.1f} / "
                         f"{(r['bytes_recv_per_iter'] or 0) / 1e6:.1f} | {hid} | "
                         f"{_mm(r['barrier_wait_s'], '{:.3f}')} |")
        ratios = s.get("hybrid_over_no_overlap") or {}
        if ratios:
            lines += ["", "hybrid / no-overlap ps iteration time, per round: " + "; ".join(
                f"{k.replace('-', ', ')} workers {_mm(v, '{:.2f}')}"
                for k, v in sorted(ratios.items()))]
        lines += ["", s["note"] + ".", ""]
    else:
        lines += [f"**e. Scaling under a bandwidth cap**: {_why(s)}", ""]
    lines += report_hosts.markdown_lines(d.get("emulated_hosts"))
    lines += report_schemes.markdown_lines(d.get("schemes_across_hosts"))
    unpinned = results.get("unpinned")
    if unpinned:
        lines += ["## Unpinned OpenBLAS (OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset)", ""]
        if unpinned.get("status") == "measured":
            lines += [f"Kernel {unpinned['blas'].get('kernel')}, GEMM peak "
                      f"{unpinned['gemm_peak']['peak']:.0f} GFLOP/s.", "",
                      "| net | engine | PyTorch CPU | ratio |", "|---|---|---|---|"]
            for r in unpinned["throughput"].values():
                lines.append(f"| {r['net']} | {_mm(r['engine'])} | "
                             f"{_mm(r['torch']) if r['torch'] else '-'} | "
                             + (f"{r['ratio']:.2f}x |" if r.get("ratio") else "- |"))
            lines.append("")
        else:
            lines += [_why(unpinned), ""]
    gpu = results.get("gpu")
    if gpu:
        lines += ["## GPU", ""]
        if gpu.get("status") == "measured":
            lines += ["| net | engine (CuPy) | PyTorch CUDA | ratio |", "|---|---|---|---|"]
            for key, r in gpu["throughput"].items():
                lines.append(f"| {r['net']} | {_mm(r['engine'])} | "
                             f"{_mm(r['torch']) if r['torch'] else '-'} | "
                             f"{r['ratio']:.2f}x |" if r["ratio"] else "-")
            precision = {"tf32": "TF32 GEMMs on both sides",
                         "fp32": "full FP32 on both sides"}.get(gpu.get("precision"), "-")
            lines += ["", f"Device: {gpu.get('device')}; precision: {precision}", ""]
        else:
            lines += [_why(gpu), ""]
    if results.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in results["plots"]] + [""]
    elif results.get("plots_note"):
        lines += [f"Plots: {results['plots_note']}", ""]
    return "\n".join(lines)


def _torch_line(t):
    if not t.get("available"):
        return t.get("reason", "not available")
    return (f"{t['version']}, {t.get('cpu_capability', '?')} kernels, mkldnn "
            f"{t.get('mkldnn')}")


def plots(results, out_dir):
    """Write the PNG plots; returns their file names."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    names = []
    thr = results.get("throughput")
    if thr:
        keys = list(thr)
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
        for ax, key in zip(axes[0], keys):
            r = thr[key]
            sides = [("engine", r["engine"])] + ([("PyTorch CPU", r["torch"])] if r["torch"] else [])
            med = [s["median"] for _, s in sides]
            err = [[s["median"] - s["min"] for _, s in sides], [s["max"] - s["median"] for _, s in sides]]
            ax.bar([n for n, _ in sides], med, yerr=err, capsize=4,
                   color=["tab:blue", "tab:orange"][:len(sides)])
            ax.set_title(key + (f"  ({r['ratio']:.2f}x)" if r.get("ratio") else ""), fontsize=9)
            ax.set_ylabel("images/s")
        fig.suptitle("Training throughput (median, min–max)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / "throughput.png", dpi=110)
        plt.close(fig)
        names.append("throughput.png")
    for key, net in (results.get("layers") or {}).items():
        rows = [r for r in net["layers"]
                if r["forward_ms"]["median"] + r["backward_ms"]["median"] >= 0.01]
        rows.append({"name": "update", "forward_ms": {"median": 0, "min": 0, "max": 0},
                     "backward_ms": net["update_ms"]})
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
        ys = range(len(rows))
        for off, part, color in ((-0.2, "forward_ms", "tab:blue"), (0.2, "backward_ms", "tab:red")):
            med = [r[part]["median"] for r in rows]
            err = [[r[part]["median"] - r[part]["min"] for r in rows],
                   [r[part]["max"] - r[part]["median"] for r in rows]]
            ax.barh([y + off for y in ys], med, height=0.4, xerr=err, capsize=2, color=color,
                    label=part.split("_")[0] + ("" if part == "forward_ms" else " / update"))
        ax.set_yticks(list(ys))
        ax.set_yticklabels([r["name"] for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per iteration (median, min–max)")
        ax.set_title(net["net"], fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"layers_{key}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        names.append(name)
    real = [r for r in results.get("real_nets") or [] if r.get("ratio")]
    if real:
        fig, ax = plt.subplots(figsize=(6, 0.45 * len(real) + 1.2))
        ratios = [r["ratio"] for r in real]
        err = [[r["ratio"] - min(r["ratio_rounds"]) for r in real],
               [max(r["ratio_rounds"]) - r["ratio"] for r in real]]
        ax.barh(range(len(real)), ratios, xerr=err, capsize=3, color="tab:blue")
        ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_yticks(list(range(len(real))))
        ax.set_yticklabels([f"{r['model']} (batch {r['batch']})" for r in real], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("engine / PyTorch CPU speed, forward + backward (median, per-round range)")
        fig.tight_layout()
        fig.savefig(out_dir / "real_nets.png", dpi=110)
        plt.close(fig)
        names.append("real_nets.png")
    s = (results.get("distributed") or {}).get("scaling") or {}
    if s.get("status") == "measured":
        groups = sorted({(r["net"], r["workers"]) for r in s["rows"]})
        modes = [m for m in ("no-overlap ps", "wfbp ps", "hybrid")]
        fig, ax = plt.subplots(figsize=(7, 3.6))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            med, lo, hi = [], [], []
            for g in groups:
                row = next((r for r in s["rows"] if (r["net"], r["workers"]) == g
                            and r["mode"] == mode and r.get("iteration_s")), None)
                v = row["iteration_s"] if row else {"median": 0, "min": 0, "max": 0}
                med.append(v["median"])
                lo.append(v["median"] - v["min"])
                hi.append(v["max"] - v["median"])
            ax.bar([x + i * width for x in range(len(groups))], med, width, yerr=[lo, hi],
                   capsize=3, label=mode)
        ax.set_xticks([x + width for x in range(len(groups))])
        ax.set_xticklabels([f"{n}\n{w} workers" for n, w in groups], fontsize=8)
        ax.set_ylabel("s per iteration")
        ax.set_yscale("log")
        ax.set_title(f"Iteration time under a {s['rows'][0]['bandwidth']} cap", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "scaling.png", dpi=110)
        plt.close(fig)
        names.append("scaling.png")
    return names


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
