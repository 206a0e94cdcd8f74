"""Array backends: numpy always, CuPy when installed and a GPU is chosen.

Every layer asks `get_array_module(array)` once per method and then writes one code path for both,
as Chainer does. Only this module imports CuPy, so a machine without it never sees an ImportError.
"""
import contextlib

import numpy

from . import settings

try:  # CuPy is an optional extra (`pip install -e '.[gpu]'`).
    import cupy
except Exception:  # pragma: no cover - depends on the machine
    cupy = None

_state = {"xp": numpy, "device": None, "chosen_device": 0, "test_xp": None}


def gpu_available():
    """True when CuPy imports and sees at least one CUDA device."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def set_mode_cpu():
    _state["xp"] = numpy
    _state["device"] = None


def set_device(device):
    """pycaffe's set_device: the GPU that set_mode_gpu() uses (now, if GPU mode is on)."""
    _state["chosen_device"] = int(device)
    if _state["device"] is not None:
        set_mode_gpu(device)


def set_mode_gpu(device=None):
    """Make CuPy the default array module for nets built from now on, on the given device (default:
    the one set_device chose, else 0)."""
    device = _state["chosen_device"] if device is None else int(device)
    if not gpu_available():
        raise RuntimeError("GPU mode asked for, but CuPy is not installed or sees no CUDA device: "
                           "install the gpu extra (pip install -e '.[gpu]') or drop --gpu")
    count = cupy.cuda.runtime.getDeviceCount()
    if not 0 <= int(device) < count:
        raise RuntimeError(f"there is no GPU {device}: CUDA sees {count} device(s), ids 0 to "
                           f"{count - 1}; give one of those")
    cupy.cuda.Device(device).use()
    _state["xp"] = cupy
    _state["device"] = device
    if tf32_requested():
        set_tf32(True)


TF32_VARIABLE = settings.VARIABLES["tf32"]


def tf32_requested():
    """Whether --tf32 (or POSEIDON_TF32=1, which the processes of a job inherit) asked for TF32."""
    return settings.current().tf32


def set_tf32(enabled):
    """Let CuPy's float32 GEMMs (the engine's convolutions and InnerProducts go through them)
    round their inputs to TF32 on the tensor cores of Ampere and newer GPUs, or keep full FP32
    (the default, as numpy computes). The setting is CuPy's compute type for float32
    (cupy._core.set_compute_type; CUPY_TF32=1 sets it for a fresh process), and the engine's tf32
    setting follows it. Returns 'tf32', 'fp32', or a sentence saying why TF32 could not be set
    (no CuPy, a GPU older than Ampere, a CuPy without the setting)."""
    settings.configure(tf32=bool(enabled))
    if cupy is None:
        return "CuPy is not installed: TF32 is a GPU math mode"
    try:
        from cupy._core import _routines_linalg as linalg
        compute_type = linalg.COMPUTE_TYPE_TF32 if enabled else linalg.COMPUTE_TYPE_DEFAULT
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # CuPy warns, and keeps FP32, before Ampere
            cupy._core.set_compute_type(numpy.float32, compute_type)
    except Exception as e:
        return f"TF32 not set ({type(e).__name__}: {e}); the engine computes in FP32"
    return "tf32" if enabled else "fp32"


def gpu_ids(gpu):
    """Caffe's --gpu as device ids: None for the CPU (None, '', 'cpu', 'none' or '-1'), else the
    list of ids; a bad value is one PoseidonError line."""
    from .errors import PoseidonError
    if gpu is None or str(gpu).strip().lower() in ("", "none", "cpu", "-1"):
        return None
    try:
        ids = [int(x) for x in str(gpu).split(",")]
    except ValueError:
        raise PoseidonError(f"--gpu takes a device id or a comma-separated list, got "
                            f"'{gpu}'; give e.g. --gpu 0 or --gpu 0,1 (or omit it for the "
                            f"CPU)") from None
    if any(i < 0 for i in ids):
        raise PoseidonError(f"--gpu takes device ids >= 0, got '{gpu}'; omit it for the CPU")
    return ids


