"""The device probe: what the engine does on one GPU, in at most seven minutes, in one command.

    poseidon bench --gpu 0 --probe [--out gpu-probe] [--probe-parts env,timings] [--budget 400]
    python -m poseidon.tools.bench.gpu_probe --gpu 0 [--out gpu-probe]     (the same, without the CLI)

A GPU machine is lent for minutes at a time, so everything worth knowing from it is prepared here
and run in one go. The parts (tools/bench/gpu_probe_parts.py), each in its own process with its
own time limit, so that one that fails, hangs or runs out of memory is recorded and the next runs:

  env          versions (CuPy, CUDA runtime and driver, PyTorch, numpy), the card, and what the
               image lacks (pyzmq, lmdb: the parts that need them are named as skipped; with
               --wheels DIR they are installed from that folder first, no network needed)
  tests        the suite's GPU tests (pytest -m gpu)
  layers       every layer case of poseidon/testing/layer_cases.py on CuPy against numpy (forward and
               backward), the registered layer types no configuration covers, and the modules
               of the engine's kernels package where there is one (their self_check(xp))
  timings      the engine's training step (forward, backward, update) beside PyTorch CUDA's, the
               sides taking turns in one process: cifar10_quick (100), fc_heavy (32), the VGG
               block (16), AlexNet (128), GoogLeNet (64), ResNet-50 (32); FP32 on both sides,
               then TF32 on both sides
  launches     one cifar10_quick step: the counting stand-in's launch figure (poseidon/testing/launches.py)
               beside the kernels CUPTI saw (PyTorch's profiler), and PyTorch's own step
  layer_times  CUDA events around each layer's forward and backward, in a pass of its own
  capture      cifar10_quick's solver step with --cuda-graphs off and on (engine/graphs.py); then
               a CUDA graph capture of forward + backward + update: whether it worked, and why not

It writes results.json and results.md into --out after every part (so what was measured survives
whatever comes later), and the parts' own records in --out/parts/. Without a GPU it says so in one
line and measures nothing.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

PLAN = (("env", 20), ("tests", 90), ("layers", 45), ("timings", 150), ("launches", 30),
        ("layer_times", 30), ("capture", 25))
BUDGET_S = 400          # the parts' limits together; with start-up and writing, under 7 minutes
GRACE_S = 5             # a part aims to end this long before its process is killed


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m poseidon.tools.bench.gpu_probe",
                                description=__doc__.split("\n")[0])
    add_options(p)
    p.add_argument("--gpu", default="0", help="the GPU to probe (default 0)")
    p.add_argument("--out", default="gpu-probe", help="output folder (default gpu-probe/)")
    p.add_argument("--part", help=argparse.SUPPRESS)          # run one part (the probe's children)
    p.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def add_options(p):
    """The probe's own options (also on `poseidon bench`)."""
    p.add_argument("--probe-parts", default=",".join(name for name, _ in PLAN),
                   help=f"the probe's parts to run, comma-separated (default all: "
                        f"{', '.join(name for name, _ in PLAN)})")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for all the probe's parts together (default {BUDGET_S})")
    p.add_argument("--wheels", help="a folder of wheels to install what the image lacks from "
                                    "(pyzmq, lmdb), without the network")


def plan(parts=None, budget=BUDGET_S):
    """[(part, seconds)] for the parts asked for, their limits scaled down together when they
    would not fit in `budget`. An unknown part is a ValueError naming the known ones."""
    known = dict(PLAN)
    names = [p.strip() for p in (parts or ",".join(known)).split(",") if p.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown probe part(s) {', '.join(bad)}; choose from "
                         f"{', '.join(known)}")
    chosen = [(name, known[name]) for name, _ in PLAN if name in names]
    total = sum(s for _, s in chosen)
    scale = min(1.0, budget / total) if total else 1.0
    return [(name, math.floor(s * scale * 10) / 10) for name, s in chosen]   # never over


def no_gpu_reason(gpu):
    """Why the probe cannot run here (one line), or None when CuPy sees GPU `gpu`."""
    from poseidon.engine import backend
    if not backend.gpu_available():
        return ("no GPU here (CuPy is not installed or sees no CUDA device): nothing was "
                "measured; run the probe on a GPU machine")
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
    if not 0 <= int(gpu) < count:
        return f"there is no GPU {gpu}: CUDA sees {count} device(s), ids 0 to {count - 1}"
    return None


