"""The structure's rules, checked on the source (docs/architecture.md, "Rules the structure keeps"):

- dependencies point one way: the engine imports nothing of dist or tools, dist nothing of tools;
- dist plugs into the engine through the Solver's hooks only: no code under dist/ runs the net's
  forward or backward itself, assigns another object's private fields or methods, or forwards
  attribute access with __getattr__;
- every package folder is installed (setup.cfg lists it), and no module (but the generated schema)
  or function grows past the size a reader can hold: 500 and 60 lines;
- no import cycle anywhere, not even one dodged by an import inside a function;
- dist asks the engine's layers through engine.Layer's protocol, not by probing attributes.
- the tests mirror the package, and every test that runs a job is marked slow.
"""
import ast
import configparser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "dist", "models", "tools", "prototxt")
GENERATED = {"engine/proto/caffe_pb2.py"}
MAX_LINES = 500
MAX_FUNCTION_LINES = 60


def sources(folder):
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(tree, package):
    """Absolute names of what a module imports (relative imports resolved against `package`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module or ""


def module_package(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = ["poseidon"] + list(rel.parts)
    return ".".join(parts if path.name == "__init__.py" else parts[:-1])


@pytest.mark.parametrize("folder,forbidden", [("engine", ("poseidon.dist", "poseidon.tools")),
                                              ("dist", ("poseidon.tools",))])
def test_dependencies_point_one_way(folder, forbidden):
    bad = []
    for path in sources(folder):
        tree = ast.parse(path.read_text())
        for name in imported_modules(tree, module_package(path)):
            if name.startswith(forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_dist_plugs_in_through_the_hooks_only():
    bad = []
    for path in sources("dist"):
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("Forward", "Backward", "BackwardThrough",
                                           "ForwardLayer", "ForwardBackward")):
                bad.append(f"{where}:{node.lineno} calls .{node.func.attr}()")
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if (isinstance(t, ast.Attribute) and t.attr.startswith("_")
                            and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))):
                        bad.append(f"{where}:{node.lineno} assigns another object's {t.attr}")
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__getattr__":
                        bad.append(f"{where}:{item.lineno} {node.name} forwards __getattr__")
    assert not bad, bad


def test_the_mutations_are_caught():
    """The check above is a real check: each kind of violation is found in a sample."""
    sample = ("def f(net, solver):\n    net.BackwardThrough(3)\n    solver._plan = 1\n"
              "class W:\n    def __getattr__(self, n):\n        return n\n")
    kinds = set()
    for node in ast.walk(ast.parse(sample)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "BackwardThrough":
            kinds.add("call")
        if isinstance(node, ast.Assign) and node.targets[0].attr.startswith("_"):
            kinds.add("private")
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            kinds.add("getattr")
    assert kinds == {"call", "private", "getattr"}


def test_every_package_folder_is_installed():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = set()
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            found.add(".".join(["poseidon"] + list(rel.parts)))
    for init in (ROOT / "poseidon").rglob("__init__.py"):    # poseidon/testing, ...
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    assert found - listed == set(), "add these to setup.cfg's packages"
    assert listed - found - {"poseidon"} == set(), "setup.cfg lists packages that do not exist"


def test_nothing_installed_imports_the_tests():
    """The installed packages stand alone: no module of them imports the repository's tests
    (what a bench or a probe shares with the tests lives in poseidon.testing)."""
    bad = []
    for path in [p for folder in FOLDERS + ("poseidon",) for p in sources(folder)]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                    if n == "tests" or n.startswith("tests.")]
    assert not bad, bad


def test_modules_stay_small():
    big = []
    for folder in FOLDERS + ("poseidon",):
        for path in sources(folder):
            rel = path.relative_to(ROOT).as_posix()
            lines = len(path.read_text().splitlines())
            if rel not in GENERATED and lines > MAX_LINES:
                big.append(f"{rel}: {lines} lines")
    assert not big, big


def long_functions(source):
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_functions_stay_short():
    long = [f"{path.relative_to(ROOT)}:{line} {name}: {n} lines"
            for folder in FOLDERS + ("poseidon",) for path in sources(folder)
            if path.relative_to(ROOT).as_posix() not in GENERATED
            for name, line, n in long_functions(path.read_text())]
    assert not long, long


def test_the_length_check_counts_the_whole_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}") == [("f", 1, MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"def f():\n{body[:-len('    x59 = 59')-1]}") == []


def module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts) if rel.parts[0] == "poseidon" else ["poseidon"] + list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(modules):
    """{module: set of the package's modules it imports}, from {module name: (source, is a
    package)}: imports inside functions count as much as those at the top (a function-level
    import that dodges a cycle is still the cycle). `from pkg import name` leans on pkg.name
    when that is a module, else on pkg's __init__."""
    def owner(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (source, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(source)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                 + ([node.module] if node.module else []))
                        if node.level else node.module or "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            edges |= {m for m in map(owner, targets) if m and m != name}
        graph[name] = edges
    return graph


def cycles(graph):
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_cycle_anywhere_in_the_package():
    modules = {module_name(p): (p.read_text(), p.name == "__init__.py")
               for folder in FOLDERS + ("poseidon",) for p in sources(folder)}
    assert not cycles(import_graph(modules)), cycles(import_graph(modules))


def test_a_cycle_dodged_inside_a_function_is_found():
    modules = {"poseidon.a": ("from . import b\n", False),
               "poseidon.b": ("def f():\n    from .a import g\n    return g\n", False),
               "poseidon.c": ("from .a import b\n", False)}
    assert cycles(import_graph(modules)) == [["poseidon.a", "poseidon.b"]]
    modules["poseidon.b"] = ("def f():\n    import json\n    return json\n", False)
    assert cycles(import_graph(modules)) == []


def duck_typed_probes(source):
    """hasattr/getattr-with-a-default on a layer (a name or attribute mentioning layer or
    owner), and type identity against a hooks class: what dist must not ask the engine's objects
    (engine.Layer's protocol and the hooks' capability flags say it instead)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn = getattr(node.func, "id", None)
        if fn in ("hasattr", "getattr") and (fn == "hasattr" or len(node.args) == 3):
            subject = ast.unparse(node.args[0]).lower()
            if "layer" in subject or "owner" in subject:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Call)
                and getattr(node.left.func, "id", None) == "type"
                and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
                and any(ast.unparse(c).endswith("Hooks") for c in node.comparators)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_dist_asks_the_engine_through_its_protocol():
    bad = [f"{p.relative_to(ROOT)}:{line}" for folder in ("dist", "engine") for p in sources(folder)
           for line in duck_typed_probes(p.read_text())
           if folder == "dist" or "Hooks" in line]
    assert not bad, bad


def test_the_probe_check_finds_probes():
    sample = ('def f(layer, rec, hooks):\n    if hasattr(layer, "n_in"):\n        pass\n'
              '    k = getattr(net.layers[0], "k", None)\n    if type(hooks) is SolverHooks:\n'
              '        pass\n    ok = getattr(rec, "scheme", None)\n')
    assert [line.split(":")[0] for line in duck_typed_probes(sample)] == ["2", "4", "5"]


# ------------------------------------------------------------------------------------------------
# the tests' own layout
# ------------------------------------------------------------------------------------------------
TEST_FOLDERS = {"engine", "dist", "tools", "hosts"}
WHOLE_TREE_CHECKS = {"test_docs.py", "test_structure.py", "test_env_vars.py"}
JOB_STARTERS = {"run_threads", "run_processes", "LocalJob", "Job"}


def test_the_tests_mirror_the_package():
    """Tests live beside the part they test; only the checks of the whole tree stay at the top."""
    tests = ROOT / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py") if p.name not in WHOLE_TREE_CHECKS)
    assert not loose, f"move these into tests/engine, dist, tools or hosts: {loose}"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name[0] not in "._"}
    assert folders == TEST_FOLDERS


def unmarked_job_tests(source):
    """Test functions of a module that start a distributed job (threads or processes) without
    the `slow` mark, on themselves or on the whole module."""
    tree = ast.parse(source)
    if any(isinstance(n, ast.Assign) and "pytestmark" in map(ast.unparse, n.targets)
           and "slow" in ast.unparse(n.value) for n in tree.body):
        return []
    starters = set(JOB_STARTERS)
    if any(isinstance(n, ast.ImportFrom) and (n.module or "").endswith("jobs")
           and "train" in [a.name for a in n.names] for n in tree.body):
        starters.add("train")

    def starts_a_job(call):
        f = call.func
        if isinstance(f, ast.Attribute):
            return f.attr in JOB_STARTERS or (f.attr == "train" and ast.unparse(f.value) == "jobs")
        return isinstance(f, ast.Name) and f.id in starters

    return [f.name for f in tree.body
            if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            and any(isinstance(c, ast.Call) and starts_a_job(c) for c in ast.walk(f))
            and not any("mark.slow" in ast.unparse(d) for d in f.decorator_list)]


def test_job_level_tests_are_marked_slow():
    """`pytest -m "not slow"` leaves out every test that runs a job."""
    found = {str(p.relative_to(ROOT)): unmarked_job_tests(p.read_text())
             for p in sorted((ROOT / "tests").rglob("test_*.py"))}
    assert not {k: v for k, v in found.items() if v}


def test_the_slow_check_finds_an_unmarked_job():
    source = ("import pytest\nfrom .jobs import train\nfrom .helpers import run_threads\n"
              "@pytest.mark.slow\ndef test_a():\n    train('s')\n"
              "def test_b():\n    run_threads(1, 2, 3)\n"
              "def test_c():\n    jobs.train('s')\n"
              "def test_d():\n    assert 1\n")
    assert unmarked_job_tests(source) == ["test_b", "test_c"]
    assert unmarked_job_tests("import pytest\npytestmark = pytest.mark.slow\n" + source) == []
