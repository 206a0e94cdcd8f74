"""A counting stand-in for CuPy: numpy arrays that count what a GPU would launch and wait for.

A GPU step's cost is mostly its number of kernel launches and the moments the host waits for the
device (a `float()` of a device scalar drains the stream and stalls the next launch). Neither shows
on a machine without a GPU, so this module gives the engine an array module that looks like CuPy
(the engine then takes the code path it takes on CuPy) but computes with numpy and counts:

    xp = CountingModule()
    backend.set_array_module_for_tests(xp)       # nets built from now on use it
    try:
        solver = get_solver(...)                 # allocates CountingArrays
        xp.reset()
        solver.step(1)
        print(xp.launches, xp.syncs, xp.by_kind)
    finally:
        backend.set_array_module_for_tests(None)

One launch each: an elementwise op (a ufunc call, in place or not, or a gather/scatter through an
index), a reduction (sum, max, any, argmax, ...), a GEMM (matmul, dot, vdot, tensordot, einsum), a
copy (`a[...] = b`, astype, copyto, concatenate, a host-to-device asarray, a reshape that cannot be a
view), a fill (`a[...] = 0`, zeros, full, fill) and a custom kernel (`counted_kernel`). Views
(reshape, transpose, basic slicing, as_strided) and `empty` launch nothing. One host sync each:
`float()`, `int()`, `bool()`, `.item()`, `.tolist()`, formatting, `asnumpy`, a boolean-mask index
(CuPy must learn the result's size) and a device synchronize. The figures are what the same
calls would launch on CuPy, up to its own fusions (CuPy launches one kernel per such call too).
One read goes unseen: numpy.asarray of a device array (a numpy subclass gives itself up without
a call to count), which CuPy refuses outright, so the GPU tests catch it.

Fused kernels count as one launch each and compute with their exact twins: a solver rule's
ElementwiseKernel through its numpy twin (`counted_kernel`), the layers' CUDA kernels
(engine/kernels) through a runner the caller gives `use_kernels` (the tests give the host build
of the same sources), which engine.kernels.runner_for finds as this module's `kernel_runner`.
"""
import functools
import operator
import types

import numpy

from . import fake_graphs

KINDS = ("elementwise", "reduction", "gemm", "copy", "fill", "kernel")

_REDUCE_METHODS = ("reduce", "accumulate", "reduceat")
_VIEWS = {"reshape", "transpose", "squeeze", "expand_dims", "broadcast_to", "moveaxis",
          "swapaxes", "atleast_1d", "atleast_2d", "atleast_3d", "shape", "ndim", "size",
          "result_type", "may_share_memory", "shares_memory", "iscomplexobj", "isrealobj",
          "broadcast_arrays", "sliding_window_view", "empty_like", "can_cast", "min_scalar_type"}
_GEMMS = {"dot", "vdot", "tensordot", "einsum", "inner", "matmul"}
_REDUCTIONS = {"sum", "mean", "max", "amax", "min", "amin", "argmax", "argmin", "any", "all",
               "prod", "count_nonzero", "bincount", "var", "std", "cumsum", "nansum", "norm",
               "average", "nanmax", "nanmin"}
_COPIES = {"copyto", "concatenate", "stack", "hstack", "vstack", "copy", "pad", "take",
           "ascontiguousarray", "asfortranarray", "array", "asarray", "flip", "roll", "tile",
           "repeat", "ravel"}
_FILLS = {"zeros_like", "ones_like", "full_like"}
_SYNCS = {"nonzero", "flatnonzero", "argwhere", "unique", "array_equal", "allclose"}


