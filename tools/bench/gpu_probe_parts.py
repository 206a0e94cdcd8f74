"""The parts of the device probe (tools/bench/gpu_probe.py), each run in its own process.

Each part is a function of a `ProbeContext` that records what it found with `ctx.emit(...)`
(written at once, so a part stopped at its time limit leaves what it had) and watches
`ctx.left()`, the seconds it has before it is stopped. pyzmq and lmdb are not imported here:
the GPU image lacks them, and nothing the probe measures needs them. The engine and PyTorch sides
that the parts time are gpu_probe_steps.py's.
"""
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy

from .gpu_probe_steps import EngineStep, TorchStep, compare, free_memory, set_precision, timed

ROOT = Path(__file__).resolve().parents[2]        # the repository: tests/ beside engine/
OPTIONAL = {"zmq": ("pyzmq", "the distributed tests and bench parts c-e, g"),
            "lmdb": ("lmdb", "the LMDB data layers and their tests")}
TIMED_NETS = (("cifar10_quick", 100), ("fc_heavy", 32), ("vgg_block", 16), ("alexnet", 128),
              ("googlenet", 64), ("resnet50", 32))


class ProbeContext:
    def __init__(self, name, gpu, limit_s, out, wheels=None):
        self.name, self.gpu, self.wheels = name, gpu, wheels
        self.deadline = time.monotonic() + limit_s
        self.path = Path(out) / f"{name}.json"
        self.data = {}

    def left(self):
        return self.deadline - time.monotonic()

    def emit(self, **values):
        self.data.update(values)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def _version(module):
    try:
        return importlib.import_module(module).__version__
    except Exception as e:
        return f"not importable ({type(e).__name__})"


# ----- env: versions, the card, what is missing ------------------------------------------------------
def env(ctx):
    import cupy
    missing = {m: why for m, why in OPTIONAL.items() if importlib.util.find_spec(m) is None}
    if missing and ctx.wheels:
        names = [OPTIONAL[m][0] for m in missing]
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index",
                               "--find-links", str(ctx.wheels), *names],
                              capture_output=True, text=True, timeout=max(5, ctx.left() - 5))
        ctx.emit(install={"packages": names, "rc": proc.returncode,
                          "tail": (proc.stdout + proc.stderr)[-800:]})
        importlib.invalidate_caches()
        missing = {m: w for m, w in missing.items() if importlib.util.find_spec(m) is None}
    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(ctx.gpu)
    name = props["name"]
    ctx.emit(python=platform.python_version(), numpy=numpy.__version__, cupy=cupy.__version__,
             cuda_runtime=runtime.runtimeGetVersion(), cuda_driver=runtime.driverGetVersion(),
             device=name.decode() if isinstance(name, bytes) else str(name),
             compute_capability=cupy.cuda.Device(ctx.gpu).compute_capability,
             memory_gib=round(props["totalGlobalMem"] / 2 ** 30, 1),
             torch=_version("torch"), pytest=_version("pytest"),
             skipped=[f"{OPTIONAL[m][1]}: {OPTIONAL[m][0]} is not installed" for m in missing])
    try:
        import torch
        ctx.emit(torch_cuda=torch.version.cuda, torch_sees_gpu=torch.cuda.is_available())
    except Exception as e:
        ctx.emit(torch_cuda=f"not importable ({type(e).__name__}: {e})")


# ----- tests: the suite's GPU tests ----------------------------------------------------------------
def tests(ctx):
    folder = ROOT / "tests"
    if not folder.is_dir():
        ctx.emit(status="skipped", reason=f"no tests folder at {folder}")
        return
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", str(folder)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(5, ctx.left() - 3))
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = ((e.stdout or b"").decode(errors="replace")
                    if isinstance(e.stdout, bytes) else (e.stdout or "")), "timed out"
    lines = [line for line in text.splitlines() if line.strip()]
    ctx.emit(command=" ".join(cmd[2:]), rc=rc, summary=lines[-1] if lines else "",
             failures=[line for line in lines if line.startswith(("FAILED", "ERROR"))][:40],
             tail=text[-3000:])


