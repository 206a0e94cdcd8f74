"""`poseidon train` flags and --cost-table files that must stop the launcher with one line before it
starts any process (docs/errors.md, "Distributed flags and cost tables").

Each case runs `poseidon train ...` (poseidon.tools.cli) in a subprocess as a user would, with a
time limit (a FIFO must not hang the test) and a cap on its address space (a huge count must not
take the machine's memory), and checks: a non-zero exit, no traceback, one error line naming the
flag or the file and saying what to do, and no worker or server started. The cases run together,
a few at a time, in one module fixture (each takes well under a second once fixed). The finer
checks of the cost table reader run in this process, on `load_cost_table` itself.
"""
import concurrent.futures
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from poseidon.dist.cost.model import load_cost_table
from poseidon.dist.errors import DistError
from poseidon.dist.job.options import DistOptions
from poseidon.tools import cli

ROOT = Path(__file__).resolve().parents[2]
NET = ('name: "tiny"\n'
       'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }\n'
       'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"\n'
       '  inner_product_param { num_output: 4 } }\n')
SOLVER = ('net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 1\n'
          'snapshot_after_train: false\n')
GOOD_LINK = {"alpha": 1e-4, "beta": 1e9}
TIME_LIMIT_S = 30
MEMORY_CAP = 6 << 30
WHAT_TO_DO = r"\b(give|use|drop|save|remove|check|expected|make)\b"


# `python -m poseidon.tools.cli`, its address space capped first (in the child itself: a
# preexec_fn is unsafe with the threads the cases run on)
CAPPED_CLI = ("import resource, runpy, sys; "
              f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_CAP}, {MEMORY_CAP})); "
              "sys.argv[0] = 'poseidon'; "
              "runpy.run_module('poseidon.tools.cli', run_name='__main__')")


