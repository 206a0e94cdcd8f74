"""Part g's section of results.md (tools/bench/hosts_part.py): each job across emulated hosts beside
the token bucket's figure for the same job, the ratio of the two per mode, and what tc counted on
the links against what the jobs counted. A module of its own so that report.py stays readable."""

TITLE = "**g. Scaling across emulated hosts** (each rank in its own network namespace, tbf links)"


def _mm(s, fmt):
    if not s:
        return "-"
    text = fmt.format(s["median"])
    if s["min"] != s["max"]:
        text += f" ({fmt.format(s['min'])}–{fmt.format(s['max'])})"
    return text


def _mb(value):
    return "-" if value is None else f"{value / 1e6:.2f}"


def _side(side):
    if not side:
        return "-"
    if side.get("status") != "measured":
        return f"{side.get('status')}: {(side.get('reason') or '')[:100]}"
    return _mm(side["iteration_s"], "{:.3f}")


def _bytes(netns_side):
    """worker 0's MB per iteration, sent / received, by tc and by its stats."""
    b = netns_side.get("worker0_bytes_per_iter") or {}
    return (f"{_mb(b.get('tc_sent'))} / {_mb(b.get('tc_received'))} (stats "
            f"{_mb(b.get('stats_sent'))} / {_mb(b.get('stats_received'))})")


def _lowest(ratios):
    """The lowest link's tc / counted: at least 1 when tc saw every byte the job counted (the
    rest is start-up, the book, heartbeats, TCP's handshakes and resent segments)."""
    return "-" if not ratios else f"{ratios['min']:.3f}"


def markdown_lines(g):
    """The section's lines (a 'not measured' line with the reason when it did not run)."""
    if not g or g.get("status") != "measured":
        why = (f"{g.get('status', 'not measured')}: {g.get('reason', '')}".strip() if g
               else "not measured")
        return [f"{TITLE}: {why}", ""]
    lines = [TITLE, "",
             "| net | workers | mode | netns iteration s | token bucket iteration s | netns / "
             "token bucket | worker 0 MB per iter sent / recv: tc (stats) | tc / the job's count, "
             "whole job, lowest link and way | tbf drops, TCP resent |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in g["rows"]:
        ns = r["netns"]
        measured = ns.get("status") == "measured"
        source = " (part e)" if r.get("token_bucket_from") == "part e" else ""
        lines.append(
            f"| {r['net']} | {r['workers']} | {r['mode']} | {_side(ns)} | "
            f"{_side(r['token_bucket'])}{source} | "
            f"{_mm(r.get('netns_over_token_bucket'), '{:.2f}')} | "
            f"{_bytes(ns) if measured else '-'} | "
            f"{_lowest(ns.get('tc_over_counted')) if measured else '-'} | "
            f"{ns.get('tbf_drops', '-')}, {ns.get('tcp_retransmits', '-')} |")
    per_mode = g.get("netns_over_token_bucket") or {}
    if per_mode:
        lines += ["", "netns / token bucket iteration time per mode (median over the rows): "
                  + "; ".join(f"{mode} {_mm(s, '{:.2f}')}" for mode, s in per_mode.items())]
    figure = g.get("target_figure") or {}
    if any(v is not None for v in figure.values()):
        def text(v):
            return "-" if v is None else f"{v:.2f}"
        lines += ["", f"hybrid / no-overlap ps iteration time, fc_heavy at 4 workers: across "
                      f"emulated hosts {text(figure.get('netns'))}, with the token bucket "
                      f"{text(figure.get('token_bucket'))}"]
    lines += ["", g["note"] + ".", ""]
    return lines