# ----- layers: every layer type on CuPy against numpy ----------------------------------------------
def layers(ctx):
    import cupy
    from poseidon.engine import registered_types
    from poseidon.testing import layer_cases as cases   # the layer cases tests/engine/test_gpu.py runs
    rs = numpy.random.RandomState(0)
    results, covered = [], set()
    for i, (text, shapes, n_tops) in enumerate(cases.CONFIGS):
        kind = text.split('"')[1]
        covered.add(kind)
        if ctx.left() < 3:
            results.append({"case": f"{kind}#{i}", "status": "not run (time)"})
            continue
        try:
            arrays = [rs.standard_normal(s) for s in shapes]
            if cases.labelled(text):
                arrays[-1] = rs.randint(0, shapes[0][1], size=shapes[-1]).astype(numpy.float64)
            tops, _, params, _ = cases.run_case(text, arrays, n_tops, numpy)
            diffs = [rs.standard_normal(t.shape) for t in tops]
            want = cases.run_case(text, arrays, n_tops, numpy, params, diffs)
            got = cases.run_case(text, arrays, n_tops, cupy, params, diffs)
            err = max((float(numpy.max(numpy.abs(x - y) / (numpy.abs(x) + 1e-9)))
                       for a, b in zip(want, got) for x, y in zip(a, b) if x.size), default=0.0)
            results.append({"case": f"{kind}#{i}", "status": "ok" if err < 1e-6 else "differs",
                            "max_rel_err": err})
        except Exception as e:
            results.append({"case": f"{kind}#{i}", "status": "failed",
                            "error": f"{type(e).__name__}: {e}"[:300]})
        ctx.emit(cases=results)
    ctx.emit(cases=results, unchecked_types=sorted(set(registered_types()) - covered),
             kernels=_kernel_checks(ctx, cupy))


def _kernel_checks(ctx, cupy):
    """The engine's kernels package (poseidon.engine.kernels), where present: each module
    imported, and its self_check(xp) run where it has one (the kernel against its xp code)."""
    try:
        package = importlib.import_module("poseidon.engine.kernels")
    except ImportError:
        return {"status": "no kernels package in this tree"}
    found = {}
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        if path.stem == "__init__" or ctx.left() < 2:
            continue
        try:
            module = importlib.import_module(f"poseidon.engine.kernels.{path.stem}")
            check = getattr(module, "self_check", None)
            found[path.stem] = "imported (no self_check)" if check is None else repr(check(cupy))
        except Exception as e:
            found[path.stem] = f"failed: {type(e).__name__}: {e}"[:300]
    return found


# ----- timings: the engine beside PyTorch CUDA ------------------------------------------------------
def timings(ctx):
    from poseidon.engine import backend
    try:
        import torch  # noqa: F401
        with_torch, note = True, None
    except Exception as e:
        with_torch, note = False, f"no PyTorch ({type(e).__name__}: {e})"
    rows = []
    for k, (key, batch) in enumerate(TIMED_NETS):
        share = ctx.left() / (len(TIMED_NETS) - k) - 1
        row = {"net": key, "batch": batch}
        rows.append(row)
        if share < 4:
            row["status"] = "not run (time)"
            continue
        start = time.monotonic()
        try:
            engine = EngineStep(key, batch)
            torch_side = TorchStep(engine, f"cuda:{ctx.gpu}") if with_torch else None
            engine.step(2)                           # compiles CuPy's kernels, fills its pool
            if torch_side:
                torch_side.step(2)
            left = share - (time.monotonic() - start)
            for precision in ("fp32", "tf32"):
                row[f"engine_precision_{precision}"] = set_precision(precision == "tf32",
                                                                     with_torch)
                runs = compare(engine, torch_side, max(0.5, left / 2 - 1))
                row[precision] = {side: float(numpy.median(v)) for side, v in runs.items()}
                row[precision]["rounds"] = len(runs["engine"])
                if "torch" in runs:
                    row[precision]["engine_speed_vs_torch"] = (row[precision]["torch"]
                                                               / row[precision]["engine"])
            row["status"] = "measured"
        except Exception as e:
            row["status"] = f"failed: {type(e).__name__}: {e}"[:300]
        finally:
            set_precision(False, with_torch)
            engine = torch_side = None
            free_memory(with_torch)
        ctx.emit(rows=rows, torch_note=note, device=backend.device_name(__import__("cupy")))


