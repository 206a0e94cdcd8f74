"""The bench's PNG plots, one function per figure.

matplotlib is an optional dependency (the `bench` extra); it is imported only when plots are
written, and its absence is a clear error that names the fix (or run with --no-plots).
"""
from pathlib import Path


class PlotsUnavailable(RuntimeError):
    pass


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotsUnavailable(
            f"plots need matplotlib, which is not installed ({e}): install the bench extra "
            f"(pip install -e '.[bench]') or run `poseidon bench --no-plots`") from None
    return plt


def plots(results, out_dir):
    """Write the PNG plots; returns their file names."""
    plt = pyplot()
    out_dir = Path(out_dir)
    names = []
    if results.get("throughput"):
        names.append(_throughput(plt, results["throughput"], out_dir))
    for key, net in (results.get("layers") or {}).items():
        names.append(_layers(plt, key, net, out_dir))
    real = [r for r in results.get("real_nets") or [] if r.get("ratio")]
    if real:
        names.append(_real_nets(plt, real, out_dir))
    s = (results.get("distributed") or {}).get("scaling") or {}
    if s.get("status") == "measured":
        names.append(_scaling(plt, s, out_dir))
    return names


def _save(plt, fig, out_dir, name):
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def _throughput(plt, thr, out_dir):
    """Part a: one panel of bars per net, the engine beside PyTorch CPU."""
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
    return _save(plt, fig, out_dir, "throughput.png")


def _layers(plt, key, net, out_dir):
    """Part b: one net's layers as forward and backward bars, the solver's update last."""
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
    return _save(plt, fig, out_dir, f"layers_{key}.png")


def _real_nets(plt, real, out_dir):
    """Part f: the engine / PyTorch speed ratio of each deploy net, 1.0 marked."""
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
    return _save(plt, fig, out_dir, "real_nets.png")


def _scaling(plt, s, out_dir):
    """Part e: iteration time per net and worker count, one bar per mode, on a log scale."""
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
    return _save(plt, fig, out_dir, "scaling.png")
