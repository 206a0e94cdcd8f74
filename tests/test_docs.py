"""The user documentation stays documentation.

README.md and docs/*.md hold what a user needs now: current figures with the command that reproduces
them, the design and its reasons. The history of how they came about is in git, so these files carry
no run timestamps, no commit ids and no issue or work-period numbers. The README stays short enough
to read in one sitting, the architecture map names paths that exist, and every command the CLI
offers is in the README. The code's own pointers stay true too: every docs/*.md and every engine/
or dist/ path a module names exists, and the engine names no dist module.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README_MAX_LINES = 200

# What a line of user documentation must not carry, each with the name a failure reports.
BOOKKEEPING = [
    ("a date", re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")),
    # hh:mm (optionally :ss, optionally UTC); not the tail of file:line:col or host:port
    ("a time of day", re.compile(r"(?<![\w:.])(?:[01]\d|2[0-3]):[0-5]\d(?::[0-5]\d)?(?![\w:])")),
    # 7 to 40 hex characters with at least one digit and one letter, as a word
    ("a commit id", re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")),
    ("an issue reference", re.compile(r"\b(?:issues?|PR|pull requests?)\s*#?\d+", re.I)),
    ("a work-period reference",
     re.compile(r"\b(?:sessions?|work periods?|items?)\s*#?\d+", re.I)),
    # "#12" as an issue; Caffe's own log lines ("Test net output #0", "net (#0)", "param #0") stay
    ("an issue number",
     re.compile(r"(?<![\w&/])(?<!net )(?<!net \()(?<!output )(?<!param )#\d+\b")),
]


def bookkeeping_in(text):
    """[(line number, what, matched text)] for every bookkeeping reference in text."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in BOOKKEEPING:
            found += [(number, what, m.group(0)) for m in pattern.finditer(line)]
    return found


def doc_files():
    return [README] + sorted((ROOT / "docs").glob("*.md"))


# The references below are written in pieces, so that a search of the code for such references
# finds the checker's own examples nowhere.
@pytest.mark.parametrize("text", [
    "the full run (2026-11-27, 830 s)",
    "measured at 02:29 UTC on the bench machine",
    "at 20:42 the peak measured 87 GFLOP/s",
    "the same command on commit bbd9740",
    "see 1ad22cc4f0e2b9d7c1a3e5f7b9d1c3e5f7a9b1c3",
    "bad input everywhere (issue " "5, item " "6)",
    "fixed in issue #12",
    "what session " "3 measured",
    "see #12 for the discussion",
])
def test_the_checker_finds_bookkeeping(text):
    assert bookkeeping_in(text), f"not caught: {text!r}"


@pytest.mark.parametrize("text", [
    "Final test accuracy (net #0): 0.98",
    "Iteration 10, Testing net (#0)",
    "    Test net output #0: accuracy = 0.97",
    "layer 'ip1' param #0 has NaN",
    "--coordinator tcp://node1:5555 and tcp://10.0.0.1:5555",
    "solver.prototxt:12:30: unknown field",
    "float64 agrees to 1e-12; deadbeef; cafe; 0.58 MB; 1,211 img/s",
    "session = dist.init(); the issues a job can meet",
    "mean 0.1307, std 1234567",
])
def test_the_checker_leaves_documentation_alone(text):
    assert bookkeeping_in(text) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_bookkeeping_in_user_docs(path):
    found = bookkeeping_in(path.read_text(encoding="utf-8"))
    where = path.relative_to(ROOT).as_posix()
    assert not found, (f"{where} cites the project's bookkeeping (history lives in git; keep the "
                       f"current figure and how to reproduce it):\n" +
                       "\n".join(f"  {where}:{n}: {what}: {hit!r}" for n, what, hit in found))


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, over {README_MAX_LINES}: move "
                                       f"the detail into docs/ and link to it")


def architecture_map():
    """The paths in the second column of docs/architecture.md's tables, with their line numbers."""
    paths = []
    for number, line in enumerate(ARCHITECTURE.read_text(encoding="utf-8").splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) < 2 or set(cells[1]) <= set("-: "):
            continue
        paths += [(number, p) for p in re.findall(r"`([^`]+)`", cells[1])]
    return paths


def test_architecture_map_is_a_table_of_paths():
    paths = [p for _, p in architecture_map()]
    for expected in ("engine/layer.py", "engine/net.py", "engine/solvers/solver.py",
                     "dist/worker/hooks.py", "dist/kv/store.py", "dist/job/launch.py", "tools/cli.py"):
        assert expected in paths, f"docs/architecture.md's map lacks {expected}"


def test_architecture_map_names_paths_that_exist():
    missing = []
    for number, path in architecture_map():
        target = ROOT / path
        exists = target.is_dir() if path.endswith("/") else target.is_file()
        if not exists:
            missing.append(f"docs/architecture.md:{number}: {path}")
    assert not missing, ("the architecture map names paths that are not in the repository (move "
                         "the map with the code):\n  " + "\n  ".join(missing))


