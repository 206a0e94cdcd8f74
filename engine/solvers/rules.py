"""The update rule: one parameter's (value, gradient, state, iteration) -> new value and state.

This is the one place the solver's arithmetic lives. A single process, a KV-store server holding a
slice of a parameter and a worker applying sufficient factors all call `rule.update` on their arrays,
or `rule.apply` on a flat range of several parameters (engine/flat_params.py: each with its own
multipliers), so every path gives the same numbers. The rule is elementwise, so a slice of a
parameter updated on a server equals the same slice of the whole parameter updated locally.

    rule = make_rule(solver_param)                 # "SGD", "Nesterov", "AdaGrad", "RMSProp",
    state = rule.init_state(w.shape, xp, w.dtype)  # "AdaDelta" or "Adam" (or legacy solver_type)
    rule.update(w, g, state, it, lr_mult, decay_mult, grad_scale)
    rule.apply(flat_w, flat_g, flat_state, it, slice_mults, grad_scale)   # several parameters

On numpy both run the in-place ufuncs below; on CuPy both are one fused kernel per call
(engine/solvers/fused.py), the same formulas in the same order.

`update` follows Caffe's SGDSolver::ApplyUpdate for one parameter (sgd_solver.cpp and the
nesterov/adagrad/rmsprop/adadelta/adam solvers):
  1. g *= grad_scale      (the caller's global clip_gradients factor times 1/iter_size)
  2. regularize           L2: g += weight_decay*decay_mult * w ; L1: g += weight_decay*decay_mult * sign(w)
  3. the type's rule      with local_rate = rate(it) * lr_mult, giving the step u
  4. w -= u
Scalars are taken in the value's dtype, as Caffe's Dtype. No arrays are allocated per call: the
gradient array is used as scratch (its content afterwards is unspecified) and the temporaries come
from a per-thread buffer reused across calls (`release_scratch()` frees it).
"""
import functools
import math
import threading

import numpy

from ..backend import get_array_module
from ..errors import ModelError
from ..proto import caffe_pb2
from . import lr_policy

# Deprecated SolverParameter.solver_type enum -> type string (upgrade_proto.cpp UpgradeSolverType).
LEGACY_TYPES = {0: "SGD", 1: "Nesterov", 2: "AdaGrad", 3: "RMSProp", 4: "AdaDelta", 5: "Adam"}

_RULES = {}


def _register(cls):
    _RULES[cls.type] = cls
    return cls


def rule_types():
    return sorted(_RULES)


def solver_type(solver_param):
    """The solver's type string, upgrading the deprecated `solver_type` enum as Caffe does."""
    has = solver_param.HasField
    if has("solver_type"):
        if has("type"):
            raise ModelError("solver: the old solver_type field (enum) and the new type field "
                             "(string) cannot both be given; keep only type: \"...\"")
        return LEGACY_TYPES[solver_param.solver_type]
    return solver_param.type


def make_rule(solver_param):
    """The update rule the solver parameters ask for (a picklable object)."""
    name = solver_type(solver_param)
    try:
        cls = _RULES[name]
    except KeyError:
        raise ModelError(f"solver: unknown solver type '{name}': use one of "
                         f"{', '.join(rule_types())} (the names are case-sensitive)") from None
    return cls(solver_param)


# ----- gradient clipping (Caffe's SGDSolver::ClipGradients) ---------------------------------------
def global_norm_sq(grads):
    """Sum of squares over every array in grads (a Python float); the distributed code sums the
    partial values of its shards and passes the total to clip_factor / clip_scale(norm_sq=...)."""
    total = 0.0
    for g in grads:
        xp = get_array_module(g)
        flat = g.reshape(-1)
        total = total + xp.vdot(flat, flat)
    return float(total)


def clip_factor(clip_gradients, norm_sq):
    """min(1, clip / ||g||) as Caffe applies it: 1.0 when clip < 0 or the norm is within bounds."""
    if clip_gradients < 0:
        return 1.0
    norm = math.sqrt(norm_sq)
    return clip_gradients / norm if norm > clip_gradients else 1.0