# ----- launches: what one step launches, counted two ways -------------------------------------------
def launches(ctx):
    """cifar10_quick (batch 100): the counting stand-in's figure on the CPU (poseidon/testing/launches.py,
    the same convolution routes as the GPU's) beside what CUPTI saw in one GPU step (PyTorch's
    profiler; CuPy has no counter of its own), and PyTorch's own step."""
    engine = EngineStep("cifar10_quick", 100)
    engine.step(2)
    routes = engine.net.conv_routes()
    ctx.emit(routes=routes, stand_in=_stand_in_count(routes))
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception as e:
        ctx.emit(profiler=f"not run: no PyTorch ({type(e).__name__})")
        return
    seen = _profiled(engine, profile, ProfilerActivity)
    if not seen["kernels"]:
        seen["note"] = ("CUPTI reported none of CuPy's kernels to PyTorch's profiler: count "
                        "them with nsys instead")
    ctx.emit(engine_step=seen)
    ctx.emit(torch_step=_profiled(TorchStep(engine, f"cuda:{ctx.gpu}"), profile, ProfilerActivity))
    del torch


def _stand_in_count(routes, kernel_runner=None):
    """One cifar10_quick step's launches on the counting stand-in; kernel_runner(dtype): a
    runner of the layers' kernels for numpy arrays (None: the card's, through copies)."""
    from poseidon.engine import backend
    from poseidon.testing.launches import CountingModule
    from poseidon.tools.bench import nets
    xp = CountingModule()
    xp.use_kernels(kernel_runner or _DeviceTwin)
    backend.set_array_module_for_tests(xp)
    try:
        solver = nets.make_solver(nets.cifar10_quick(100), xp=xp)
        solver.net.set_conv_routes(routes)
        solver.step(1)
        xp.reset()
        solver.step(3)
        three = (xp.launches, xp.syncs, dict(xp.by_kind))
        xp.reset()
        solver.step(1)
        return {"launches_per_step": (three[0] - xp.launches) // 2,
                "host_syncs_per_step": (three[1] - xp.syncs) // 2, "by_kind_3_steps": three[2]}
    finally:
        backend.set_array_module_for_tests(None)


class _DeviceTwin:
    """The layers' kernels for numpy arrays on a machine with a GPU: each call copies its arrays
    to the device, runs the kernel there and copies them back (slow, but the stand-in only
    counts the call, and the values stay the kernels' own)."""

    def __init__(self, dtype):
        import cupy

        from poseidon.engine import kernels
        self.cupy, self.dtype = cupy, numpy.dtype(dtype)
        self.inner = kernels.CupyRunner(cupy, self.dtype)

    def real(self, value):
        return self.dtype.type(value)

    def __call__(self, name, count, *args):
        moved = [self.cupy.asarray(a) if isinstance(a, numpy.ndarray) else a for a in args]
        self.inner(name, count, *moved)
        for host, device in zip(args, moved):
            if isinstance(host, numpy.ndarray):
                host[...] = self.cupy.asnumpy(device)


def _profiled(side, profile, activity):
    side.sync()
    with profile(activities=[activity.CUDA]) as prof:
        side.step(1)
        side.sync()
    kinds = {"kernels": 0, "memcpy": 0, "memset": 0}
    names = {}
    for event in prof.events():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            low = event.name.lower()
            kind = "memcpy" if "memcpy" in low else "memset" if "memset" in low else "kernels"
            kinds[kind] += 1
            names[event.name[:60]] = names.get(event.name[:60], 0) + 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:15]
    return dict(kinds, most_frequent=top)


