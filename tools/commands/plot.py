"""`poseidon plot LOG [--out curve.png] [--csv rows.csv]`: a training log drawn as learning curves.

    poseidon train --solver S > train.log 2>&1   # stderr: one process's log; stdout: a job's
    poseidon plot train.log                      # train.png: loss, and accuracy on a second y axis
    poseidon plot train.log --csv train.csv      # the parsed rows too (the CSV needs no matplotlib)

The log is read by tools/logparse.py (glog lines of `poseidon train` or `caffe train`, a distributed
run's `[worker 0] ` tags included). The PNG draws the training loss and every test output against
the iteration; the outputs named like an accuracy get the right-hand axis, as their scale (0 to 1)
would flatten next to a loss. matplotlib is the `plot` extra; it draws through Agg, so no display
is needed and no pyplot state is left behind.
"""
import csv
import math
from pathlib import Path

from poseidon.engine.errors import PoseidonError

from .common import out

INSTALL = "pip install 'poseidon-caffe[plot]' (or pip install matplotlib)"


def add(sub):
    p = sub.add_parser("plot", help="draw the loss and test outputs of a training log to a PNG")
    p.add_argument("log", metavar="LOG",
                   help="a training log in Caffe's glog format: what `poseidon train` prints on "
                        "stderr (a distributed job: on stdout)")
    p.add_argument("--out", metavar="FILE.png", help="the PNG to write (default: LOG with .png)")
    p.add_argument("--csv", metavar="FILE",
                   help="also write the parsed rows (iteration, train loss, each test output) "
                        "as CSV; works without matplotlib")
    p.add_argument("--rank", metavar="TAG",
                   help="in a distributed job's log, whose tagged lines to read, e.g. 'worker 1' "
                        "(default: the untagged lines, else worker 0's)")
    p.set_defaults(run=run)


def run(args):
    from poseidon.tools.logparse import parse_log
    log = parse_log(args.log, rank=args.rank)
    png = Path(args.out) if args.out else Path(args.log).with_suffix(".png")
    if png.resolve() == Path(args.log).resolve():
        raise PoseidonError(f"{args.log}: the PNG would overwrite the log; give --out FILE.png")
    if args.csv:
        write_csv(log, args.csv)
        out(f"Wrote {args.csv} ({len(log.rows())} rows, columns {', '.join(log.columns())})")
        if not args.out and not matplotlib_present():
            out(f"No PNG: drawing it needs matplotlib: {INSTALL}")
            return 0
    draw(log, png)
    first, last = log.iterations()[0], log.iterations()[-1]
    out(f"Wrote {png} ({', '.join(c.label for c in shown_curves(log))} over iterations "
        f"{first}-{last})")
    return 0


def write_csv(log, path):
    """The rows of `log` under a header line; an iteration without a value leaves the cell empty."""
    try:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(log.columns())
            for row in log.rows():
                writer.writerow(["" if v is None else repr(v) for v in row])
    except OSError as e:
        raise PoseidonError(f"cannot write {path} ({e.strerror}): check that its folder exists "
                            f"and is writable") from None


def matplotlib_present():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _agg_figure():
    """A Figure drawn by Agg; a PoseidonError saying how to install matplotlib when it is absent."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PoseidonError(f"drawing the PNG needs matplotlib, which is not installed: {INSTALL}; "
                            f"--csv FILE writes the parsed rows without it") from None
    figure = Figure(figsize=(8, 5))
    FigureCanvasAgg(figure)
    return figure


def shown_curves(log):
    """The curves the PNG draws: the displayed training loss and every test output. The training
    net's outputs are drawn only when the log has no displayed loss (it is their loss, smoothed
    over average_loss iterations, so both would draw the same curve twice)."""
    from poseidon.tools.logparse import TRAIN_LOSS
    has_loss = log.curve(TRAIN_LOSS) is not None
    return [c for c in log.curves if c.kind != "train_net" or not has_loss or c.is_accuracy]


def _finite(curve):
    """(iterations, values) of a curve, inf as nan: one diverged value must not flatten the rest."""
    its = sorted(curve.points)
    return its, [v if math.isfinite(v) else math.nan for v in (curve.points[i] for i in its)]


def draw(log, png):
    figure = _agg_figure()
    left = figure.add_subplot(1, 1, 1)
    curves = shown_curves(log)
    right = left.twinx() if any(c.is_accuracy for c in curves) else None
    for curve in curves:
        axis = right if curve.is_accuracy else left
        its, values = _finite(curve)
        style = "-" if curve.kind == "train" else "o-"
        axis.plot(its, values, style, markersize=3, linewidth=1.2, label=curve.label,
                  color=f"C{log.curves.index(curve)}")
    from matplotlib.ticker import MaxNLocator
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_xlabel("iteration")
    left.set_ylabel("loss")
    left.grid(alpha=0.3)
    handles, labels = left.get_legend_handles_labels()
    if right is not None:
        right.set_ylabel("accuracy")
        accuracies = [v for c in curves if c.is_accuracy for v in c.points.values()]
        if all(0 <= v <= 1 for v in accuracies):
            right.set_ylim(0, 1)
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    left.legend(handles, labels, loc="best", fontsize="small")
    title = Path(log.source).name + (f" [{log.tag}]" if log.tag else "")
    left.set_title(title)
    figure.tight_layout()
    try:
        figure.savefig(str(png), format="png", dpi=100)
    except OSError as e:
        raise PoseidonError(f"cannot write {png} ({e.strerror}): check that its folder exists and "
                            f"is writable, or give another --out") from None
