"""`poseidon plot`: a real log of a short `poseidon train` run of the digits demo (20 iterations, a
test every 10), parsed into the values its lines print, drawn to a valid PNG and written as CSV; a
distributed log's rank tags; matplotlib missing; and bad input, one clear line naming the file.

The run and the PNG go through the command line as a user runs it (a subprocess); the other cases
call `poseidon.tools.cli.main` in this process, which prints errors exactly as the command does.
"""
import csv
import math
import re
import sys

import pytest

from poseidon.engine.errors import PoseidonError
from poseidon.tools.cli import main
from poseidon.tools.logparse import parse_lines, parse_log
from tests.tools.test_cli import ok, poseidon, solver_copy

NUMBER = r"[-+\d.e]+|nan|inf"


@pytest.fixture(scope="module")
def train_log(tmp_path_factory):
    """(path, text) of the stderr of `poseidon train` on the digits set: display every 5, test at
    0, 10 and 20 (two test batches)."""
    work = tmp_path_factory.mktemp("plot")
    ok(poseidon("data", "digits", "data/digits", "--shards", 1, cwd=work))
    solver = solver_copy(work, "short.prototxt", max_iter=20, test_interval=10, test_iter=2,
                         display=5, snapshot=0, snapshot_after_train="false")
    result = ok(poseidon("train", "--solver", solver, "--no-progress", cwd=work))
    path = work / "train.log"
    path.write_text(result.stderr)
    return path, result.stderr


def printed(text):
    """What the log's lines say, read line by line: {iteration: displayed loss},
    {iteration: train net loss}, {iteration: (test accuracy, test loss)}."""
    displayed, train_net, tests = {}, {}, {}
    iteration, testing = None, None
    for line in text.splitlines():
        shown = re.search(rf"Iteration (\d+)( \(.*\))?, loss = ({NUMBER})$", line)
        if shown:
            iteration = int(shown.group(1))
            displayed[iteration] = float(shown.group(3))
        started = re.search(r"Iteration (\d+), Testing net \(#0\)$", line)
        if started:
            testing = int(started.group(1))
            tests[testing] = [None, None]
        output = re.search(rf"(Train|Test) net output #(\d): (\w+) = ({NUMBER})( \(.*\))?$", line)
        if output and output.group(1) == "Train":
            train_net[iteration] = float(output.group(4))
        elif output:
            tests[testing][int(output.group(2))] = float(output.group(4))
    return displayed, train_net, {it: tuple(v) for it, v in tests.items()}


@pytest.mark.slow
def test_parses_the_values_a_real_log_prints(train_log):
    path, text = train_log
    log = parse_log(str(path))
    assert log.columns() == ["iteration", "train_loss", "train_net_loss", "test_accuracy",
                             "test_loss"]
    assert log.iterations() == [0, 5, 10, 15, 20]
    displayed, train_net, tests = printed(text)
    assert sorted(displayed) == [0, 5, 10, 15, 20] and sorted(tests) == [0, 10, 20]
    assert log.curve("train_loss").points == displayed
    assert log.curve("train_net_loss").points == train_net        # not after the last step
    assert sorted(train_net) == [0, 5, 10, 15]
    assert log.curve("test_accuracy").points == {it: v[0] for it, v in tests.items()}
    assert log.curve("test_loss").points == {it: v[1] for it, v in tests.items()}
    assert all(0 <= v <= 1 for v in log.curve("test_accuracy").points.values())
    assert log.rows()[1] == [5, displayed[5], train_net[5], None, None]


@pytest.mark.slow
def test_png_and_csv_from_the_command_line(train_log):
    pytest.importorskip("matplotlib")
    from PIL import Image
    path, _ = train_log
    result = ok(poseidon("plot", path.name, "--csv", "rows.csv", cwd=path.parent))
    assert result.stdout.splitlines() == [
        "Wrote rows.csv (5 rows, columns iteration, train_loss, train_net_loss, test_accuracy, "
        "test_loss)",
        "Wrote train.png (train_loss, test_accuracy, test_loss over iterations 0-20)"]
    png = path.parent / "train.png"                  # the default: the log's name with .png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        image.verify()
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (800, 500)
        shades = sum(1 for n in image.convert("L").histogram() if n)
        assert shades > 10                                       # curves drawn, not a blank canvas
    with open(path.parent / "rows.csv", newline="") as f:
        rows = list(csv.reader(f))
    log = parse_log(str(path))
    assert rows[0] == log.columns()
    assert rows[1:] == [["" if v is None else repr(v) for v in row] for row in log.rows()]
    accuracy = log.curve("test_accuracy").points
    assert [float(r[3]) for r in rows[1:] if r[3]] == list(accuracy.values())