# ----- layer_times: CUDA events around each layer ----------------------------------------------------
def layer_times(ctx):
    """Per-layer forward and backward ms from CUDA events (recorded around each layer in one
    pass, read after it: the pass itself never waits), cifar10_quick then ResNet-50 as time
    allows."""
    import cupy
    out = {}
    for key, batch in (("cifar10_quick", 100), ("resnet50", 32)):
        if ctx.left() < 8:
            out[key] = "not run (time)"
            continue
        engine = EngineStep(key, batch)
        engine.step(2)
        net, n = engine.net, len(engine.net.layers)
        events = [[cupy.cuda.Event() for _ in range(4)] for _ in range(n)]
        for li in range(n):
            events[li][0].record()
            net.ForwardLayer(li, alone=False)
            events[li][1].record()
        for li in reversed(range(n)):
            events[li][2].record()
            net.BackwardThrough(li)
            events[li][3].record()
        engine.sync()
        rows = [(net.layer_names[li], net.layers[li].type,
                 cupy.cuda.get_elapsed_time(e[0], e[1]), cupy.cuda.get_elapsed_time(e[2], e[3]))
                for li, e in enumerate(events)]
        by_type = {}
        for _, kind, f, b in rows:
            by_type.setdefault(kind, [0.0, 0.0])
            by_type[kind][0] += f
            by_type[kind][1] += b
        out[key] = {"total_ms": sum(f + b for _, _, f, b in rows), "by_type_ms": by_type,
                    "slowest": sorted(rows, key=lambda r: -(r[2] + r[3]))[:12]}
        ctx.emit(nets=out)
        engine = None
        free_memory(False)
    ctx.emit(nets=out)


# ----- capture: a stretch of the step as a CUDA graph ------------------------------------------------
def capture(ctx):
    """Capture forward, backward and update of cifar10_quick on a side stream as one graph,
    replay it, and compare its time with the same stretch run eagerly; then the solver's step
    eager and with engine/graphs.py's segments (the column that decides --cuda-graphs'
    default). Any failure is the finding (what in the step cannot be captured: a host read,
    an allocation outside CuPy's pool, ...)."""
    _whole_stretch(ctx)
    try:
        if ctx.left() > 5:                       # two solvers of a few dozen steps: seconds
            _step_graphs(ctx)
    except Exception as e:
        ctx.emit(step_graphs_error=f"{type(e).__name__}: {e}"[:500])


def _step_graphs(ctx):
    """ms per solver step of cifar10_quick (batch 100), POSEIDON_CUDA_GRAPHS off and on, the
    on side after its warm-up and capture, and the plan it captured."""
    from poseidon.engine import graphs
    before = os.environ.get(graphs.ENV)
    try:
        for mode in ("off", "on"):
            os.environ[graphs.ENV] = mode
            engine = EngineStep("cifar10_quick", 100)
            engine.step(graphs.WARMUP + 2)          # compiled, warmed up, captured, replayed
            ctx.emit(**{f"step_ms_graphs_{mode}": timed(engine, 10) * 1000})
            planned = graphs.graphs_of(engine.solver)
            if planned is not None and planned.describe() is not None:
                segments, eager = planned.describe()
                ctx.emit(graph_segments=len(segments), graph_eager=sorted(eager))
            engine = None
            free_memory(False)
    finally:
        if before is None:
            os.environ.pop(graphs.ENV, None)
        else:
            os.environ[graphs.ENV] = before


def _whole_stretch(ctx):
    import cupy
    engine = EngineStep("cifar10_quick", 100)
    engine.step(3)                               # kernels compiled, memory pool filled
    net, solver = engine.net, engine.solver

    def stretch():
        for li in range(len(net.layers)):
            net.ForwardLayer(li, alone=False)
        net.loss_on_device()
        for li in reversed(range(len(net.layers))):
            net.BackwardThrough(li)
        solver.apply_update()

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stretch()
        stream.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            stretch()
        stream.synchronize()
        eager_ms = (time.perf_counter() - t) * 100
        ctx.emit(eager_ms=eager_ms)
        graph = None
        try:
            stream.begin_capture()
            try:
                stretch()
            finally:
                graph = stream.end_capture()
        except Exception as e:
            ctx.emit(captured=False, error=f"{type(e).__name__}: {e}"[:500])
            return
        try:
            graph.launch(stream)
            stream.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                graph.launch(stream)
            stream.synchronize()
            ctx.emit(captured=True, replay_ms=(time.perf_counter() - t) * 100)
        except Exception as e:
            ctx.emit(captured=True, replayed=False, error=f"{type(e).__name__}: {e}"[:500])


PARTS = {"env": env, "tests": tests, "layers": layers, "timings": timings, "launches": launches,
         "layer_times": layer_times, "capture": capture}
