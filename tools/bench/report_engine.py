"""The sections of results.md about the engine on one machine: the GEMM peaks, parts a (throughput),
b (per-layer times) and f (real networks), and the unpinned and GPU runs of part a. Each function
returns the section's lines ([] when the run has no such results); report.markdown puts them in
the report's order around the distributed parts."""
from .report_format import mm, why


def _sampled(peak):
    """How often a peak was measured (tools/bench/env.GemmPeaks), when more than once."""
    n = peak.get("samples", 1)
    return (f", measured {n} times (before part b and after each of its nets; shares are taken "
            f"against the best run)" if n > 1 else "")


def peak_lines(results):
    """The machine's GEMM peak, and the per-call one where a call runs on fewer threads."""
    m = results["meta"]
    lines = []
    peak = results.get("gemm_peak")
    if peak:
        lines += ["", f"GEMM peak (float32 {peak['size']}³ numpy matmul, {m['threads']} threads): "
                      f"{peak['peak']:.0f} GFLOP/s best run, {mm(peak)} over "
                      f"{len(peak['runs'])} runs" + _sampled(peak) + "."]
    call_peak = results.get("gemm_peak_call")
    if call_peak and call_peak.get("threads") != m.get("threads"):
        alone = results.get("gemm_peak_call_alone")
        at_once = (f", {call_peak['calls']} at once, one per core" if call_peak.get("calls")
                   else "")
        lines += ["", f"Per-call GEMM peak ({call_peak['threads']} thread{at_once}: the engine runs "
                      f"one GEMM per core while it splits the batch over cores): "
                      f"{call_peak['peak']:.0f} GFLOP/s best run, {mm(call_peak)}"
                      + _sampled(call_peak)
                      + (f"; one such call alone on the machine: {alone['peak']:.0f} GFLOP/s"
                         if alone else "") + "."]
    return lines


def throughput_lines(thr):
    """Part a: images/s of each bench net, the engine beside PyTorch CPU."""
    if not thr:
        return []
    lines = ["", "## a. Training throughput (images/s, forward + backward + update)", "",
             "| net | batch | engine | PyTorch CPU | engine / PyTorch |", "|---|---|---|---|---|"]
    for r in thr.values():
        lines.append(f"| {r['net']} | {r['batch']} | {mm(r['engine'])} | "
                     f"{mm(r['torch']) if r['torch'] else 'not measured'} | "
                     f"{r['ratio']:.2f}x |" if r["ratio"] is not None else
                     f"| {r['net']} | {r['batch']} | {mm(r['engine'])} | not measured "
                     f"({r.get('torch_note')}) | - |")
    return lines


def layers_lines(layers):
    """Part b: per net, a table of its layers and a sentence summing them up."""
    if not layers:
        return []
    lines = ["", "## b. Per-layer times (ms per iteration) and share of the GEMM peak", ""]
    for net in layers.values():
        lines += [f"### {net['net']}", "",
                  "| layer | type | forward ms | backward ms | PyTorch fwd / bwd ms | GFLOP "
                  "fwd/bwd | GFLOP/s fwd/bwd | peak share | GEMM calls GFLOP/s (per-call peak "
                  "share) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [_layer_row(r) for r in net["layers"]
                  if not (r["forward_ms"]["median"] < 0.005 and r["backward_ms"]["median"] < 0.005)]
        lines.append(f"| (solver update) | | | {mm(net['update_ms'], '{:.2f}')} | | | | | |")
        lines += ["", _layers_sum(net), ""]
    return lines


def _layer_row(r):
    """One layer's row of part b's table."""
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
    return (f"| {r['name']} | {kind} | {mm(r['forward_ms'], '{:.2f}')} | "
            f"{mm(r['backward_ms'], '{:.2f}')} | {torch_ms} | {gf} | {rate} | "
            f"{share} | {call} |")


def _layers_sum(net):
    """The sentence under a net's table: its step summed, the GEMM layers' share of the peak,
    what the GEMM calls themselves reached and PyTorch's layer-by-layer sum."""
    share = net.get("gemm_layers_peak_share")
    return (f"Sum: forward {net['forward_ms']:.1f} ms, backward "
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
               f"not included)." if net.get("torch_layers_ms") else ""))


def real_nets_lines(real):
    """Part f: each deploy net's forward + backward beside PyTorch's, with its costliest layer
    types."""
    if not real:
        return []
    lines = ["## f. Real networks, forward + backward (batch statistics, no update)", "",
             "| deploy file | batch | engine ms | PyTorch CPU ms | engine / PyTorch (per "
             "round) | engine's largest layer types, ms forward / backward |",
             "|---|---|---|---|---|---|"]
    for r in real:
        top = sorted(r["by_type_ms"].items(), key=lambda kv: -sum(kv[1]))[:3]
        kinds = "; ".join(f"{k} {f:.0f} / {b:.0f}" for k, (f, b) in top)
        if r["ratio"] is None:
            lines.append(f"| {r['model']} | {r['batch']} | {mm(r['engine_ms'])} | not "
                         f"measured ({r.get('torch_note')}) | - | {kinds} |")
            continue
        lines.append(f"| {r['model']} | {r['batch']} | {mm(r['engine_ms'])} | "
                     f"{mm(r['torch_ms'])} | {r['ratio']:.2f}x ({min(r['ratio_rounds']):.2f}"
                     f"–{max(r['ratio_rounds']):.2f}) | {kinds} |")
    lines += ["", "PyTorch's graph is built from the same prototxt (tools/bench/model_ref.py): "
                  "a BatchNorm and its Scale as one affine BatchNorm2d, ReLUs in place where "
                  "Caffe's are. `python -m poseidon.tools.bench.model_ref MODEL --profile` gives one "
                  "net's per-type times beside PyTorch's own profile.", ""]
    return lines


def unpinned_lines(unpinned):
    """Part a again with OpenBLAS's core type and cache size left to OpenBLAS (--unpinned)."""
    if not unpinned:
        return []
    lines = ["## Unpinned OpenBLAS (OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset)", ""]
    if unpinned.get("status") != "measured":
        return lines + [why(unpinned), ""]
    lines += [f"Kernel {unpinned['blas'].get('kernel')}, GEMM peak "
              f"{unpinned['gemm_peak']['peak']:.0f} GFLOP/s.", "",
              "| net | engine | PyTorch CPU | ratio |", "|---|---|---|---|"]
    for r in unpinned["throughput"].values():
        lines.append(f"| {r['net']} | {mm(r['engine'])} | "
                     f"{mm(r['torch']) if r['torch'] else '-'} | "
                     + (f"{r['ratio']:.2f}x |" if r.get("ratio") else "- |"))
    return lines + [""]


def gpu_lines(gpu):
    """Part a on a GPU (--gpu): the engine on CuPy beside PyTorch CUDA."""
    if not gpu:
        return []
    lines = ["## GPU", ""]
    if gpu.get("status") != "measured":
        return lines + [why(gpu), ""]
    lines += ["| net | engine (CuPy) | PyTorch CUDA | ratio |", "|---|---|---|---|"]
    for r in gpu["throughput"].values():
        lines.append(f"| {r['net']} | {mm(r['engine'])} | "
                     f"{mm(r['torch']) if r['torch'] else '-'} | "
                     f"{r['ratio']:.2f}x |" if r["ratio"] else "-")
    precision = {"tf32": "TF32 GEMMs on both sides",
                 "fp32": "full FP32 on both sides"}.get(gpu.get("precision"), "-")
    return lines + ["", f"Device: {gpu.get('device')}; precision: {precision}", ""]
