"""Fused CUDA kernels for the launch-heavy layers, and the loader that builds them.

On a GPU a layer written as array operations issues a kernel launch for every ufunc, copy and
reduction: max pooling's backward about forty a step, SoftmaxWithLoss's a couple of dozen. The
kernels here (the .cu files beside this module, Caffe's semantics) do each such layer's forward
or backward in one to three launches. A layer asks `runner_for(array)`: on CuPy arrays of float32
or float64 it gets a runner and calls the layer's function in `calls` (its CuPy branch); on numpy
it gets None and keeps its array code. docs/performance.md lists the kernels and their launches.

The sources are compiled once per device and element type with `cupy.RawModule` (NVRTC), all
files as one module, `real_t` set to the element type. Without a GPU they are still checked: the
tests compile each with `nvcc --ptx`, and build the same text for the host with a shim that runs
the grid as a loop, then run the layers' kernel branch on numpy arrays through that build
(`host_runner`) and compare with their numpy branch.
"""
import contextlib
from pathlib import Path

import numpy

from .. import backend
from . import calls  # noqa: F401  (the layers' entry points)

HERE = Path(__file__).resolve().parent
COMMON = "common.cuh"
INCLUDE_LINE = f'#include "{COMMON}"'

# Every source and the kernels it defines, in its order (tests/engine/test_kernels_compile.py checks
# that each compiles to exactly these entry points).
KERNELS = {
    "pooling.cu": ("max_pool_forward", "max_pool_backward", "ave_pool_forward",
                   "ave_pool_backward"),
    "softmax_loss.cu": ("softmax_loss_forward", "softmax_loss_normalize",
                        "softmax_loss_backward"),
    "im2col.cu": ("im2col_nhwc", "col2im_nhwc"),
    "bias_relu.cu": ("bias_relu_nchw", "bias_relu_rows"),
    "lrn.cu": ("lrn_forward", "lrn_backward"),
    "eltwise.cu": ("eltwise_sum", "eltwise_prod", "eltwise_max", "eltwise_sum_backward",
                   "eltwise_max_backward", "eltwise_prod_backward"),
    "concat.cu": ("concat_copy",),
    "dropout.cu": ("dropout_forward", "dropout_backward"),
}

# Threads a block and the most blocks a launch: the loops are grid-stride, so a capped grid
# covers any count; the cap keeps a launch over a huge blob from making blocks that each do a
# few elements, and is far above what a GPU keeps resident at once.
THREADS = 256
MAX_BLOCKS = 8192

ELEMENT_TYPES = {numpy.dtype(numpy.float32): "float", numpy.dtype(numpy.float64): "double"}


def source_text(name):
    """One source with the shared header pasted in place of its #include line (NVRTC is given
    text, not a folder)."""
    text = (HERE / name).read_text()
    return text.replace(INCLUDE_LINE, (HERE / COMMON).read_text())


def module_text():
    """All the sources as one translation unit (the header's guard keeps one copy of it)."""
    return "\n".join(source_text(name) for name in KERNELS)


def kernel_names():
    return [k for names in KERNELS.values() for k in names]


def blocks_for(count):
    return max(1, min(MAX_BLOCKS, -(-int(count) // THREADS)))


class CupyRunner:
    """The kernels of one device and element type: `run(name, count, *args)` launches kernel
    `name` over `count` elements with the arguments in its C order (numpy scalars of the exact
    C types, arrays for pointers)."""

    def __init__(self, cupy, dtype):
        self.dtype = numpy.dtype(dtype)
        self.module = cupy.RawModule(code=module_text(),
                                     options=(f"-Dreal_t={ELEMENT_TYPES[self.dtype]}",))
        self._functions = {}

    def real(self, value):
        return self.dtype.type(value)

    def __call__(self, name, count, *args):
        kernel = self._functions.get(name)
        if kernel is None:
            kernel = self._functions[name] = self.module.get_function(name)
        kernel((blocks_for(count),), (THREADS,), args)


_runners = {}          # (device id, dtype) -> CupyRunner: each built once
_host_factory = None   # set by host_runner: a runner for numpy arrays (the tests' host build)


def runner_for(array):
    """The kernels' runner for the arrays of `array`'s module and dtype, or None where the layer
    keeps its array code (numpy, or a dtype the kernels are not built for)."""
    dtype = numpy.dtype(array.dtype)
    if dtype not in ELEMENT_TYPES:
        return None
    if isinstance(array, numpy.ndarray):
        # a stand-in array module (poseidon/testing/launches.py) may bring its own runner; plain numpy
        # takes the kernels only inside host_runner
        module = backend.get_array_module(array)
        factory = _host_factory if module is numpy else getattr(module, "kernel_runner", None)
        return None if factory is None else factory(dtype)
    cupy = backend.cupy
    if cupy is None or not isinstance(array, cupy.ndarray):
        return None
    key = (cupy.cuda.Device().id, dtype)
    runner = _runners.get(key)
    if runner is None:
        runner = _runners[key] = CupyRunner(cupy, dtype)
    return runner


@contextlib.contextmanager
def host_runner(factory):
    """Within the block, numpy arrays take the layers' kernel branch through factory(dtype), a
    runner of the host build: how the tests run that branch on a machine without a GPU."""
    global _host_factory
    previous, _host_factory = _host_factory, factory
    try:
        yield
    finally:
        _host_factory = previous

