"""Learning-rate policies: Caffe's `SGDSolver::GetLearningRate` as a pure function of the iteration.

`it` is the number of updates already applied (0 for the first update), as in Caffe. The policies:

    fixed      base_lr
    step       base_lr * gamma ^ floor(it / stepsize)
    exp        base_lr * gamma ^ it
    inv        base_lr * (1 + gamma * it) ^ (-power)
    multistep  base_lr * gamma ^ current_step,  current_step = number of stepvalues <= it
    poly       base_lr * (1 - it / max_iter) ^ power
    sigmoid    base_lr / (1 + exp(-gamma * (it - stepsize)))

Caffe advances multistep's `current_step` by at most one per call; for increasing, distinct
stepvalues visited from iteration 0 that is exactly "the count of stepvalues <= it", which also gives
the right rate after a restore or in a server that only sees some iterations.
"""
import math

from ..errors import ModelError

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")

# Fields each formula reads (besides base_lr); a solver file that leaves one unset is refused, since
# proto2 would silently read it as 0 (e.g. "step" without gamma drops the rate to 0 forever).
_NEEDS = {
    "fixed": (),
    "step": ("gamma", "stepsize"),
    "exp": ("gamma",),
    "inv": ("gamma", "power"),
    "multistep": ("gamma", "stepvalue"),
    "poly": ("power", "max_iter"),
    "sigmoid": ("gamma", "stepsize"),
}


def _is_set(param, field):
    value = getattr(param, field)
    if field == "stepvalue":
        return len(value) > 0
    has = getattr(param, "HasField", None)
    return has(field) if has is not None else value is not None


def check(solver_param):
    """Raise ModelError unless the solver's lr_policy is known and has every field it uses."""
    policy = solver_param.lr_policy
    if policy not in _NEEDS:
        shown = f"'{policy}'" if policy else "nothing (lr_policy is unset)"
        raise ModelError(f"solver: unknown learning rate policy {shown}; use one of "
                         f"{', '.join(POLICIES)} (e.g. lr_policy: \"fixed\")")
    missing = [f for f in _NEEDS[policy] if not _is_set(solver_param, f)]
    if missing:
        raise ModelError(f"solver: lr_policy \"{policy}\" needs {' and '.join(missing)}, which the "
                         f"solver file does not set")
    if policy == "step" and solver_param.stepsize <= 0:
        raise ModelError(f"solver: lr_policy \"step\" needs stepsize > 0, got {solver_param.stepsize}")
    if policy == "poly" and solver_param.max_iter <= 0:
        raise ModelError(f"solver: lr_policy \"poly\" needs max_iter > 0, got {solver_param.max_iter}")


def current_step(solver_param, it):
    """Caffe's `current_step_` after the rate for iteration `it` (step and multistep; 0 otherwise)."""
    policy = solver_param.lr_policy
    if policy == "step":
        return int(it) // int(solver_param.stepsize)
    if policy == "multistep":
        return sum(1 for v in solver_param.stepvalue if it >= v)
    return 0


def _pow(base, exponent):
    """C's pow: inf on overflow, nan for a negative base with a fractional exponent."""
    try:
        return math.pow(base, exponent)
    except OverflowError:
        return math.inf
    except ValueError:
        return math.nan


def learning_rate(solver_param, it):
    """The learning rate (a Python float) Caffe uses for the update at iteration `it`."""
    check(solver_param)
    return checked_rate(solver_param, it)


def checked_rate(solver_param, it):
    """learning_rate without the field checks, for callers that ran check() once (the rules)."""
    p = solver_param
    policy = p.lr_policy
    it = int(it)
    if policy == "fixed":
        return float(p.base_lr)
    if policy in ("step", "multistep"):
        return p.base_lr * _pow(p.gamma, current_step(p, it))
    if policy == "exp":
        return p.base_lr * _pow(p.gamma, it)
    if policy == "inv":
        return p.base_lr * _pow(1.0 + p.gamma * it, -p.power)
    if policy == "poly":
        return p.base_lr * _pow(1.0 - float(it) / float(p.max_iter), p.power)
    # sigmoid
    try:
        e = math.exp(-p.gamma * (float(it) - float(p.stepsize)))
    except OverflowError:
        e = math.inf
    return p.base_lr * (1.0 / (1.0 + e))