class CountingArray(numpy.ndarray):
    """A numpy array standing for a device array; its module (`_module`) does the counting."""

    _module = None

    # ----- numpy's dispatch: every ufunc and array function on these arrays ----------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method in _REDUCE_METHODS:
            kind = "reduction"
        else:
            kind = "gemm" if ufunc is numpy.matmul else "elementwise"
        return self._module.run(kind, getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func, types_, args, kwargs):
        module = self._module
        name = func.__name__
        kind = None
        if name in _SYNCS:
            module.count_sync(name)
        elif name in _GEMMS:
            kind = "gemm"
        elif name in _REDUCTIONS:
            kind = "reduction"
        elif name in _FILLS:
            kind = "fill"
        elif name in _COPIES:
            kind = "copy"
        elif name not in _VIEWS:
            kind = "elementwise"
        return module.run(kind, func, args, kwargs)

    # ----- host reads ------------------------------------------------------------------------------
    def _read(self, what):
        self._module.count_sync(what)
        return self.view(numpy.ndarray)

    def __float__(self):
        return float(self._read("float"))

    def __int__(self):
        return int(self._read("int"))

    def __index__(self):
        return self._read("int").__index__()

    def __bool__(self):
        return bool(self._read("bool"))

    def __format__(self, spec):
        return format(self._read("format")[()] if self.ndim == 0 else self._read("format"), spec)

    def item(self, *args):
        return self._read("item").item(*args)

    def tolist(self):
        return self._read("tolist").tolist()

    # ----- indexing: views are free, a gather or scatter is a launch -------------------------------
    def __getitem__(self, index):
        base = self.view(numpy.ndarray)
        index = _unwrap(index)
        if _is_mask(index):
            self._module.count_sync("mask index")
        if _is_advanced(index):
            return self._module.run("elementwise", operator.getitem, (base, index))
        return self._module.wrap(base[index])

    def __setitem__(self, index, value):
        index = _unwrap(index)
        if _is_mask(index):
            self._module.count_sync("mask index")
        kind = "copy" if isinstance(value, numpy.ndarray) and value.ndim else "fill"
        self._module.run(kind, operator.setitem, (self.view(numpy.ndarray), index, value))

    # ----- methods numpy does not route through the dispatch above ----------------------------------
    def astype(self, dtype, *args, **kwargs):
        if kwargs.get("copy", True) is False and numpy.dtype(dtype) == self.dtype:
            return self
        return self._module.run("copy", numpy.ndarray.astype,
                                (self.view(numpy.ndarray), dtype) + args, kwargs)

    def copy(self, order="C"):
        return self._module.run("copy", numpy.ndarray.copy, (self.view(numpy.ndarray), order))

    def fill(self, value):
        self._module.run("fill", numpy.ndarray.fill, (self.view(numpy.ndarray), value))

    def dot(self, other, out=None):
        return self._module.run("gemm", numpy.ndarray.dot, (self.view(numpy.ndarray), other),
                                {"out": out})

    def reshape(self, *shape, **kwargs):
        base = self.view(numpy.ndarray)
        result = base.reshape(*shape, **kwargs)
        if result.size and not numpy.shares_memory(result, base):     # a copy: run it counted
            return self._module.run("copy", numpy.ndarray.reshape, (base,) + shape, kwargs)
        return self._module.wrap(result)

    def ravel(self, order="C"):
        return self.reshape(-1, order=order)

    def flatten(self, order="C"):
        return self._module.run("copy", numpy.ndarray.flatten, (self.view(numpy.ndarray), order))

    def _reduction(self, name, *args, **kwargs):
        return self._module.run("reduction", getattr(numpy.ndarray, name),
                                (self.view(numpy.ndarray),) + args, kwargs)

    def mean(self, *args, **kwargs):
        return self._reduction("mean", *args, **kwargs)

    def var(self, *args, **kwargs):
        return self._reduction("var", *args, **kwargs)

    def std(self, *args, **kwargs):
        return self._reduction("std", *args, **kwargs)

    def argmax(self, *args, **kwargs):
        return self._reduction("argmax", *args, **kwargs)

    def argmin(self, *args, **kwargs):
        return self._reduction("argmin", *args, **kwargs)

    def get(self):
        """CuPy's device-to-host copy."""
        return self._read("get").copy()


def _unwrap(value):
    """value with every CountingArray in it (also inside tuples, lists and dicts) as plain numpy."""
    if isinstance(value, CountingArray):
        return value.view(numpy.ndarray)
    if isinstance(value, tuple):
        return tuple(_unwrap(v) for v in value)
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def _parts(index):
    return index if isinstance(index, tuple) else (index,)


