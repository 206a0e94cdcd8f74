"""Read a training log, as `poseidon train` (or `caffe train`) writes it on stderr, into curves.

The lines it understands are Caffe's glog lines (the `I1127 07:28:54.243 123 solver.py:511] ` header
may be there or not):

    Iteration 5 (11.5 iter/s, 0.43s/5 iters), loss = 2.30389     the displayed (smoothed) loss
    Iteration 20, loss = 2.30392                                 the same, after the last step
        Train net output #0: loss = 2.30389 (* 1 = 2.30389 loss)  the training net's outputs
    Iteration 10, Testing net (#0)                               a test of net #0 starts
        Test net output #0: accuracy = 0.13                      one output of that test
        Test net output #1: loss = 2.30171 (* 1 = 2.30171 loss)

and any other line naming `Iteration N` moves the current iteration on. A distributed run's lines
carry their role in front (`[worker 0] I1127 ...`, or `[w0] ...`; the launcher prints them on
stdout, so such a log is captured with `> train.log 2>&1`): each tag is read as a stream of its
own, because the roles' lines interleave, and one stream is kept (worker 0 speaks for the job).

Each curve is a map iteration -> value; when an iteration comes twice (a run resumed into the same
log) the later value wins, as it is the one the run went on from. Caffe's tools/extra/parse_log.py
reads the same lines into train and test tables; here the two are one table keyed by iteration, so
one CSV row says everything known about one iteration.

    from poseidon.tools.logparse import parse_log
    log = parse_log("train.log")
    log.columns()   # ['iteration', 'train_loss', 'train_net_loss', 'test_accuracy', 'test_loss']
    log.rows()      # [[0, 2.30258, 2.30258, 0.07, 2.30259], [5, 2.30389, 2.30389, None, None], ...]
"""
import os
import re
from dataclasses import dataclass, field

from poseidon.engine.errors import PoseidonError

NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf)"
RANK_TAG = re.compile(r"^\[([^\]\n]{1,40})\] ?")
ITERATION = re.compile(r"\bIteration (\d+)")
DISPLAYED_LOSS = re.compile(rf"\bIteration (\d+)(?: \([^)]*\))?, loss = ({NUMBER})")
TESTING = re.compile(r"\bIteration (\d+), Testing net \(#(\d+)\)")
NET_OUTPUT = re.compile(rf"\b(Train|Test) net output #(\d+): (\S+) = ({NUMBER})")

TRAIN_LOSS = "train_loss"
KINDS = ("train", "train_net", "test")        # the order of the columns


@dataclass
class Curve:
    """One quantity over iterations. kind: 'train' (the displayed loss), 'train_net' (an output of
    the training net) or 'test'; net: the test net's number; output: the output's #index."""
    kind: str
    name: str
    net: int = 0
    output: int = 0
    label: str = ""
    points: dict = field(default_factory=dict)

    @property
    def is_accuracy(self):
        return "accuracy" in self.name.lower()


@dataclass
class TrainingLog:
    """The curves of one stream of a log, in the order they first appeared, labelled."""
    source: str
    curves: list
    tag: str = ""

    def curve(self, label):
        return next((c for c in self.curves if c.label == label), None)

    def iterations(self):
        return sorted({it for c in self.curves for it in c.points})

    def columns(self):
        return ["iteration"] + [c.label for c in self.curves]

    def rows(self):
        """One row per iteration: the iteration, then each curve's value there or None."""
        return [[it] + [c.points.get(it) for c in self.curves] for it in self.iterations()]