def clip_factor_on_device(clip_gradients, norm_sq):
    """clip_factor with the squared norm a device scalar, computed on the device (a 0-d array):
    the host never reads the norm, so a GPU step need not wait for its gradients."""
    xp = get_array_module(norm_sq)
    norm = xp.sqrt(norm_sq)
    return xp.where(norm > clip_gradients, clip_gradients / norm, norm.dtype.type(1))


def clip_scale(solver_param, grads, norm_sq=None):
    """The factor every gradient is multiplied by for solver_param.clip_gradients, over ALL grads."""
    clip = solver_param.clip_gradients
    if clip < 0:
        return 1.0
    return clip_factor(clip, global_norm_sq(grads) if norm_sq is None else norm_sq)


# Parameters of at least BLOCKED_MIN elements are updated block by block (see UpdateRule.update).
BLOCKED_MIN = 1 << 18
BLOCK = 1 << 17
GRAD_SLOT = 7          # the scratch slot of a kept gradient's copy (the rules use 0 and 1)

# ----- per-thread scratch buffers -------------------------------------------------------------------
_local = threading.local()


def _scratch(like, slot=0):
    """A buffer shaped like `like` (same module, dtype, device), reused across calls in this thread."""
    cache = getattr(_local, "buffers", None)
    if cache is None:
        cache = _local.buffers = {}
    device = getattr(like, "device", None)
    key = (type(like), like.dtype.str, str(getattr(device, "id", device)), slot)
    buf = cache.get(key)
    if buf is None or buf.size < like.size:
        xp = get_array_module(like)
        buf = cache[key] = xp.empty(max(like.size, 1), like.dtype)
    return buf[:like.size].reshape(like.shape)


def _copy_of(array):
    """array copied into this thread's scratch slot for gradients kept (UpdateRule.update)."""
    out = _scratch(array, GRAD_SLOT)
    get_array_module(array).copyto(out, array)
    return out


def release_scratch():
    """Free this thread's scratch buffers (they grow to the largest parameter updated)."""
    _local.buffers = {}


@functools.lru_cache(maxsize=1024)
def _one_slice(count, lr_mult, decay_mult):
    """The SliceMults of one parameter, kept so its device copy is made once."""
    from ..flat_params import SliceMults
    return SliceMults.single(count, lr_mult, decay_mult)


def _rows_contiguous(arrays):
    """Whether the arrays are 2-D of one shape, each row contiguous (blocks of rows are then
    cut along the first axis)."""
    shape = arrays[0].shape
    return all(a.ndim == 2 and a.shape == shape and a.strides[1] == a.itemsize
               for a in arrays)