def test_doc_links_point_at_files_that_exist():
    broken = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for target in set(re.findall(r"\bdocs/[\w.-]+\.md\b", text)):
            if not (ROOT / target).is_file():
                broken.append(f"{path.relative_to(ROOT).as_posix()}: {target}")
        for target in set(re.findall(r"\]\(([\w./-]+\.md)\)", text)):
            if not (path.parent / target).is_file():
                broken.append(f"{path.relative_to(ROOT).as_posix()}: ({target})")
    assert not broken, "links to documents that do not exist:\n  " + "\n  ".join(sorted(broken))


def test_readme_shows_every_command():
    from poseidon.tools.cli import build_parser
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    text = README.read_text(encoding="utf-8")
    missing = [c for c in commands if not re.search(rf"\bposeidon {c}\b", text)]
    assert not missing, f"README.md does not show these commands: {', '.join(missing)}"


# ----- the code's references to documents and to its own files -----------------------------------
# Comments and docstrings point readers at docs/*.md and at other modules; when a file moves or a
# document is merged away the pointer goes stale without anything failing. So every such reference
# in the code must name something that exists.
CODE_DIRS = ("engine", "dist", "tools", "models")
DOC_REF = re.compile(r"(?<![\w./-])docs/[\w.-]+\.md\b")
# engine/... or dist/...: a folder (ending in /), a file (a.py, caffe.proto), or a module and a
# name in it (dist/worker/hooks.spin_seconds). Words without a dot or a trailing slash are prose.
REPO_REF = re.compile(r"(?<![\w./-])((?:engine|dist)/(?:[\w-]+/)*(?:[\w-]+(?:\.\w+)+)?)(?![\w/-])")


def repo_ref_exists(ref, root=ROOT):
    """Whether a path reference of the code names a folder, a file, or a module and a name
    defined in it (the name must appear in the module's text)."""
    if ref.endswith("/"):
        return (root / ref).is_dir()
    if (root / ref).exists():
        return True
    if ref.endswith(".py"):
        return False
    module, name = ref.split(".", 1)
    name = name.split(".")[0]
    for path in (root / f"{module}.py", root / module / "__init__.py"):
        if path.is_file():
            return re.search(rf"\b{re.escape(name)}\b", path.read_text(encoding="utf-8")) is not None
    return False


def broken_refs_in(text, root=ROOT):
    """[(line number, reference)] for every docs/*.md or engine/, dist/ path in text that does not
    exist under root."""
    broken = []
    for number, line in enumerate(text.splitlines(), 1):
        broken += [(number, m.group(0)) for m in DOC_REF.finditer(line)
                   if not (root / m.group(0)).is_file()]
        broken += [(number, m.group(1)) for m in REPO_REF.finditer(line)
                   if not repo_ref_exists(m.group(1), root)]
    return broken


# Written in pieces, as above, so that a search of the code for stale names does not find these.
@pytest.mark.parametrize("text", [
    "see docs/" "benchmarks.md for the table",
    "(docs/" "benchmark-history.md, \"Winograd for wide 3x3 layers\")",
    "which dist/" "sfb.py broadcasts instead of the gradient",
    "a server's shared memory (dist/" "kvshm.py)",
    "the layers in engine/layers/" "conv.py",
    "the frequency route (engine/layers/conv_" "fourier.py)",
    "the worker's hooks (dist/worker/hooks.spin_" "forever)",
    "the profiles in dist/" "profile/",
])
def test_the_reference_checker_finds_stale_paths(text):
    assert broken_refs_in(text), f"not caught: {text!r}"


@pytest.mark.parametrize("text", [
    "docs/performance.md, \"InnerProduct and the GEMM share\"",
    "a server's shared memory (dist/transport/onehost/kvshm.py).",
    "the layers in engine/layers/conv/ and engine/parallel.py:",
    "has a core for every process of the job (dist/worker/hooks.spin_seconds)",
    "never writes a worker's region (dist/kv/store.KVServer.gradient_sum)",
    "edit engine/proto/caffe.proto, then regenerate",
    "like one of ours (engine.py, dist/, numpy.py)",
    "engine/PyTorch speed: 1.10x",
])
def test_the_reference_checker_leaves_true_paths_alone(text):
    assert broken_refs_in(text) == []


def code_files():
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))


def test_code_references_point_at_files_that_exist():
    broken = []
    for path in code_files():
        where = path.relative_to(ROOT).as_posix()
        broken += [f"{where}:{n}: {ref}"
                   for n, ref in broken_refs_in(path.read_text(encoding="utf-8"))]
    assert not broken, ("the code names documents or files that are not in the repository (point "
                        "the reference where the thing now lives):\n  " + "\n  ".join(broken))


def test_engine_names_no_dist_module():
    """The engine knows nothing of distribution: its comments say what it offers (sufficient
    factors, hooks, blobs placed in shared memory), not which dist module uses it, so that dist
    can move without the engine's text going stale."""
    named = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"(?<![\w./-])(?:dist/|poseidon\.dist\b)", line):
                named.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {line.strip()}")
    assert not named, ("the engine names dist modules; say what the engine offers instead:\n  " +
                       "\n  ".join(named))
