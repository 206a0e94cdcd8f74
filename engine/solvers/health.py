"""The NaN/Inf stop of a training step on a GPU, kept on the device until someone reads it.

On numpy the solver checks the loss and every gradient on the host each iteration (engine/solvers/
solver.py: check_finite), which costs nothing there. On a GPU that check is a host sync per step:
the host waits for the device to drain, then launches the next step's kernels from an idle device.
So a device step records instead, and reads at the next display, test or snapshot (or the end of
step()): for each parameter gradient and for the loss, the first iteration at which it was not
finite (a device vector, NEVER where it never was). The stop then names the iteration where it
first happened and the first layer (in backward order) whose gradient went bad then, as on numpy;
the parameters have been updated with the bad values meanwhile, which the stop discards anyway
(no snapshot is written after it).

Per step the record is one launch when every gradient lies in the net's flat diff buffer
(engine/flat_params.py): a kernel reads the flat gradient once and, only where an element is not
finite, lowers its parameter's entry to the iteration (an atomic minimum: the parameter found by a
binary search of the slice offsets, as the fused update does); one thread looks at the loss.
Otherwise, or when clip_gradients needs the norm, it is one reduction per parameter (a sum, or
the sum of squares: `sums` then holds the squares, and `norm_sq` their total for the scale), one
stack and three elementwise launches. No host read either way.
"""
import functools

import math

import numpy

from .. import backend
from ..errors import PoseidonError

NEVER = numpy.iinfo(numpy.int64).max


def all_finite(array):
    """True when every element of `array` is finite. One reduction (the sum) decides in the usual
    case; the elementwise test runs only when the sum is not finite (NaN/Inf, or an overflow)."""
    xp = backend.get_array_module(array)
    if xp is numpy:                       # the ufunc's reduce: no Python layer of ndarray.sum
        if math.isfinite(numpy.add.reduce(array, axis=None)):
            return True
    elif bool(xp.isfinite(array.sum())):
        return True
    return bool(xp.isfinite(array).all())


def param_label(bi):
    """'weight', 'bias' or 'param #k' for a layer's k-th parameter blob (for messages)."""
    return ("weight", "bias")[bi] if bi < 2 else f"param #{bi}"




# Per gradient element i of the flat buffer: nothing while finite; else the parameter's entry of
# first_bad (slot[k] for the slice k holding i) takes min(entry, it). Element 0 also checks the
# loss (entry loss_slot).
_FIRST_BAD = """
if (!isfinite(g)) {
  int lo_ = 0;
  int hi_ = nslices - 1;
  while (lo_ < hi_) {
    int mid_ = (lo_ + hi_ + 1) >> 1;
    if (off[mid_] <= (long long)i) lo_ = mid_; else hi_ = mid_ - 1;
  }
  atomicMin((long long*)&first_bad[slot[lo_]], (long long)it);
}
if (i == 0 && !isfinite(loss[0])) atomicMin((long long*)&first_bad[loss_slot], (long long)it);
"""


def kernel_source(ctype="float", host=False):
    """_FIRST_BAD wrapped in a plain C function, for checking it without CuPy: a __global__
    function (one thread per element) for `nvcc --ptx`, or with `host` a loop over the elements
    that a C++ compiler builds for the CPU (the test supplies atomicMin and isfinite there)."""
    args = ("const T* g_, const long long* off, const long long* slot, int nslices, "
            "const T* loss, long long it, long long loss_slot, long long* first_bad, long long n")
    if host:
        head, tail = "  for (long long i = 0; i < n; ++i) {\n", "}}\n"
    else:
        head = ("  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
                "  if (i >= n) return;\n")
        tail = "}\n"
    return (f"namespace first_bad_{ctype} {{\ntypedef {ctype} T;\n"
            f"extern \"C\" {'' if host else '__global__ '}void first_bad_{ctype}({args}) {{\n"
            f"{head}  const T g = g_[i];\n{_FIRST_BAD}{tail}}}\n")


@functools.lru_cache(maxsize=None)
def _first_bad_kernel():
    return backend.cupy.ElementwiseKernel(
        "T g, raw int64 off, raw int64 slot, int32 nslices, raw T loss, int64 it, "
        "int64 loss_slot", "raw int64 first_bad", _FIRST_BAD, "poseidon_first_bad")


def _first_bad_twin(g, off, slot, nslices, loss, it, loss_slot, first_bad):
    """_FIRST_BAD on numpy arrays (the launch-counting stand-in's computation)."""
    bad = ~numpy.isfinite(g)
    if bad.any():
        for k in range(int(nslices)):
            if bad[off[k]:off[k + 1]].any():
                first_bad[slot[k]] = min(first_bad[slot[k]], it)
    if not numpy.isfinite(loss):
        first_bad[loss_slot] = min(first_bad[loss_slot], it)


