"""The kernel sources (engine/kernels/*.cu) built for the host and run through ctypes, so their
index arithmetic is checked on a machine without a GPU.

One shared library per element type holds every source (compiled as C++ with kernel_shim.h) and,
per kernel, a generated `host_<name>(grid, block, ...)` that runs the kernel's grid as a loop. It
is built once per source text into the temp folder (named by the hash of what went in), so a
second session reuses it. `HostRunner` has the interface of engine.kernels.CupyRunner, and also
checks every argument against the kernel's C signature: the array's dtype and contiguity, a
scalar's exact numpy type (what CuPy would pass by size), so a wrong argument list in
engine/kernels/calls.py fails here rather than on a GPU.
"""
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy

from poseidon.engine import kernels

SHIM = Path(__file__).resolve().parent / "kernel_shim.h"
# a small odd grid: every thread's grid-stride loop takes several steps, at uneven offsets
GRID, BLOCK = 3, 7

SIGNATURE = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)')
SCALARS = {"int": (numpy.int32, ctypes.c_int), "long long": (numpy.int64, ctypes.c_longlong),
           "u64": (numpy.uint64, ctypes.c_ulonglong),
           "unsigned int": (numpy.uint32, ctypes.c_uint)}
POINTEES = {"int": numpy.int32, "u64": numpy.uint64}


def compiler():
    return shutil.which("g++") or shutil.which("c++")


def signatures(text):
    """{kernel: [(C type, name), ...]} of the extern "C" kernels in source text."""
    found = {}
    for name, params in SIGNATURE.findall(text):
        found[name] = [tuple(p.strip().rsplit(None, 1)) for p in params.split(",")]
    return found


def _wrapper(name, params):
    decl = ", ".join(f"{t} {n}" for t, n in params)
    args = ", ".join(n for _, n in params)
    return (f'extern "C" void host_{name}(int grid, int block, {decl}) {{\n'
            f"    gridDim.x = grid; blockDim.x = block;\n"
            f"    for (int b = 0; b < grid; ++b) for (int t = 0; t < block; ++t) {{\n"
            f"        blockIdx.x = b; threadIdx.x = t; {name}({args});\n    }}\n}}\n")