@pytest.mark.slow
def test_out_names_the_png(train_log, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _ = train_log
    assert main(["plot", str(path), "--out", str(tmp_path / "curve.png")]) == 0
    assert capsys.readouterr().out.startswith(f"Wrote {tmp_path / 'curve.png'} (")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def tagged(text, tag, change=None):
    lines = [f"[{tag}] {line}" for line in text.splitlines()]
    return [change(line) if change else line for line in lines]


@pytest.mark.slow
def test_a_distributed_log_is_read_by_rank(train_log):
    """Every role's lines carry its tag and interleave; worker 0's are kept unless --rank says."""
    path, text = train_log
    alone = parse_log(str(path))
    other = tagged(text, "worker 1", lambda line: re.sub(r"accuracy = \S+", "accuracy = 0.5", line))
    server = ["[server 0] I1127 07:30:14.840284 26970 session.py:137] server 0: 10 KV pairs"] * 3
    mixed = ["poseidon: 2 worker(s) and 1 server(s) on this machine"]
    for row in zip(tagged(text, "worker 0"), other, server + [""] * len(other)):
        mixed.extend(row)
    log = parse_lines(mixed, source="job.log")
    assert log.tag == "worker 0"
    assert log.columns() == alone.columns() and log.rows() == alone.rows()
    second = parse_lines(mixed, source="job.log", rank="worker 1")
    assert set(second.curve("test_accuracy").points.values()) == {0.5}
    assert second.curve("train_loss").points == alone.curve("train_loss").points
    short = parse_lines(tagged(text, "w0"), source="job.log")     # the short tag form
    assert short.tag == "w0" and short.rows() == alone.rows()
    with pytest.raises(PoseidonError, match=r"job\.log: no training line is tagged \[worker 7\]; "
                                            r".*'worker 0', 'worker 1'"):
        parse_lines(mixed, source="job.log", rank="worker 7")


def test_caffe_lines_of_other_shapes():
    """Two test nets, a blob of two values, the last step's loss line, nan, a resumed run (the
    later value of an iteration wins), lines without glog's header, an output before any test."""
    log = parse_lines([
        "    Test net output #0: accuracy = 0.9",          # before any test: nowhere to go
        "Iteration 0, Testing net (#0)",
        "    Test net output #0: accuracy = 0.1",
        "    Test net output #1: prob = 0.25",
        "    Test net output #2: prob = 0.75",
        "Iteration 0, Testing net (#1)",
        "    Test net output #0: accuracy = 0.2",
        "Iteration 0 (0 iter/s, 0.1s/10 iters), loss = 2.5",
        "Iteration 10 (9 iter/s, 1.1s/10 iters), loss = nan\r",
        "Iteration 10, loss = 1.5e-01",
        "Iteration 10, lr = 0.01",
        "    Train net output #0: loss = 0.125 (* 1 = 0.125 loss)",
        "I1127 07:28:55.867942 23160 solver.py:362] Iteration 20, loss = -nan",
    ], source="caffe.log")
    assert log.columns() == ["iteration", "train_loss", "train_net_loss", "test_accuracy",
                             "test_prob#1", "test_prob#2", "test1_accuracy"]
    rows = log.rows()
    assert rows[:2] == [[0, 2.5, None, 0.1, 0.25, 0.75, 0.2], [10, 0.15, 0.125] + [None] * 4]
    assert rows[2][0] == 20 and math.isnan(rows[2][1]) and rows[2][2:] == [None] * 5


def one_error_line(result, err, *patterns):
    assert result == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("poseidon plot: error: "), lines[0]
    for pattern in patterns:
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    return lines[0]


def hide_matplotlib(monkeypatch):
    """Imports of matplotlib (and of its already imported modules) fail as if it were absent."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + \
            ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.slow
def test_without_matplotlib_one_line_says_how_to_install(train_log, tmp_path, capsys,
                                                         monkeypatch):
    path, _ = train_log
    hide_matplotlib(monkeypatch)
    result = main(["plot", str(path), "--out", str(tmp_path / "curve.png")])
    one_error_line(result, capsys.readouterr().err, "needs matplotlib",
                   re.escape("pip install 'poseidon-caffe[plot]'"))
    assert not (tmp_path / "curve.png").exists()
    # --csv alone still works, and says how to get the PNG
    assert main(["plot", str(path), "--csv", str(tmp_path / "rows.csv")]) == 0
    said = capsys.readouterr()
    assert said.err == "" and (tmp_path / "rows.csv").read_text().startswith("iteration,")
    assert said.out.splitlines()[-1].startswith("No PNG: drawing it needs matplotlib: pip install")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "folder", "no training line", "binary", "rank",
                                  "out is the log"])
def test_bad_input_gives_one_line_naming_the_file(case, train_log, tmp_path, capsys):
    path, _ = train_log
    argv, patterns = {
        "missing": ([str(tmp_path / "nope.log")], [r"nope\.log: no such log file", "check"]),
        "folder": ([str(tmp_path)], [re.escape(str(tmp_path)), "is a folder", "give"]),
        "no training line": ([str(solver_copy(tmp_path, "solver.log"))],
                             [r"solver\.log: no training log line found", "give the log"]),
        "binary": ([str(tmp_path / "weights.log")], [r"weights\.log: no training log line"]),
        "rank": ([str(path), "--rank", "worker 3"], [r"train\.log: no training line is tagged "
                                                     r"\[worker 3\]", "untagged", "give"]),
        "out is the log": ([str(path), "--out", str(path)], [r"train\.log: the PNG would "
                                                             r"overwrite the log", "give --out"]),
    }[case]
    (tmp_path / "weights.log").write_bytes(bytes(range(256)) * 8)
    one_error_line(main(["plot", *argv]), capsys.readouterr().err, *patterns)
    assert path.read_text().startswith("I")                        # the log is left as it was