def train(cwd, *flags):
    env = dict(os.environ)
    env.pop("POSEIDON_COST_TABLE", None)
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]]
                                                         if env.get("PYTHONPATH") else []))
    argv = [sys.executable, "-c", CAPPED_CLI, "train", "--solver", "s.prototxt", *flags]
    try:
        return subprocess.run(argv, cwd=str(cwd), env=env, capture_output=True, text=True,
                              timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(argv, "timeout", _text(e.stdout), _text(e.stderr))


def _text(data):
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


def cost_tables(base):
    """The --cost-table files of the cases, in `base`."""
    (base / "not_utf8.json").write_bytes(b'{"default": {"alpha": 1e-4, "beta": 1e9}}\xff\xfe')
    (base / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    (base / "superscript.json").write_text(json.dumps(
        {"default": GOOD_LINK, "links": {"\u00b2->1": GOOD_LINK}}))
    os.mkfifo(base / "fifo.json")


# name -> (flags, what the error line must hold)
CASES = {
    "cost table: not UTF-8": (["--workers", "2", "--cost-table", "not_utf8.json"],
                              [r"not_utf8\.json", "UTF-8"]),
    "cost table: nested 200000 deep": (["--workers", "2", "--cost-table", "deep.json"],
                                       [r"deep\.json", "deep"]),
    "cost table: a link key of a superscript digit": (
        ["--workers", "2", "--cost-table", "superscript.json"],
        [r"superscript\.json", r"\\u00b2->1", "RANK->RANK"]),
    "cost table: /dev/zero": (["--workers", "2", "--cost-table", "/dev/zero"],
                              ["/dev/zero", "not a regular file"]),
    "cost table: a FIFO": (["--workers", "2", "--cost-table", "fifo.json"],
                           [r"fifo\.json", "not a regular file"]),
    "--sync ' ps'": (["--workers", "2", "--sync", " ps"], ["--sync", "' ps'", "space"]),
    "--devices-per-node 100000 (one process)": (
        ["--devices-per-node", "100000"], ["--devices-per-node 100000", "core"]),
    "--devices-per-node 1000000000 (--workers 2)": (
        ["--workers", "2", "--devices-per-node", "1000000000"],
        ["--devices-per-node 1000000000", "core"]),
    "--cost-refresh -1": (["--workers", "2", "--cost-refresh", "-1"],
                          ["--cost-refresh", "'-1'", ">= 1"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("flags")
    (base / "net.prototxt").write_text(NET)
    (base / "s.prototxt").write_text(SOLVER)
    cost_tables(base)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(train, base, *flags) for name, (flags, _) in CASES.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_one_line_before_any_process_starts(name, results):
    result = results[name]
    out, err = result.stdout, result.stderr
    assert result.returncode != "timeout", f"still running after {TIME_LIMIT_S} s\n{out}\n{err}"
    assert "Traceback" not in err, err
    assert result.returncode > 0, f"exit {result.returncode}\n{out}\n{err}"
    assert not re.search(r"\[(worker|server) |worker\(s\) and", out), f"processes started:\n{out}"
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    line = lines[0]
    assert len(line) < 400, line
    for pattern in CASES[name][1]:
        assert re.search(pattern, line), f"{pattern!r} not in {line!r}"
    assert re.search(WHAT_TO_DO, line, re.I), f"the line does not say what to do: {line!r}"


# ----- the same checks from Python, in this process ----------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "-7"])
def test_cost_refresh_states_the_bound_it_holds(capsys, value):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--solver", "s.prototxt", "--workers", "2", "--cost-refresh", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --cost-refresh: expected a number >= 1, got '{value}'" in err, err
    with pytest.raises(DistError, match=r"--cost-refresh: expected a number >= 1"):
        DistOptions(workers=2, cost_refresh=int(value))


@pytest.mark.parametrize("sync", [" ps", "ps ", "ps + sfb", "ps+\tsfb", "hybrid\n"])
def test_sync_with_white_space_is_refused_from_python_too(sync):
    with pytest.raises(DistError, match="white space") as e:
        DistOptions(workers=2, sync=sync)
    assert "\n" not in str(e.value)
    assert DistOptions(workers=2, sync="ps+sfb").sync == "ps+sfb"


# ----- the cost table reader, in this process --------------------------------------------------
def refused(path, *patterns):
    with pytest.raises(DistError) as e:
        load_cost_table(str(path))
    line = str(e.value)
    assert "\n" not in line and len(line) < 400, line
    assert str(path) in line, line
    for pattern in patterns:
        assert re.search(pattern, line), f"{pattern!r} not in {line!r}"
    return line


def table_file(tmp_path, data, name="t.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_cost_table_must_be_a_regular_file_of_bounded_size(tmp_path):
    refused(tmp_path, "not a regular file", "give")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(64 << 20)                        # sparse: takes no disk
    refused(big, "more than", "give")


@pytest.mark.parametrize("key", ["\u00b2->1", "\u0661->2", "0->\uff12", " 0->1", "0 -> 1", "0->1\n",
                                 "-1->2", "0->", "1" * 40 + "->2", "0->1->2"])
def test_cost_table_link_keys_are_ascii_ranks(tmp_path, key):
    refused(table_file(tmp_path, {"default": GOOD_LINK, "links": {key: GOOD_LINK}}),
            "RANK->RANK")


@pytest.mark.parametrize("table, words", [
    ({"default": GOOD_LINK, "links": [1, 2]}, r"links.*an object"),
    ({"default": GOOD_LINK, "links": "0->1"}, r"links.*an object"),
    ({"default": {"alpha": "1e-4", "beta": 1e9}}, r"alpha.*a string.*number"),
    ({"default": {"alpha": 1e-4, "beta": [1e9] * 100_000}}, r"beta.*a list.*number"),
    ({"default": {"alpha": 1e-4, "beta": 0}}, r"beta.*positive"),
    ({"default": {"alpha": -1, "beta": 1e9}}, r"alpha.*non-negative"),
    ({"default": GOOD_LINK, "flops": True}, r"flops.*true.*number"),
    ({"default": {"alpha": 1e-4, "beta": 1e9, "encrypted": "no"}}, r"encrypted.*true or false"),
    ("[]", "empty"),
    ('"a table"', "object"),
])
def test_cost_table_values_of_the_wrong_type(tmp_path, table, words):
    refused(table_file(tmp_path, table), words)


@pytest.mark.parametrize("text", ['{"default": {"alpha": NaN, "beta": 1e9}}',
                                  '{"default": {"alpha": 1e-4, "beta": Infinity}}',
                                  '{"default": {"alpha": 1e-4, "beta": 1e999}}'])
def test_cost_table_numbers_must_be_finite(tmp_path, text):
    refused(table_file(tmp_path, text), "number")


def test_cost_table_of_a_byte_order_mark_and_a_sound_table_loads(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(
        {"default": GOOD_LINK, "links": {"0->2": {**GOOD_LINK, "encrypted": True}}}).encode())
    costs = load_cost_table(str(path))
    assert costs.phases[0]["links"][(0, 2)].encrypted is True