# ----- running the parts ------------------------------------------------------------------------------
def run_part(name, limit, gpu, parts_dir, wheels=None):
    """Part `name` in a child process, killed after `limit` seconds (the part itself aims to
    end GRACE_S before): its record, with status 'ok', 'failed' (the last lines it wrote) or
    'timed out' (with what it had recorded)."""
    cmd = [sys.executable, "-m", "poseidon.tools.bench.gpu_probe", "--part", name,
           "--limit", str(max(1.0, limit - GRACE_S)), "--gpu", str(gpu), "--out", str(parts_dir)]
    cmd += ["--wheels", str(wheels)] if wheels else []
    record_file = Path(parts_dir) / f"{name}.json"
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        status = "ok" if proc.returncode == 0 else "failed"
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
    except subprocess.TimeoutExpired:
        status, tail = "timed out", [f"stopped after {limit:.0f} s"]
    record = {}
    if record_file.exists():
        try:
            record = json.loads(record_file.read_text())
        except ValueError:
            tail.append("its record was cut short")
    return {"status": status, "seconds": round(time.monotonic() - start, 1),
            "limit_s": limit, "record": record, **({"last_lines": tail} if status != "ok"
                                                    else {})}


def probe(gpu, out, parts=None, budget=BUDGET_S, wheels=None, log=print):
    """Run the planned parts one after the other within `budget` seconds; write the results
    after each. Returns the results."""
    out = Path(out)
    parts_dir = out / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    steps = plan(parts, budget)
    deadline = time.monotonic() + budget
    results = {"gpu": str(gpu), "budget_s": budget, "plan": steps, "parts": {},
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for name, limit in steps:
        left = deadline - time.monotonic()
        if left < 5:
            results["parts"][name] = {"status": "skipped", "reason": "no time left"}
        else:
            log(f"gpu probe: {name} (at most {min(limit, left):.0f} s)")
            results["parts"][name] = run_part(name, min(limit, left), gpu, parts_dir, wheels)
        log(f"  {name}: {status_line(results['parts'][name])}")
        write_results(results, out)
    return results


def status_line(part):
    status = part.get("status")
    if status == "ok":
        return f"ok in {part['seconds']} s"
    if status == "skipped":
        return f"skipped: {part.get('reason')}"
    last = (part.get("last_lines") or [""])[-1]
    return f"{status} after {part.get('seconds')} s: {last}"


# ----- results.json and results.md ------------------------------------------------------------------
def write_results(results, out):
    from .gpu_probe_report import markdown
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))
    return out


# ----- entry points ----------------------------------------------------------------------------------
def run_child(args):
    """One part, in this process (the probe's child)."""
    from poseidon.engine import backend
    from . import gpu_probe_parts
    # the convolution routes by the fitted GPU rule, not measured: a fresh machine would spend
    # the part's minutes timing every shape of ResNet-50 (routes.py)
    os.environ.setdefault("POSEIDON_CONV_MEASURE", "0")
    backend.set_mode_gpu(int(args.gpu))
    ctx = gpu_probe_parts.ProbeContext(args.part, int(args.gpu), args.limit, args.out,
                                       args.wheels)
    gpu_probe_parts.PARTS[args.part](ctx)
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.part:
        return run_child(args)
    return run_from_bench(args, log=print, complain=lambda line: print(
        f"gpu probe: {line}", file=sys.stderr))


def run_from_bench(args, log=None, complain=None):
    """`poseidon bench --gpu N --probe` (and main): the whole probe into args.out. Without a
    GPU, or with a bad option, one line and a non-zero status."""
    from poseidon.engine.errors import PoseidonError
    log = log or (lambda line: print(line, flush=True))
    gpu = "0" if args.gpu is None else str(args.gpu)
    try:
        steps = plan(args.probe_parts, args.budget)
        reason = no_gpu_reason(gpu)
    except ValueError as e:
        steps, reason = None, f"--probe-parts: {e}"
    if reason:
        if complain is None:
            raise PoseidonError(f"gpu probe: {reason}")
        complain(reason)
        return 1
    log(f"gpu probe: GPU {gpu}, parts {', '.join(n for n, _ in steps)}, at most "
        f"{sum(s for _, s in steps):.0f} s, into {args.out}/")
    results = probe(gpu, args.out, args.probe_parts, args.budget, args.wheels, log=log)
    log(f"gpu probe: wrote {Path(args.out) / 'results.json'} and results.md")
    return 0 if all(p.get("status") == "ok" for p in results["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