class DeviceHealth:
    """The first non-finite iteration of each of `count` parameter gradients and of the loss."""

    def __init__(self, xp, count):
        self.xp = xp
        self.count = count
        self.first_bad = xp.full(count + 1, NEVER, numpy.int64)   # params..., loss
        self.sums = None

    def record_flat(self, it, loss, flat):
        """Fold iteration `it`'s loss and the gradients in `flat` (FlatParams whose layout holds
        every learnable parameter) into first_bad: one launch."""
        xp = self.xp
        key = (flat.size, tuple(flat.order))
        if getattr(self, "_layout", (None,))[0] != key:
            off = [flat.offsets[pid] for pid in flat.order] + [flat.size]
            self._layout = (key, xp.asarray(numpy.array(off, numpy.int64)),
                            xp.asarray(numpy.array(flat.order, numpy.int64)))
        _, off, slot = self._layout
        loss = xp.asarray(loss, dtype=flat.diff.dtype).reshape(())
        counted = getattr(xp, "counted_kernel", None)
        kernel = _first_bad_kernel() if counted is None else counted(_first_bad_twin)
        kernel(flat.diff, off, slot, numpy.int32(len(flat.order)), loss, numpy.int64(it),
               numpy.int64(self.count), self.first_bad)
        self.sums = None

    def record(self, it, loss, grads, squares=False, flat=None):
        """Fold iteration `it`'s loss and gradients into first_bad. `squares`: reduce each
        gradient to its sum of squares (the norm clip_gradients needs: `norm_sq()`), else to its
        sum (as non-finite as any of its elements, and overflowing only near the dtype's max).
        `flat`: the net's FlatParams; when its diff holds every gradient (and no norm is
        needed), the one-launch record_flat."""
        xp = self.xp
        if (not squares and flat is not None and flat.size and len(grads) == len(flat.order)
                and flat.runs(flat.order) == ([(0, flat.size)], [])):
            self.record_flat(it, loss, flat)
            return
        parts = []
        for g in grads:
            flat = g.reshape(-1)
            parts.append(xp.vdot(flat, flat) if squares else flat.sum())
        dtype = parts[0].dtype if parts else numpy.float32
        parts.append(xp.asarray(loss, dtype=dtype).reshape(()))
        values = xp.stack(parts)                                         # count + 1
        self.sums = values[:-1] if squares else None
        finite = xp.isfinite(values)
        xp.minimum(self.first_bad, xp.where(finite, NEVER, it), out=self.first_bad)

    def norm_sq(self):
        """The sum of squared gradients of the last record(squares=True), on the device."""
        return self.sums.sum()

    def check(self, net, params):
        """Raise the solver's NaN/Inf stop if a recorded iteration was not finite (one host read).
        `params`: the learnable parameter blobs, in the order the gradients were recorded."""
        first = backend.to_numpy(self.first_bad)
        bad_at = int(first.min())
        if bad_at == NEVER:
            return
        pid_of = {id(b): pid for pid, b in enumerate(params)}
        culprit = first_bad_param(net, lambda blob: pid_of.get(id(blob)) is not None
                                  and first[pid_of[id(blob)]] == bad_at)
        raise nonfinite_stop(bad_at, "not finite" if first[-1] == bad_at else "finite", culprit,
                             "; on a GPU the check is read at the display, so training ran on "
                             "to here")


def first_bad_param(net, is_bad):
    """(layer, blob index) of the first parameter blob, in backward order, that `is_bad`, or None."""
    for li in reversed(range(len(net.layers))):
        layer = net.layers[li]
        for bi, blob in enumerate(layer.blobs):
            if is_bad(blob):
                return layer, bi
    return None


def nonfinite_stop(iteration, loss_text, culprit, note=""):
    """The solver's NaN/Inf stop: one error naming the iteration and the first layer (in backward
    order) whose gradient is not finite, or the forward pass where every gradient is."""
    if culprit is None:
        detail = ("every parameter gradient is finite, so the forward pass made it: check the "
                  "input data and the loss layer's inputs")
    else:
        layer, bi = culprit
        detail = (f"the first non-finite parameter gradient (in backward order) is in layer "
                  f"'{layer.name}' (type {layer.type}), param #{bi}")
    return PoseidonError(f"iteration {iteration}: loss is {loss_text}; {detail}; lower base_lr or "
                         f"set clip_gradients (no snapshot was written{note})")