def build(real):
    """Path of the shared library for element type real ("float" or "double")."""
    text = kernels.module_text()
    wrappers = "".join(_wrapper(n, p) for n, p in signatures(text).items())
    unit = f"#define real_t {real}\n{text}\n{wrappers}"
    digest = hashlib.sha256((unit + SHIM.read_text()).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "poseidon-kernels-host"
    folder.mkdir(exist_ok=True)
    lib = folder / f"kernels-{real}-{digest}.so"
    if not lib.exists():
        # per-process names until the rename: two sessions building at once never share a file
        src = folder / f"kernels-{real}-{digest}.{os.getpid()}.cpp"
        src.write_text(unit)
        partial = folder / f"{lib.name}.{os.getpid()}"
        done = subprocess.run([compiler(), "-O1", "-shared", "-fPIC", "-include", str(SHIM),
                               "-o", str(partial), str(src)], capture_output=True, text=True)
        assert done.returncode == 0, f"the host build of the kernels failed:\n{done.stderr}"
        src.unlink()
        os.replace(partial, lib)   # atomic: a reader never sees half a library
    return lib


class HostRunner:
    """Runs kernels of the host build on numpy arrays (see the module docstring)."""

    def __init__(self, dtype):
        self.dtype = numpy.dtype(dtype)
        real = kernels.ELEMENT_TYPES[self.dtype]
        self.lib = ctypes.CDLL(str(build(real)))
        self.signatures = signatures(kernels.module_text())
        self.real_ctype = ctypes.c_float if real == "float" else ctypes.c_double
        self.launches = []   # kernel names in launch order

    def real(self, value):
        return self.dtype.type(value)

    def _convert(self, name, ctype, pname, arg):
        where = f"{name}({pname})"
        if ctype.endswith("*"):
            base = ctype.replace("const", "").replace("*", "").strip()
            want = self.dtype if base == "real_t" else numpy.dtype(POINTEES[base])
            assert isinstance(arg, numpy.ndarray), f"{where}: expected an array, got {type(arg)}"
            assert arg.dtype == want, f"{where}: array of {arg.dtype}, kernel reads {want}"
            assert arg.flags.c_contiguous, f"{where}: array not C-contiguous"
            return ctypes.c_void_p(arg.ctypes.data)
        if ctype == "real_t":
            assert type(arg) is self.dtype.type, f"{where}: {type(arg)} for real_t {self.dtype}"
            return self.real_ctype(arg)
        want, c = SCALARS[ctype]
        assert type(arg) is want, f"{where}: {type(arg).__name__} passed for C {ctype}"
        return c(int(arg))

    def __call__(self, name, count, *args):
        params = self.signatures[name]
        assert len(args) == len(params), f"{name}: {len(args)} arguments for {len(params)}"
        converted = [self._convert(name, t, n, a) for (t, n), a in zip(params, args)]
        self.launches.append(name)
        getattr(self.lib, f"host_{name}")(GRID, BLOCK, *converted)


_runners = {}


def runner(dtype):
    """One HostRunner per dtype for the session (its library loaded once)."""
    dtype = numpy.dtype(dtype)
    if dtype not in _runners:
        _runners[dtype] = HostRunner(dtype)
    return _runners[dtype]


def run_layer(text, bottoms, n_tops=1, top_diffs=None, use_kernels=False, phase=None,
              dtype=numpy.float32, propagate=None, prepare=None):
    """Forward and backward of the layer made from prototxt `text` on copies of `bottoms`: its
    numpy branch, or (use_kernels) its kernel branch through the host build. Returns (tops,
    bottom diffs, forward launches, backward launches); top_diffs(top blobs) gives each top's
    diff (default: fixed random numbers); prepare(layer) runs before setup."""
    from contextlib import nullcontext

    from poseidon.engine.layer import TRAIN
    from tests.engine.harness import make_layer, run_forward

    layer = make_layer(text, TRAIN if phase is None else phase, dtype)
    if prepare is not None:
        prepare(layer)
    host = runner(dtype)
    with kernels.host_runner(runner) if use_kernels else nullcontext():
        start = len(host.launches)
        bottom, top = run_forward(layer, bottoms, n_tops, dtype)
        middle = len(host.launches)
        tops = [t.data.copy() for t in top]
        rs = numpy.random.RandomState(7)
        diffs = (top_diffs(top) if top_diffs is not None
                 else [rs.standard_normal(t.shape) for t in top])
        for t, d in zip(top, diffs):
            t.diff[...] = d
        for b in bottom:
            b.diff[...] = numpy.nan   # a gradient the branch fails to write shows
        layer.backward(top, propagate or [True] * len(bottom), bottom)
        grads = [b.diff.copy() for b in bottom]
    return (tops, grads, host.launches[start:middle], host.launches[middle:])


def assert_branches_agree(text, bottoms, n_tops=1, exact_tops=False, exact_grads=False,
                          launches=None, **kw):
    """The kernel branch gives what the numpy branch gives (exactly where the kernel only picks
    and moves numbers, else within float32 rounding) and launches what `launches` = (forward
    kernels, backward kernels) says."""
    want_tops, want_grads, _, _ = run_layer(text, bottoms, n_tops, **kw)
    tops, grads, fwd, bwd = run_layer(text, bottoms, n_tops, use_kernels=True, **kw)
    exact = [exact_tops] * len(tops) + [exact_grads] * len(grads)
    for got, want, bitwise in zip(tops + grads, want_tops + want_grads, exact):
        if bitwise:
            numpy.testing.assert_array_equal(got, want)
        else:
            numpy.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if launches is not None:
        assert (fwd, bwd) == (list(launches[0]), list(launches[1]))
    return tops, grads