def _is_advanced(index):
    return any(isinstance(i, (numpy.ndarray, list)) for i in _parts(index))


def _is_mask(index):
    return any(isinstance(i, numpy.ndarray) and i.dtype == bool for i in _parts(index))


class _Cuda:
    """The bits of `cupy.cuda` the engine calls (events, streams and their capture, memory
    pools, synchronize, the device's name); a synchronize counts as a host sync."""

    def __init__(self, module):
        sync = lambda: module.count_sync("synchronize")   # noqa: E731
        device = types.SimpleNamespace(id=0, synchronize=sync, use=lambda: None)
        self.Device = lambda *a: device
        self.Event = lambda *a, **k: fake_graphs.Event()
        self.Stream = functools.partial(fake_graphs.Stream, module)
        self.Stream.null = fake_graphs.Stream(module, null=True)
        self.get_current_stream = lambda: (module.streams or [self.Stream.null])[-1]
        self.MemoryPool = fake_graphs.MemoryPool
        self.using_allocator = functools.partial(fake_graphs.using_allocator, module)
        self.runtime = types.SimpleNamespace(
            getDeviceCount=lambda: 1,
            getDeviceProperties=lambda i: {"name": b"counting stand-in"})


class _CountedRunner:
    """A kernel runner on the stand-in's arrays: one launch a call, run by `inner` (a runner for
    numpy arrays) on the plain arrays underneath."""

    def __init__(self, module, inner):
        self.module, self.inner, self.dtype = module, inner, inner.dtype

    def real(self, value):
        return self.inner.real(value)

    def __call__(self, name, count, *args):
        self.module.run("kernel", lambda *plain: self.inner(name, count, *plain), args)