# ----- the rules -----------------------------------------------------------------------------------
class UpdateRule:
    """Base: regularization and the learning rate; subclasses give `_step` (Caffe's
    ComputeUpdateValue followed by Blob::Update)."""

    type = None
    num_state = 1

    def __init__(self, solver_param):
        param = caffe_pb2.SolverParameter()
        param.CopyFrom(solver_param)
        for big in ("net_param", "train_net_param", "test_net_param"):
            param.ClearField(big)   # keep the rule small to pickle to servers
        self.param = param
        lr_policy.check(param)
        self.momentum = float(param.momentum)
        self.weight_decay = float(param.weight_decay)
        self.regularization = param.regularization_type
        if self.weight_decay != 0 and self.regularization not in ("L1", "L2"):
            raise ModelError(f"solver: unknown regularization_type '{self.regularization}'; "
                             f"use \"L2\" (the default) or \"L1\"")
        self.delta = float(param.delta)
        self.check()

    def check(self):
        """Per-type parameter checks (Caffe's solver constructors)."""

    def __repr__(self):
        return f"<{self.type} update rule, lr_policy {self.param.lr_policy}>"

    def __getstate__(self):   # pickled as bytes: the generated message class is not importable by name
        state = self.__dict__.copy()
        state.pop("_device_scalars", None)     # device arrays stay with their process
        state["param"] = self.param.SerializeToString()
        return state

    def __setstate__(self, state):
        param = caffe_pb2.SolverParameter()
        param.ParseFromString(state["param"])
        self.__dict__.update(state, param=param)

    def init_state(self, shape, xp=numpy, dtype=numpy.float32):
        """The zero history arrays of one parameter (Caffe's history_, in its order)."""
        return [xp.zeros(shape, dtype) for _ in range(self.num_state)]

    def rate(self, it):
        """Learning rate at iteration it (updates done so far), from lr_policy."""
        return lr_policy.checked_rate(self.param, it)

    def current_step(self, it):
        """What Caffe's SolverState.current_step holds after iteration it's rate."""
        return lr_policy.current_step(self.param, it)

    def apply(self, value, grad, state, it, mults, grad_scale=1.0, rate=None, keep_grad=False,
              split=True):
        """Apply one update to a flat range of parameters: `value`, `grad` and each `state` array
        are 1-D arrays of one size (slices of engine/flat_params.FlatParams' buffers, or of a
        KV pair), `mults` a SliceMults giving each parameter's slice and multipliers. This is
        the function every caller shares: the solver over the whole net or a layer's range, a
        worker over a layer it synchronised, a KV server over a pair (one slice).

        On CuPy it is one fused kernel (engine/solvers/fused.py; `grad_scale` may be a 0-d
        device array); on numpy the in-place ufuncs of `update`, once per run of parameters
        with equal multipliers."""
        if rate is None:
            rate = self.rate(it)
        if get_array_module(value) is not numpy:
            self._apply_fused(value, grad, state, it, mults, grad_scale, rate)
            return
        self._apply_runs(value, grad, state, it, mults, grad_scale, rate, keep_grad, split)

    def _apply_fused(self, value, grad, state, it, mults, grad_scale, rate):
        counted = getattr(get_array_module(value), "counted_kernel", None)
        if counted is not None:   # the launch-counting stand-in: one launch, the numpy twin
            counted(self._apply_runs)(value, grad, state, it, mults, grad_scale, rate)
            return
        from . import fused
        scalars = self.__dict__.get("_device_scalars")
        if scalars is None:
            scalars = self._device_scalars = fused.DeviceScalars()
        fused.apply(self, value, grad, state, mults, grad_scale, rate,
                    self.constants(it, value.dtype.type), scalars)

    def _apply_runs(self, value, grad, state, it, mults, grad_scale, rate, keep_grad=True,
                    split=True):
        """The numpy rule over a flat range: the in-place ufuncs of `update` once per run of equal
        multipliers. With keep_grad (the default) it is the fused kernel's numpy twin, which
        only reads the gradient."""
        for lo, hi, lr_mult, decay_mult in mults.runs():
            self.update(value[lo:hi], grad[lo:hi], [s[lo:hi] for s in state], it, lr_mult,
                        decay_mult, grad_scale, rate, split=split, keep_grad=keep_grad)

    def constants(self, it, s=numpy.float32):
        """The rule's own scalars at iteration it (s: the parameters' scalar type), by the names
        the fused kernel uses."""
        return {"momentum": self.momentum, "delta": self.delta}

    def update(self, value, grad, state, it, lr_mult=1.0, decay_mult=1.0, grad_scale=1.0,
               rate=None, split=True, keep_grad=False):
        """Apply one update to `value` and `state` in place. `grad` is the raw accumulated gradient
        and is used as scratch: its content afterwards is unspecified, unless `keep_grad` (a
        gradient that is someone's live buffer, as a worker's diff in a KV server's shared
        memory): then it is only read, bitwise the same update. `rate` (optional) is rate(it),
        for callers that already computed it.

        Large numpy parameters are updated in blocks of BLOCK elements (the handful of passes of
        the rule then run in cache instead of main memory), the blocks split over the cores
        (engine.parallel.parallel). The rule is elementwise, so every element gets the same
        arithmetic in the same order as an update of the whole array. `split=False` keeps the
        blocks on this thread (for a caller that gives each thread its own part)."""
        if rate is None:
            rate = self.rate(it)
        if get_array_module(value) is not numpy:   # one fused kernel (fused.py)
            self._apply_fused(value, grad, state, it, _one_slice(value.size, lr_mult, decay_mult),
                              grad_scale, rate)
            return
        arrays = [value, grad] + list(state)
        parts = None
        if value.size >= BLOCKED_MIN and get_array_module(value) is numpy:
            if all(a.flags.c_contiguous and a.size == value.size for a in arrays):
                parts, step = [a.reshape(-1) for a in arrays], BLOCK
            elif _rows_contiguous(arrays):      # a gradient block with padded rows (factored.py)
                parts, step = arrays, max(1, BLOCK // (value.size // value.shape[0]))
        if parts is None:
            self._update(value, grad, state, it, lr_mult, decay_mult, grad_scale, rate, keep_grad)
            return

        def work(worker, lo, hi):
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                v, g, *st = (x[a:b] for x in parts)
                self._update(v, g, st, it, lr_mult, decay_mult, grad_scale, rate, keep_grad)

        if not split:
            work(0, 0, len(parts[0]))
            return
        from ..parallel import parallel
        parallel().run(work, len(parts[0]), numpy, min_per_worker=step)

    def _update(self, value, grad, state, it, lr_mult, decay_mult, grad_scale, rate,
                keep_grad=False):
        """The rule on one array (or block). A kept gradient is not written: the first operation
        that would write it writes a scratch buffer instead, so keeping costs no extra pass."""
        s = value.dtype.type
        xp = get_array_module(value)
        on_device = not isinstance(grad_scale, (int, float, numpy.generic))  # a device scalar
        if on_device or grad_scale != 1:
            factor = grad_scale if on_device else s(grad_scale)
            if keep_grad:
                grad = xp.multiply(grad, factor, out=_scratch(value, GRAD_SLOT))
                keep_grad = False
            else:
                grad *= factor
        local_decay = s(self.weight_decay) * s(decay_mult)
        if local_decay:
            t = _scratch(value, GRAD_SLOT if keep_grad else 0)
            if self.regularization == "L2":
                xp.multiply(value, local_decay, out=t)
            else:
                xp.sign(value, out=t)
                t *= local_decay
            if keep_grad:
                grad = xp.add(grad, t, out=t)  # (a + b, as grad += t computes it)
                keep_grad = False
            else:
                grad += t
        if keep_grad:
            grad = _copy_of(grad)
        local_rate = s(rate) * s(lr_mult)
        self._step(value, grad, state, it, local_rate, s)

    def _step(self, value, g, state, it, local_rate, s):
        raise NotImplementedError


@_register
class SGD(UpdateRule):
    """h = momentum*h + lr*g ; w -= h   (no dampening)."""

    type = "SGD"

    def _step(self, value, g, state, it, local_rate, s):
        h = state[0]
        h *= s(self.momentum)
        g *= local_rate
        h += g
        value -= h


@_register
class Nesterov(UpdateRule):
    """h_old = h ; h = momentum*h + lr*g ; w -= (1+momentum)*h - momentum*h_old."""

    type = "Nesterov"

    def _step(self, value, g, state, it, local_rate, s):
        xp = get_array_module(value)
        h = state[0]
        m = s(self.momentum)
        u = _scratch(value)
        xp.copyto(u, h)                       # u = h_old
        h *= m
        g *= local_rate
        h += g                                # h = m*h_old + lr*g
        u *= -m
        xp.multiply(h, s(1) + m, out=g)
        u += g                                # u = (1+m)*h - m*h_old
        value -= u


def _refuse_momentum(rule):
    if rule.momentum != 0:
        raise ModelError(f"solver: momentum cannot be used with {rule.type}; remove momentum "
                         f"from the solver file")


def _divide_by_root(value, g, h, u, local_rate, delta):
    """w -= lr * g / (sqrt(h) + delta), with u as scratch (AdaGrad and RMSProp share this step)."""
    xp = get_array_module(value)
    xp.sqrt(h, out=u)
    u += delta
    xp.divide(g, u, out=u)
    u *= local_rate
    value -= u


@_register
class AdaGrad(UpdateRule):
    """h += g^2 ; w -= lr * g / (sqrt(h) + delta)."""

    type = "AdaGrad"

    def check(self):
        _refuse_momentum(self)

    def _step(self, value, g, state, it, local_rate, s):
        xp = get_array_module(value)
        h = state[0]
        u = _scratch(value)
        xp.multiply(g, g, out=u)
        h += u
        _divide_by_root(value, g, h, u, local_rate, s(self.delta))


@_register
class RMSProp(UpdateRule):
    """h = rms_decay*h + (1-rms_decay)*g^2 ; w -= lr * g / (sqrt(h) + delta)."""

    type = "RMSProp"

    def check(self):
        _refuse_momentum(self)
        if not 0 <= self.param.rms_decay < 1:
            raise ModelError(f"solver: rms_decay should lie in [0, 1), got {self.param.rms_decay}")

    def constants(self, it, s=numpy.float32):
        return dict(super().constants(it, s), rms_decay=self.param.rms_decay)

    def _step(self, value, g, state, it, local_rate, s):
        xp = get_array_module(value)
        h = state[0]
        decay = s(self.param.rms_decay)
        u = _scratch(value)
        xp.multiply(g, g, out=u)
        h *= decay
        u *= s(1) - decay
        h += u
        _divide_by_root(value, g, h, u, local_rate, s(self.delta))


@_register
class AdaDelta(UpdateRule):
    """hg = m*hg + (1-m)*g^2 ; u = g*sqrt((hu+delta)/(hg+delta)) ; hu = m*hu + (1-m)*u^2 ;
    w -= lr*u   (m = momentum; state = [hg, hu])."""

    type = "AdaDelta"
    num_state = 2

    def _step(self, value, g, state, it, local_rate, s):
        xp = get_array_module(value)
        hg, hu = state
        m = s(self.momentum)
        delta = s(self.delta)
        t1 = _scratch(value, 0)
        t2 = _scratch(value, 1)
        xp.multiply(g, g, out=t1)
        hg *= m
        t1 *= s(1) - m
        hg += t1                              # history of gradients
        xp.add(hu, delta, out=t1)
        xp.add(hg, delta, out=t2)
        t1 /= t2
        xp.sqrt(t1, out=t1)
        g *= t1                               # the update, before the learning rate
        xp.multiply(g, g, out=t1)
        hu *= m
        t1 *= s(1) - m
        hu += t1                              # history of updates
        g *= local_rate
        value -= g


@_register
class Adam(UpdateRule):
    """m = b1*m + (1-b1)*g ; v = b2*v + (1-b2)*g^2 ; t = it+1 ;
    w -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps)   (b1 = momentum, b2 = momentum2,
    eps = delta; state = [m, v])."""

    type = "Adam"
    num_state = 2

    def _correction(self, it, s):
        """sqrt(1-b2^t)/(1-b1^t) at t = it+1, from the betas in the value's dtype."""
        b1, b2 = s(self.momentum), s(self.param.momentum2)
        t = int(it) + 1
        return s(math.sqrt(1.0 - math.pow(float(b2), t)) / (1.0 - math.pow(float(b1), t)))

    def constants(self, it, s=numpy.float32):
        return dict(super().constants(it, s), momentum2=self.param.momentum2,
                    correction=self._correction(it, s))

    def _step(self, value, g, state, it, local_rate, s):
        xp = get_array_module(value)
        m, v = state
        b1 = s(self.momentum)
        b2 = s(self.param.momentum2)
        correction = self._correction(it, s)
        u = _scratch(value)
        m *= b1
        xp.multiply(g, s(1) - b1, out=u)
        m += u
        xp.multiply(g, g, out=u)
        v *= b2
        u *= s(1) - b2
        v += u
        xp.sqrt(v, out=u)
        u += s(self.delta)
        xp.divide(m, u, out=u)
        u *= local_rate * correction
        value -= u
