"""Part h's section of results.md (tools/bench/schemes_part.py): per net, each synchronisation
scheme and PyTorch DDP across the same emulated hosts, the hybrid against the best single scheme and
DDP, and the slow-host case (static against measured cost model)."""
from .report_hosts import _mm

TITLE = "**h. Schemes across emulated hosts, beside PyTorch DDP (gloo)**"
VERDICTS = (("hybrid_over_best_single", "hybrid / best single scheme (iteration time)"),
            ("throughput_over_ddp", "hybrid's throughput / DDP's"),
            ("slow_host_measured_over_static", "slow host: measured / static model (iteration time)"))


def markdown_lines(h):
    if not h or h.get("status") != "measured":
        why = (f"{h.get('status', 'not measured')}: {h.get('reason', '')}".strip() if h
               else "not measured")
        return [f"{TITLE}: {why}", ""]
    lines = [TITLE, "", "| net | mode | slow host | iteration s | worker 0 MB sent per iter | "
                        "schemes (layers) |", "|---|---|---|---|---|---|"]
    for r in h["rows"]:
        if r["status"] != "measured":
            lines.append(f"| {r['net']} | {r['mode']} | {r['slow_host'] or '-'} | {r['status']}: "
                         f"{(r.get('reason') or '')[:120]} | | |")
            continue
        sent = r.get("bytes_sent_per_iter")
        lines.append(f"| {r['net']} | {r['mode']} | {r['slow_host'] or '-'} | "
                     f"{_mm(r['iteration_s'], '{:.3f}')} | "
                     f"{'-' if sent is None else f'{sent / 1e6:.1f}'} | "
                     f"{_schemes(r.get('schemes'))} |")
    for net, v in (h.get("verdicts") or {}).items():
        parts = [f"{label} {v[key]:.2f}" for key, label in VERDICTS if key in v]
        if "best_single" in v:
            parts.append(f"best single: {v['best_single']}, hybrid within its spread or faster: "
                         f"{'yes' if v['hybrid_within_spread_or_faster'] else 'no'}")
        lines += ["", f"{net}: " + "; ".join(parts)]
    lines += ["", f"DDP: {h.get('ddp')}.", "", h["note"] + ".", ""]
    return lines


def _schemes(choices):
    """{layer: scheme} as counts a scheme ('ps 3, sfb 2')."""
    if not choices:
        return "-"
    counts = {}
    for scheme in choices.values():
        counts[scheme] = counts.get(scheme, 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
