"""Solvers: learning-rate policies, the per-parameter update rules, and the training loop.

    from poseidon.engine.solvers import get_solver, make_rule
    solver = get_solver("solver.prototxt"); solver.solve()

`rules.make_rule(solver_param)` gives the update rule alone (what KV-store servers and SFB workers
apply); `update_layer` applies it to one layer's range of the flat buffers (engine/flat_params.py);
`Solver` is Caffe's loop around it.
"""
from .lr_policy import learning_rate, POLICIES  # noqa: F401
from .rules import (make_rule, rule_types, clip_scale, clip_factor, global_norm_sq,  # noqa: F401
                    UpdateRule)
from .flat_update import update_layer, update_params  # noqa: F401
from .hooks import SolverHooks  # noqa: F401
from .logs import GlogFormatter, final_accuracy_lines, log_to_stderr  # noqa: F401
from .solver import Solver, get_solver  # noqa: F401
from .solverfile import check_solver_file  # noqa: F401
