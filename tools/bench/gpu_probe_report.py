"""results.md of the device probe (tools/bench/gpu_probe.py): its results.json read for a person.

Every part's section says what the part found, or its status and last lines when it failed or ran
out of time, so a short loan of a GPU still leaves a readable page.
"""


def _ms(value):
    return "-" if value is None else f"{value:.1f}"


def _speed(value):
    return "-" if value is None else f"{value:.2f}x"


def _env(rec):
    lines = [f"- device: {rec.get('device')} (compute capability {rec.get('compute_capability')}, "
             f"{rec.get('memory_gib')} GiB)",
             f"- CuPy {rec.get('cupy')}, CUDA runtime {rec.get('cuda_runtime')}, driver "
             f"{rec.get('cuda_driver')}; PyTorch {rec.get('torch')} (CUDA {rec.get('torch_cuda')}); "
             f"numpy {rec.get('numpy')}; Python {rec.get('python')}"]
    lines += [f"- skipped: {s}" for s in rec.get("skipped", [])]
    return lines


def _tests(rec):
    lines = [f"- `{rec.get('command')}`: exit {rec.get('rc')}; {rec.get('summary')}"]
    return lines + [f"  - {f}" for f in rec.get("failures", [])]


def _layers(rec):
    cases = rec.get("cases", [])
    bad = [c for c in cases if c.get("status") != "ok"]
    lines = [f"- {len(cases) - len(bad)} of {len(cases)} configurations match numpy"]
    lines += [f"  - {c['case']}: {c['status']} {c.get('error', c.get('max_rel_err', ''))}"
              for c in bad]
    if rec.get("unchecked_types"):
        lines.append(f"- layer types no configuration covers: {', '.join(rec['unchecked_types'])}")
    kernels = rec.get("kernels")
    if isinstance(kernels, dict):
        lines += [f"- kernels: {k}: {v}" for k, v in kernels.items()]
    return lines


def _timings(rec):
    lines = ["| net | batch | engine FP32 ms | PyTorch FP32 ms | engine speed | engine TF32 ms | "
             "PyTorch TF32 ms | engine speed |", "|---|---|---|---|---|---|---|---|"]
    for row in rec.get("rows", []):
        if row.get("status") != "measured":
            lines.append(f"| {row['net']} | {row['batch']} | {row.get('status')} |||||| ")
            continue
        cells = []
        for precision in ("fp32", "tf32"):
            r = row.get(precision, {})
            cells += [_ms(r.get("engine")), _ms(r.get("torch")),
                      _speed(r.get("engine_speed_vs_torch"))]
        lines.append(f"| {row['net']} | {row['batch']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("ms per training step (forward, backward, update), median of the turns; engine "
                 "speed = PyTorch ms / engine ms." + (f" {rec['torch_note']}"
                                                      if rec.get("torch_note") else ""))
    return lines


def _launches(rec):
    stand_in = rec.get("stand_in") or {}
    lines = [f"- counting stand-in (CPU, same routes): {stand_in.get('launches_per_step')} "
             f"launches and {stand_in.get('host_syncs_per_step')} host syncs per step"]
    for key, label in (("engine_step", "engine on the GPU"), ("torch_step", "PyTorch")):
        seen = rec.get(key)
        if isinstance(seen, dict):
            lines.append(f"- {label}, one step as CUPTI saw it: {seen.get('kernels')} kernels, "
                         f"{seen.get('memcpy')} copies, {seen.get('memset')} memsets")
    if rec.get("profiler"):
        lines.append(f"- {rec['profiler']}")
    return lines


def _layer_times(rec):
    lines = []
    for net, found in (rec.get("nets") or {}).items():
        if not isinstance(found, dict):
            lines.append(f"- {net}: {found}")
            continue
        lines.append(f"- {net}: {found['total_ms']:.1f} ms in the layers; slowest: " + ", ".join(
            f"{name} ({kind}) {f:.2f}+{b:.2f}" for name, kind, f, b in found["slowest"][:6]))
    return lines


def _capture(rec):
    lines = []
    if "step_ms_graphs_off" in rec:
        lines.append(f"- cifar10_quick step: {_ms(rec['step_ms_graphs_off'])} ms eager, "
                     f"{_ms(rec.get('step_ms_graphs_on'))} ms with --cuda-graphs on "
                     f"({rec.get('graph_segments', '?')} graphs)")
    if "step_graphs_error" in rec:
        lines.append(f"- --cuda-graphs on failed: {rec['step_graphs_error']}")
    if rec.get("captured") and "replay_ms" in rec:
        return lines + [f"- captured and replayed: {rec['replay_ms']:.2f} ms per replay, "
                        f"{_ms(rec.get('eager_ms'))} ms eager"]
    return lines + [f"- captured: {rec.get('captured')}; {rec.get('error', '')}"]


SECTIONS = {"env": ("Environment", _env), "tests": ("GPU tests", _tests),
            "layers": ("Layers on CuPy against numpy", _layers),
            "timings": ("Engine beside PyTorch CUDA", _timings),
            "launches": ("Launches of one cifar10_quick step", _launches),
            "layer_times": ("Per-layer times (CUDA events)", _layer_times),
            "capture": ("CUDA graph capture", _capture)}


def markdown(results):
    lines = [f"# GPU probe, GPU {results.get('gpu')}", "",
             f"Started {results.get('started')}; parts' budget {results.get('budget_s')} s.", "",
             "| part | status | seconds | limit |", "|---|---|---|---|"]
    parts = results.get("parts", {})
    for name, part in parts.items():
        lines.append(f"| {name} | {part.get('status')} | {part.get('seconds', '-')} | "
                     f"{part.get('limit_s', '-')} |")
    for name, part in parts.items():
        title, render = SECTIONS.get(name, (name, None))
        lines += ["", f"## {title}", ""]
        record = part.get("record") or {}
        if part.get("status") != "ok":
            lines.append(f"{part.get('status')}: "
                         + " / ".join(part.get("last_lines") or [part.get("reason", "")]))
        if record and render is not None:
            try:
                lines += render(record)
            except (KeyError, TypeError, ValueError) as e:   # a record cut short
                lines.append(f"(record incomplete: {type(e).__name__}: {e})")
    return "\n".join(lines) + "\n"
