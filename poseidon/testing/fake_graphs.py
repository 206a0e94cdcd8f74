"""CUDA graph capture on the counting stand-in (poseidon/testing/launches.py): CuPy's, done on numpy.

On a GPU `stream.begin_capture()` makes the launches that follow on that stream into nodes of a
graph instead of running them, `stream.end_capture()` returns the graph, and `graph.launch()`
runs them all again, on the same memory, with whatever values that memory holds then. This
module gives the stand-in the same behaviour, so that the engine's graph code (engine/graphs.py)
can be tested where there is no GPU:

- a launch during capture is recorded as a closure that reruns it on the same arrays (a result
  it allocated is written in place at each replay) and its effects are undone when the capture
  ends: after end_capture the arrays hold what they held before it, and arrays allocated inside
  hold garbage (NaN, or zeros for integers), as device memory a captured kernel never wrote;
- a GEMM during capture raises NotImplementedError, as CuPy's cuBLAS wrapper does, and a host
  read raises CaptureError, as CUDA refuses a synchronisation of a capturing stream;
- a capture needs a non-blocking stream (CuPy refuses the legacy default stream);
- `MemoryPool` and `using_allocator` stand for CuPy's: a pool counts the bytes of the arrays
  allocated while it was the allocator that the code still holds (`used_bytes`; a graph's own
  hold on its memory does not count, as CuPy's pool does not see it either), which is how the
  graph code finds a layer that keeps a new array from a step. It follows the array objects
  handed out, so a kept view of a fresh array made by a later reshape goes unseen.
"""
import contextlib
import weakref

import numpy


class CaptureError(RuntimeError):
    """What CUDA answers to an operation a capturing stream does not allow."""


def root(array):
    """The array that owns the memory `array` views (through as_strided's holders too)."""
    while True:
        base = getattr(array, "base", None)
        if base is None:
            return array
        if isinstance(base, numpy.ndarray) or hasattr(base, "base"):
            array = base
        else:
            return array


def arrays_in(value):
    """The numpy arrays inside value (nested tuples, lists and dicts)."""
    if isinstance(value, numpy.ndarray):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in arrays_in(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays_in(v)]
    return []


def normalize(result):
    """numpy scalars as 0-d arrays (what CuPy returns), so that each result has memory."""
    if isinstance(result, numpy.generic):
        return numpy.asarray(result)
    if isinstance(result, tuple):
        return tuple(normalize(r) for r in result)
    if isinstance(result, list):
        return [normalize(r) for r in result]
    return result


def fresh_arrays(result, inputs):
    """Positions and arrays of the results that were allocated by the call (their memory is
    none of the inputs')."""
    owners = {id(root(a)) for a in arrays_in(inputs)}
    return [(i, a) for i, a in enumerate(arrays_in(result)) if id(root(a)) not in owners]


class Capture:
    """The launches recorded since begin_capture, and the memory to put back at end_capture."""

    def __init__(self):
        self.closures = []
        self._saved = {}

    def record(self, func, args, kwargs):
        inputs = (args, kwargs)
        for owner in map(root, arrays_in(inputs)):
            if id(owner) not in self._saved and owner.flags.writeable:
                self._saved[id(owner)] = (owner, owner.copy())
        with numpy.errstate(all="ignore"):
            result = normalize(func(*args, **kwargs))
        fresh = fresh_arrays(result, inputs)
        for _, array in fresh:
            if array.flags.writeable:
                array.fill(numpy.nan if array.dtype.kind in "fc" else 0)

        def replay():
            with numpy.errstate(all="ignore"):
                parts = arrays_in(normalize(func(*args, **kwargs)))
            for i, array in fresh:
                numpy.copyto(array, parts[i])
        self.closures.append(replay)
        return result

    def undo(self):
        for owner, copy in self._saved.values():
            owner[...] = copy
        self._saved.clear()


class Graph:
    """A captured graph: launch() reruns its launches in order (one graph launch counted)."""

    def __init__(self, module, closures):
        self._module, self._closures = module, closures

    def launch(self, stream=None):
        self._module.graph_launches += 1
        for replay in self._closures:
            replay()


class Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class Stream:
    """A stream of the stand-in: a context that makes it current, and capture."""

    def __init__(self, module, non_blocking=False, null=False):
        self._module, self.non_blocking, self._null = module, non_blocking, null
        self.ptr = 0 if null else id(self)

    def __enter__(self):
        self._module.streams.append(self)
        return self

    def __exit__(self, *exc):
        self._module.streams.pop()

    def use(self):
        pass

    def synchronize(self):
        self._module.count_sync("synchronize")

    def record(self, event=None):
        return event or Event()

    def wait_event(self, event):
        pass

    def is_capturing(self):
        return self._module.capture is not None and self._module.capture_stream is self

    def begin_capture(self, mode=None):
        if self._null or not self.non_blocking:
            raise CaptureError("a capture needs a non-blocking stream (not the default one)")
        if self._module.capture is not None:
            raise CaptureError("a capture is already under way")
        self._module.capture, self._module.capture_stream = Capture(), self

    def end_capture(self):
        capture = self._module.capture
        if capture is None or self._module.capture_stream is not self:
            raise CaptureError("end_capture on a stream that is not capturing")
        self._module.capture = self._module.capture_stream = None
        capture.undo()
        return Graph(self._module, capture.closures)


class MemoryPool:
    """Stands for cupy.cuda.MemoryPool: the bytes of the live arrays allocated through it."""

    def __init__(self):
        self._arrays = []

    def malloc(self, size):   # the allocator's identity, as `using_allocator` receives it
        raise NotImplementedError("the stand-in allocates through numpy")

    def track(self, array):
        self._arrays.append(weakref.ref(array))

    def used_bytes(self):
        live = [r for r in self._arrays if r() is not None]
        self._arrays = live
        return sum(r().nbytes for r in live)


@contextlib.contextmanager
def using_allocator(module, allocator):
    """cupy.cuda.using_allocator: the arrays made inside are the pool's."""
    previous = module.pool
    module.pool = getattr(allocator, "__self__", None)
    try:
        yield
    finally:
        module.pool = previous
