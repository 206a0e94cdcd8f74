"""The POSEIDON_* variables and their one table (docs/configuration.md, "Environment variables").

Both ways: a variable the package reads and the table lacks fails, and so does a row no code
reads. A variable counts as read where the code of engine/, dist/ or tools/ holds its name as a
string (os.environ.get("POSEIDON_X"), a constant read through later, a tuple of names looped
over), except as the key of an assignment or of setdefault: those write it, for this process's
children or for code that reads it elsewhere. Names in comments and docstrings must be in the table
too, so that the code never sends a reader to a variable that does not exist. And the engine
reads its settings in engine/settings.py alone.
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "configuration.md"
CODE_DIRS = ("engine", "dist", "tools")
NAME = re.compile(r"POSEIDON_[A-Z0-9_]*[A-Z0-9]")
# Where the engine may name a variable: the settings, and the route cache's folder (a path the
# cache opens, not a setting of the computation).
ENGINE_READERS = {"engine/settings.py": None,
                  "engine/layers/conv/route_cache.py": {"POSEIDON_CACHE_DIR"}}


def sources():
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")
                  if "__pycache__" not in p.parts)


def names_read(source):
    """The variable names a module's code reads (see the module's docstring)."""
    tree = ast.parse(source)
    written = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                       else [node.target])
            written |= {id(t.slice) for t in targets if isinstance(t, ast.Subscript)}
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "setdefault" and node.args):
            written.add(id(node.args[0]))
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and NAME.fullmatch(node.value) and id(node) not in written}


def table_names():
    """The first cell of each row of the table, in order."""
    return [m.group(1) for m in re.finditer(r"^\| `(POSEIDON_[A-Z0-9_]+)` \|", TABLE.read_text(),
                                            re.M)]


def read_anywhere():
    found = {}
    for path in sources():
        for name in names_read(path.read_text()):
            found.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    return found


def test_every_variable_read_is_in_the_table():
    missing = {name: where for name, where in read_anywhere().items()
               if name not in table_names()}
    assert not missing, f"read but not in {TABLE.relative_to(ROOT)}'s table: {missing}"


def test_every_row_of_the_table_is_read():
    unread = [name for name in table_names() if name not in read_anywhere()]
    assert not unread, f"rows of {TABLE.relative_to(ROOT)} that no code reads: {unread}"


def test_the_table_names_each_variable_once():
    names = table_names()
    assert len(names) > 10 and len(names) == len(set(names)), names


def test_comments_and_docstrings_name_only_documented_variables():
    table = set(table_names())
    stale = sorted({f"{path.relative_to(ROOT).as_posix()}: {name}" for path in sources()
                    for name in NAME.findall(path.read_text()) if name not in table})
    assert not stale, f"the code names variables the table lacks: {stale}"


def test_the_engine_reads_its_settings_in_one_place():
    elsewhere = []
    for path in (ROOT / "engine").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        names = {node.value for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and NAME.fullmatch(node.value)}
        allowed = ENGINE_READERS.get(rel, set())
        if allowed is not None and names - allowed:
            elsewhere.append(f"{rel}: {sorted(names - allowed)}")
    assert not elsewhere, f"engine modules naming variables outside engine/settings.py: {elsewhere}"


def test_the_scanner_tells_reads_from_writes():
    sample = '''
"""POSEIDON_IN_A_DOCSTRING is not code."""
import os
ENV = "POSEIDON_KEPT"
os.environ.get("POSEIDON_GOT", "")
for name in ("POSEIDON_LOOPED", "OTHER"):
    pass
os.environ["POSEIDON_SET"] = "1"
env = {}
env["POSEIDON_CHILD"] = "2"
os.environ.setdefault("POSEIDON_DEFAULTED", "0")
message = f"POSEIDON_IN_TEXT={ENV}"
'''
    assert names_read(sample) == {"POSEIDON_KEPT", "POSEIDON_GOT", "POSEIDON_LOOPED"}