def set_mode_from_flag(gpu, local_rank=0):
    """Caffe's --gpu: None, '', 'cpu' or '-1' for the CPU; a device id; or a comma-separated list of
    ids, of which the process with this local rank takes one in turn."""
    from .errors import PoseidonError
    ids = gpu_ids(gpu)
    if ids is None:
        set_mode_cpu()
        return
    try:
        set_mode_gpu(ids[local_rank % len(ids)])
    except RuntimeError as e:   # no CuPy, no CUDA device, or no device of that id
        raise PoseidonError(f"--gpu {gpu}: {e}") from None


def device_scope(device):
    """A context in which CuPy allocates and launches on GPU `device`; nothing for None (the CPU,
    or the current device)."""
    if device is None or cupy is None:
        return contextlib.nullcontext()
    return cupy.cuda.Device(int(device))


def on_device_of(array, like):
    """`array` where `like` lives: itself when they share a device (or are numpy), else a copy
    onto like's GPU (CuPy copies between devices, peer to peer where the GPUs allow it)."""
    if cupy is None or not isinstance(like, cupy.ndarray) or array.device == like.device:
        return array
    with like.device:
        return array.copy()


def set_array_module_for_tests(xp):
    """Make `xp`, a stand-in that looks like CuPy (poseidon/testing/launches.py's CountingModule), the array
    module of nets built from now on, as set_mode_gpu makes CuPy: the engine then runs the code
    path it runs on a GPU. None puts back the module that was in use before."""
    if xp is None:
        _state["xp"] = _state.pop("before_test_xp", _state["xp"])
    else:
        _state.setdefault("before_test_xp", _state["xp"])
        _state["xp"] = xp
    _state["test_xp"] = xp


def record_event(xp):
    """A CUDA event recorded on the current stream (None on the CPU): work on another stream that
    must follow what was queued so far waits on it (a non-blocking stream does not wait for the
    default one)."""
    if xp is numpy:
        return None
    event = xp.cuda.Event(block=False, disable_timing=True)
    event.record()
    return event


def default_xp():
    """The array module new nets allocate with (numpy unless set_mode_gpu was called)."""
    return _state["xp"]


def get_array_module(*arrays):
    """numpy or cupy, whichever owns the arrays (numpy when CuPy is absent; the stand-in that
    set_array_module_for_tests installed, for its arrays)."""
    test_xp = _state["test_xp"]
    if test_xp is not None and test_xp.get_array_module(*arrays) is test_xp:
        return test_xp
    if cupy is not None:
        return cupy.get_array_module(*arrays)
    return numpy


def to_numpy(array):
    """A host numpy copy (or the array itself when it already is numpy)."""
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy.asnumpy(array)
    test_xp = _state["test_xp"]
    if test_xp is not None and isinstance(array, test_xp.ndarray):
        return test_xp.asnumpy(array)
    return numpy.asarray(array)


def to_xp(array, xp):
    """Move a host array to the module xp (no copy when it already lives there)."""
    if xp is numpy:
        return to_numpy(array)
    return xp.asarray(array)


def synchronize(xp):
    """Wait until the device has finished the work queued so far (nothing to wait for on numpy),
    so that a clock read afterwards includes it."""
    if xp is not numpy:
        xp.cuda.Device().synchronize()


def device_name(xp):
    """What runs xp's arrays, for keys of per-device measurements: 'cpu', or the name of the
    current CUDA device (e.g. 'NVIDIA H100 80GB HBM3')."""
    if xp is numpy:
        return "cpu"
    device = xp.cuda.Device().id
    if device not in _device_names:
        name = xp.cuda.runtime.getDeviceProperties(device).get("name", b"gpu")
        _device_names[device] = name.decode() if isinstance(name, bytes) else str(name)
    return _device_names[device]


_device_names = {}


def pinned_empty(shape, dtype):
    """Host buffer for device<->host moves: page-locked on a GPU machine, plain numpy otherwise."""
    if _state["xp"] is not numpy and cupy is not None:
        import cupyx
        return cupyx.empty_pinned(shape, dtype)
    return numpy.empty(shape, dtype)


class NullStream:
    """Stand-in for a CUDA stream on the CPU, so callers write one code path."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


def new_stream():
    """A non-blocking CUDA stream on GPU, a no-op stream on CPU."""
    if _state["xp"] is not numpy and cupy is not None:
        return cupy.cuda.Stream(non_blocking=True)
    return NullStream()