class _Stream:
    """The reading state of one rank's lines: where in training they are, what they have said."""

    def __init__(self):
        self.iteration = None
        self.test_iteration = None
        self.test_net = 0
        self.curves = {}                 # (kind, net, output index) -> Curve

    def add(self, kind, net, output, name, iteration, value):
        curve = self.curves.setdefault((kind, net, output), Curve(kind, name, net, output))
        curve.points[iteration] = value

    def read(self, message):
        found = TESTING.search(message)
        if found:
            self.iteration = self.test_iteration = int(found.group(1))
            self.test_net = int(found.group(2))
            return
        found = DISPLAYED_LOSS.search(message)
        if found:
            self.iteration = int(found.group(1))
            self.add("train", 0, 0, "loss", self.iteration, float(found.group(2)))
            return
        found = NET_OUTPUT.search(message)
        if found:
            phase, index, name, value = found.groups()
            if phase == "Test" and self.test_iteration is not None:
                self.add("test", self.test_net, int(index), name, self.test_iteration, float(value))
            elif phase == "Train" and self.iteration is not None:
                self.add("train_net", 0, int(index), name, self.iteration, float(value))
            return                       # an output before any iteration has no place on a curve
        found = ITERATION.search(message)
        if found:
            self.iteration = int(found.group(1))


def _label(curve, curves):
    """'train_loss', 'train_net_<name>', 'test_<name>' (net #0), 'test<k>_<name>' (net #k); an
    output name that several outputs of one net share (a blob of several values) gets '#index'."""
    if curve.kind == "train":
        return TRAIN_LOSS
    prefix = "train_net" if curve.kind == "train_net" else f"test{curve.net or ''}"
    same = (curve.kind, curve.net, curve.name)
    shared = sum(1 for c in curves if (c.kind, c.net, c.name) == same)
    return f"{prefix}_{curve.name}" + (f"#{curve.output}" if shared > 1 else "")


def _worker_zero_first(item):
    """Order of preference among streams: untagged lines, then worker 0 ('worker 0', 'w0'), then
    the others as they first appeared."""
    order, (tag, _) = item
    digits = re.sub(r"\D", "", tag)
    return (tag != "", not (tag.lower().startswith("w") and digits == "0"), order)


def parse_lines(lines, source="<lines>", rank=None):
    """The TrainingLog of `lines` (an iterable of text lines); `rank`: the tag of the stream to keep
    (e.g. 'worker 1'), by default the untagged lines or worker 0's. Raises PoseidonError naming
    `source` when no line is recognised or no line carries the tag."""
    streams = {}
    for raw in lines:
        for line in raw.splitlines():             # a progress bar's '\r' parts are lines too
            tagged = RANK_TAG.match(line)
            tag = tagged.group(1) if tagged else ""
            streams.setdefault(tag, _Stream()).read(line[tagged.end():] if tagged else line)
    speaking = [(tag, s) for tag, s in streams.items() if s.curves]
    if not speaking:
        raise PoseidonError(
            f"{source}: no training log line found (none reads 'Iteration N (...), loss = X', "
            f"'Iteration N, Testing net (#k)' or 'Test net output #j: name = Y'): give the log "
            f"of a training run (e.g. poseidon train --solver S > train.log 2>&1)")
    if rank is not None:
        chosen = [(tag, s) for tag, s in speaking if tag == rank]
        if not chosen:
            have = ", ".join(f"'{tag}'" if tag else "untagged" for tag, _ in speaking)
            raise PoseidonError(f"{source}: no training line is tagged [{rank}]; the lines with "
                                f"training values are {have}: give one of those to --rank")
    else:
        chosen = [min(enumerate(speaking), key=_worker_zero_first)[1]]
    tag, stream = chosen[0]
    curves = sorted(stream.curves.values(), key=lambda c: (KINDS.index(c.kind), c.net, c.output))
    for curve in curves:
        curve.label = _label(curve, curves)
    return TrainingLog(source=source, curves=curves, tag=tag)


def parse_log(path, rank=None):
    """The TrainingLog of the log file at `path` (see parse_lines); a missing or unreadable file is
    a PoseidonError naming it."""
    if not os.path.exists(path):
        raise PoseidonError(f"{path}: no such log file; check the path (a training log is "
                            f"written by e.g. poseidon train --solver S > train.log 2>&1)")
    if os.path.isdir(path):
        raise PoseidonError(f"{path}: is a folder, not a log file; give the file the training "
                            f"log was written to")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_lines(f, source=path, rank=rank)
    except OSError as e:
        raise PoseidonError(f"{path}: cannot read the log ({e.strerror}); check its "
                            f"permissions") from None