class CountingModule:
    """An array module that looks like CuPy to the engine and counts launches and host syncs.

    Attributes it does not define come from numpy (dtypes, ufuncs, functions): called on
    CountingArrays they count through numpy's dispatch. `launches`, `syncs`, `by_kind` and
    `sync_reasons` hold the counts since the last `reset()`."""

    def __init__(self):
        self.ndarray = type("CountingArray", (CountingArray,), {"_module": self})
        self.cuda = _Cuda(self)
        self.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(
            as_strided=self._as_strided))
        self.kernel_runner = None    # dtype -> runner of the layers' kernels (use_kernels)
        self.streams = []                  # the current stream's context stack
        self.capture = self.capture_stream = None   # a stream capture under way
        self.pool = None                   # the MemoryPool allocating now (using_allocator)
        self.reset()

    # ----- the counts --------------------------------------------------------------------------------
    def reset(self):
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.sync_reasons = {}
        self.graph_launches = 0

    def count(self, kind):
        self.by_kind[kind] += 1

    def count_sync(self, reason):
        if self.capture is not None:
            raise fake_graphs.CaptureError(f"a host read ({reason}) while a stream is capturing")
        self.sync_reasons[reason] = self.sync_reasons.get(reason, 0) + 1

    @property
    def launches(self):
        return sum(self.by_kind.values())

    @property
    def syncs(self):
        return sum(self.sync_reasons.values())

    def use_kernels(self, factory):
        """Let the layers take their fused-kernel branch on these arrays: factory(dtype) gives a
        runner of the kernels (the interface of engine.kernels.CupyRunner) that computes on
        numpy arrays; each kernel it runs counts as one launch. None: the layers keep their
        array code again."""
        if factory is None:
            self.kernel_runner = None
            return
        runners = {}

        def runner_for_dtype(dtype):
            dtype = numpy.dtype(dtype)
            if dtype not in runners:
                runners[dtype] = _CountedRunner(self, factory(dtype))
            return runners[dtype]
        self.kernel_runner = runner_for_dtype

    def counted_kernel(self, fallback):
        """A custom (fused) kernel under the stand-in: one launch, computed by `fallback` (the
        kernel's numpy twin, called on plain arrays; what it returns is wrapped)."""
        def kernel(*args, **kwargs):
            return self.run("kernel", fallback, args, kwargs)
        return kernel

    def run(self, kind, func, args=(), kwargs=None):
        """One launch of `kind` (None: no launch, e.g. `empty`): func on the plain arrays, its
        result as device arrays. During a stream capture the launch is recorded
        (poseidon/testing/fake_graphs.py) and a GEMM is refused, as CuPy's cuBLAS wrapper refuses it."""
        if kind == "gemm" and self.capture is not None:
            raise NotImplementedError("cuBLAS during stream capture is not supported "
                                      "(the stand-in refuses it as CuPy does)")
        if kind:
            self.count(kind)
        args, kwargs = _unwrap(args), _unwrap(kwargs or {})
        if kind and self.capture is not None:
            result = self.capture.record(func, args, kwargs)
        else:
            result = fake_graphs.normalize(func(*args, **kwargs))
        wrapped = self.wrap(result)
        if self.pool is not None:        # the arrays handed out (a graph's own hold is unseen)
            handed = fake_graphs.arrays_in(wrapped)
            for i, _ in fake_graphs.fresh_arrays(result, (args, kwargs)):
                self.pool.track(handed[i])
        return wrapped

    # ----- arrays ------------------------------------------------------------------------------------
    def wrap(self, value):
        """numpy results as device arrays (numpy scalars as 0-d arrays, as CuPy returns them)."""
        if isinstance(value, CountingArray):
            return value if type(value) is self.ndarray else value.view(self.ndarray)
        if isinstance(value, numpy.ndarray):
            return value.view(self.ndarray)
        if isinstance(value, numpy.generic):
            return numpy.asarray(value).view(self.ndarray)
        if isinstance(value, tuple):
            return tuple(self.wrap(v) for v in value)
        if isinstance(value, list):
            return [self.wrap(v) for v in value]
        return value

    def _alloc(self, kind, make, *args, **kwargs):
        return self.run(kind, make, args, kwargs)

    def empty(self, *args, **kwargs):
        return self._alloc(None, numpy.empty, *args, **kwargs)

    def empty_like(self, *args, **kwargs):
        return self._alloc(None, numpy.empty_like, *args, **kwargs)

    def zeros(self, *args, **kwargs):
        return self._alloc("fill", numpy.zeros, *args, **kwargs)

    def ones(self, *args, **kwargs):
        return self._alloc("fill", numpy.ones, *args, **kwargs)

    def full(self, *args, **kwargs):
        return self._alloc("fill", numpy.full, *args, **kwargs)

    def arange(self, *args, **kwargs):
        return self._alloc("fill", numpy.arange, *args, **kwargs)

    def eye(self, *args, **kwargs):
        return self._alloc("fill", numpy.eye, *args, **kwargs)

    def asarray(self, value, dtype=None, order=None):
        """A device array of value: no launch when it already is one of this dtype, else a copy
        (host to device, or a cast)."""
        if isinstance(value, self.ndarray) and (dtype is None or numpy.dtype(dtype) == value.dtype):
            return value
        return self._alloc("copy", numpy.array, value, dtype=dtype, order=order or "K")

    array = asarray

    def ascontiguousarray(self, value, dtype=None):
        if (isinstance(value, self.ndarray) and value.flags.c_contiguous
                and (dtype is None or numpy.dtype(dtype) == value.dtype)):
            return value
        return self._alloc("copy", numpy.ascontiguousarray, value, dtype=dtype)

    def asnumpy(self, value):
        """A host copy (a host sync when it is a device array)."""
        if isinstance(value, CountingArray):
            self.count_sync("asnumpy")
            return value.view(numpy.ndarray).copy()
        return numpy.asarray(value)

    def get_array_module(self, *arrays):
        return self if any(isinstance(a, self.ndarray) for a in arrays) else numpy

    def _as_strided(self, x, shape=None, strides=None, **kwargs):
        view = numpy.lib.stride_tricks.as_strided(_unwrap(x), shape, strides, **kwargs)
        return self.wrap(view)

    def __getattr__(self, name):
        return getattr(numpy, name)

    def __repr__(self):
        return (f"<CountingModule: {self.launches} launches "
                f"({', '.join(f'{k} {v}' for k, v in self.by_kind.items() if v)}), "
                f"{self.syncs} host syncs>")
