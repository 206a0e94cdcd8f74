"""The training loop: Caffe's Solver (solver.cpp) around the update rules of rules.py.

    solver = get_solver("prototxt/cifar10_quick/solver.prototxt")
    solver.solve()                      # or solver.step(n), as pycaffe

One iteration of `step` (Caffe's Solver::Step, same order and same log lines):
  the iteration's plan (which InnerProduct weights are made from their sufficient factors, block by
  block inside the update: engine/solvers/factored.py) -> test all nets when iter % test_interval
  == 0 (at iter 0 only if test_initialization) -> forward_backward() (iter_size passes, mean loss;
  the gradients cleared before the first backward) -> check_finite(loss) -> smoothed loss and the
  display lines -> apply_update() (clip -> 1/iter_size -> regularize -> rule, for every learnable
  parameter) -> iter += 1 -> snapshot when iter % snapshot == 0.

It is the one loop for everyone: a SolverHooks object (engine/solvers/hooks.py) sees each iteration
at fixed points, and with hooks that synchronise each layer after its backward the same loop is a
distributed worker. The solver file is read and checked in solverfile.py, its nets are built in
nets.py, test passes and the output lines are in evaluation.py, snapshots are written in
snapshots.py, and the log is in glog's line format (logs.py), so Caffe's log parsers read it.
"""
import logging
import math
import os
import sys
import time

import numpy

from .. import backend, graphs, rng
from ..errors import ModelError, PoseidonError
from ..io import manifest
from ..proto import caffe_pb2
from ..replicas import ReplicaGroup, check_replicas
from . import rules
from .factored import FactoredWeights, update_from_factors
from .flat_update import update_params
from ..flat_params import FlatParams
from .health import DeviceHealth, all_finite, first_bad_param, nonfinite_stop
from .smoothing import SmoothedLoss
from . import evaluation, snapshots, solverfile
from .logs import g as _g, log_to_stderr, logging_configured
from .hooks import SolverHooks
from .nets import NetBuilder

log = logging.getLogger("poseidon")


# ----- the solver ------------------------------------------------------------------------------------

class Solver:
    """Caffe's Solver with the update rule of the solver file's `type`.

    solver_param_or_path: a SolverParameter or a solver prototxt path. dtype/xp: the nets' float type
    and array module (default: float32 on the mode set by engine.set_mode_cpu/gpu). shard=(rank,
    size): the train net's data shard. level/stages: merged into train_state (the CLI's --level and
    --stage). weights: extra .caffemodel paths to initialise from (like the solver's `weights`).
    progress: show a tqdm bar when stderr is a terminal. solver_type: the update rule to use whatever
    the file says (pycaffe's SGDSolver, AdamSolver, ...). hooks: a SolverHooks (engine/solvers/hooks.py)
    the loop calls at fixed points; none for a solver that trains alone. replicas/devices: the
    train net runs as that many replicas (one per device, a GPU id each, in GPU mode), each on
    batch_size, their gradients averaged into `net`'s layer by layer (engine/replicas.py).
    """

    def __init__(self, solver_param_or_path, dtype=numpy.float32, xp=None, shard=(0, 1),
                 level=None, stages=None, weights=None, progress=False, test_shard=(0, 1),
                 solver_type=None, hooks=None, replicas=1, devices=None):
        self.source, param = _solver_param(solver_param_or_path, solver_type, level, stages,
                                           weights)
        self.param = param
        self.dtype = numpy.dtype(dtype)
        self.xp = xp or backend.default_xp()
        self.shard, self.test_shard = tuple(shard), tuple(test_shard)
        self.progress = progress
        self.hooks = hooks if hooks is not None else SolverHooks()
        if not logging_configured():
            log_to_stderr()
        check_replicas(replicas, devices, self.xp)
        try:
            self._check_param()
            self.rule = rules.make_rule(param)
        except ModelError as e:
            raise self._at_key(e) from None
        if param.random_seed >= 0:
            rng.seed(param.random_seed)          # before the nets: fillers draw from it
        nets = NetBuilder(param, self.source, self.dtype, self.xp)
        with backend.device_scope(devices[0] if devices else None):
            self.net, build_replica = nets.train_net(self.shard, replicas)
            # parameters, gradients and history as views of flat buffers in backward order
            # (engine/flat_params.py), before the test nets take the train net's blobs
            self.net.flat = FlatParams(self.net)
            self.history = self.net.flat.attach_history(self.rule.num_state)
            self.test_nets = nets.test_nets(self.test_shard, self.net)
            # after the test nets, so that a solver of one replica draws the same numbers
            self.replicas = ReplicaGroup(self.net, build_replica, replicas, devices, self.shard)
        self.iter = 0
        self.factored = FactoredWeights(self.net, self.replicas)
        self._factored = {}                 # this iteration's weights updated from factors
        # parameters whose diff is known to hold zeros (a new net's do): a weight made from its
        # factors leaves its diff alone, which then need not be cleared again
        self._zeroed = set(range(len(self.net.learnable_params)))
        self._smoothed = SmoothedLoss(self.net.xp)
        # on a GPU: the NaN/Inf record and the losses stay on the device until a display reads
        # them (engine/solvers/health.py), so a steady-state step never waits for the device
        self.on_device = self.net.xp is not numpy
        self._health = (DeviceHealth(self.net.xp, len(self.net.learnable_params))
                        if self.on_device else None)
        self.requested_early_exit = False
        self._action = None
        log.info("Solver scaffolding done.")

    # ----- construction ------------------------------------------------------------------------
    def _where(self):
        return self.source or "solver"

    def _at_key(self, error):
        return solverfile.at_key(error, self.source)

    def _check_param(self):
        solverfile.check_param(self.param, self._where())

    # ----- the loop ---------------------------------------------------------------------------------
    @property
    def lr(self):
        """The learning rate of the next update."""
        return self.rule.rate(self.iter)

    @property
    def current_step(self):
        """Caffe's current_step_ after the last update's rate (step/multistep; saved in snapshots).
        The rate itself is a pure function of iter, so a restored current_step is not needed."""
        return self.rule.current_step(self.iter - 1) if self.iter > 0 else 0

    def step(self, iters):
        """Run `iters` iterations (tests, display and snapshots included), as Caffe's Step."""
        p = self.param
        hooks = self.hooks
        hooks.begin(self)
        start_iter, stop_iter = self.iter, self.iter + int(iters)
        self._smoothed.reset()
        self._timer = time.perf_counter()
        self._iterations_last = self.iter
        bar = self._progress_bar(stop_iter - start_iter)
        try:
            while self.iter < stop_iter:
                it = self.iter
                self._begin_iteration(it)
                if (p.test_interval and it % p.test_interval == 0
                        and (it > 0 or p.test_initialization)):
                    self.test_all()
                    if self.requested_early_exit:
                        break
                display = p.display and it % p.display == 0
                loss = hooks.loss(self, it, self._for_hooks(graphs.forward_backward(self)))
                if not hooks.updates_parameters:
                    self.check_finite(loss)
                self._update_smoothed_loss(loss, start_iter)
                if display:
                    self.check_recorded()
                    self._display()
                self._log_rate(it, display)
                hooks.before_update(self, it, loss)
                if not hooks.updates_parameters:
                    self.apply_update()
                self._factored = {}
                self.iter += 1
                if bar is not None:
                    bar.update(1)
                    if display or not self.on_device:   # on a GPU a read waits for the step
                        bar.set_postfix(loss=f"{self.smoothed_loss:.4g}", refresh=False)
                action, self._action = self._action, None
                if (p.snapshot and self.iter % p.snapshot == 0) or action == "snapshot":
                    self.snapshot()
                if action == "stop":
                    self.requested_early_exit = True
                    break
            self.check_recorded()
        finally:
            self._factored = {}                 # an early exit or an error mid-step: no plan left
            if bar is not None:
                bar.close()
        hooks.end_step(self)

    def solve(self, resume_file=None):
        """Train to max_iter (Caffe's Solve): final snapshot, display and test, then 'Optimization Done.'"""
        p = self.param
        log.info(f"Solving {self.net.name}")
        log.info(f"Learning Rate Policy: {p.lr_policy}")
        self.requested_early_exit = False
        if resume_file:
            log.info(f"Restoring previous solver status from {resume_file}")
            self.restore(resume_file)
        start_iter = self.iter
        self.step(p.max_iter - self.iter)
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            if p.HasField("snapshot_prefix"):
                self.snapshot()
            else:
                log.warning("snapshot_prefix is not set: no snapshot after training")
        if self.requested_early_exit:
            log.info("Optimization stopped early.")
            self.hooks.end(self)
            return
        if p.display and self.iter % p.display == 0:
            loss = self.net.Forward()
            self._update_smoothed_loss(loss, start_iter)
            log.info(f"Iteration {self.iter}, loss = {_g(self.smoothed_loss)}")
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")
        self.hooks.end(self)

    def request(self, action):
        """Ask the loop to 'snapshot' or 'stop' after the current iteration (signal handlers)."""
        if action not in ("snapshot", "stop", None):
            raise ValueError(f"action must be 'snapshot', 'stop' or None, got {action!r}")
        self._action = action

    def set_hooks(self, hooks):
        """Plug `hooks` (engine/solvers/hooks.py) into the loop; None: train alone again."""
        self.hooks = hooks if hooks is not None else SolverHooks()

    # ----- one iteration ----------------------------------------------------------------------------
    def _begin_iteration(self, it):
        """Fix the iteration's plan: the layers whose weight gradient is made from their sufficient
        factors (the hooks' choice, or the solver's own: engine/solvers/factored.py)."""
        chosen = self.hooks.begin_iteration(self, it)
        if chosen is None:
            entries = self.factored.active(self.param)
        else:
            entries = self.factored.entries_for(chosen)
        self._factored = {pid: (li, layer) for pid, li, layer in entries}
        for li in {li for li, _ in self._factored.values()}:
            self.net.backward_passes[li] = 0
        self.replicas.begin_iteration(self._factored)

    def _clear_gradients(self):
        """Caffe's ClearParamDiffs, after the first forward (which reads no diff: same numbers), so
        that hooks may still send the last iteration's gradients until `before_backward`. A weight
        made from factors never stores its gradient: its diff is zeroed only if it may hold
        something (an earlier iteration wrote it)."""
        to_clear = []
        for pid, blob in enumerate(self.net.learnable_params):
            if pid in self._factored:
                if pid in self._zeroed:
                    continue
                self._zeroed.add(pid)
            else:
                self._zeroed.discard(pid)        # its backward writes it
            to_clear.append(blob)
        self.net.clear_diffs(to_clear)

    def clear_param_diffs(self):
        """Zero every parameter gradient (Caffe's ClearParamDiffs)."""
        self.net.ClearParamDiffs()
        self._zeroed = set(range(len(self.net.learnable_params)))

    def forward_backward(self):
        """iter_size forward and backward passes of the train net (gradients accumulate), with the
        hooks called between layers; the mean loss. With several replicas each step runs on all
        of them, and the leader's diffs hold their mean gradient before after_backward."""
        net, hooks, it, group = self.net, self.hooks, self.iter, self.replicas
        factored = {li for li, _ in self._factored.values()}
        events = hooks.wants_backward_events
        n = self.param.iter_size
        loss = 0.0
        for pass_index in range(n):
            for li in range(len(net.layers)):
                hooks.before_forward(self, it, li)
                group.forward_layer(li, alone=li == len(net.layers) - 1)
            if pass_index == 0:
                hooks.before_backward(self, it)
                self._clear_gradients()
            pass_loss = group.loss()                # a float on numpy, a device scalar on a GPU
            hooks.after_forward(self, it, pass_index, self._for_hooks(pass_loss))
            loss = pass_loss if pass_index == 0 else loss + pass_loss
            for li in range(len(net.layers) - 1, -1, -1):
                group.backward_layer(li, li in factored, reduce=pass_index == n - 1)
                hooks.after_backward(self, it, li, pass_index,
                                     backend.record_event(net.xp) if events else None)
        return loss / n if n > 1 else loss

    def _for_hooks(self, loss):
        """The loss as hooks get it: hooks that do something get a float (they may add, reduce
        over processes or format it); the no-op hooks of a solver training alone take the device
        scalar as it is, so a GPU step reads nothing back."""
        if self.hooks.passive:
            return loss
        return float(loss)

    def _param_grad_finite(self, pid):
        """Whether parameter pid's gradient of this iteration is finite: its diff, or for a
        factored weight its factors (G and X, from which the gradient will be made)."""
        if pid in self._factored:
            li, layer = self._factored[pid]
            return all(all_finite(a) for a in self.factored.factors(li, layer))
        return all_finite(self.net.learnable_params[pid].diff)

    def check_finite(self, loss):
        """Stop with a PoseidonError when the loss or a parameter gradient is not finite, naming the
        iteration and the first layer (in backward order) whose gradient is not finite. On a GPU
        the check is recorded on the device and read by check_recorded (engine/solvers/health.py);
        gradients made from sufficient factors are checked on the host as on numpy."""
        params = self.net.learnable_params
        if self.on_device and not self._factored:
            self._health.record(self.iter, loss, [b.diff for b in params],
                                squares=self.param.clip_gradients >= 0, flat=self.net.flat)
            return
        loss = float(loss)
        diffs = [b.diff for pid, b in enumerate(params) if pid not in self._factored]
        if (math.isfinite(loss) and math.isfinite(rules.global_norm_sq(diffs))
                and all(self._param_grad_finite(pid) for pid in self._factored)):
            return
        pid_of = {id(b): pid for pid, b in enumerate(params)}

        def bad(blob):
            pid = pid_of.get(id(blob))
            return not (self._param_grad_finite(pid) if pid is not None else all_finite(blob.diff))
        culprit = first_bad_param(self.net, bad)
        if culprit is None and math.isfinite(loss):
            return   # the sum of squares overflowed; every gradient is finite
        raise nonfinite_stop(self.iter, f"{loss:g}", culprit)

    def check_recorded(self):
        """Read the device's NaN/Inf record (a GPU step's check_finite) and stop as check_finite
        does if an iteration was not finite; nothing to do on numpy, which checked already."""
        if self._health is not None and not self.hooks.updates_parameters:
            self._health.check(self.net, self.net.learnable_params)
            self.net.check_deferred()

    def grad_norm_sq(self):
        """Sum of squared gradients over all learnable parameters (for clip_gradients)."""
        return rules.global_norm_sq([b.diff for b in self.net.learnable_params])

    def gradient_scale(self):
        """The factor applied to every raw gradient: clip_gradients' global factor times 1/iter_size
        (on a GPU inside step(), a device scalar: the norm is never read back)."""
        p = self.param
        scale = 1.0
        if p.clip_gradients >= 0 and self.on_device and self._health.sums is not None:
            scale = rules.clip_factor_on_device(p.clip_gradients, self._health.norm_sq())
            self._health.sums = None
        elif p.clip_gradients >= 0:
            norm_sq = self.grad_norm_sq()
            scale = rules.clip_factor(p.clip_gradients, norm_sq)
            if scale != 1.0:
                log.info(f"Gradient clipping: scaling down gradients (L2 norm "
                         f"{_g(math.sqrt(norm_sq))} > {_g(p.clip_gradients)}) by scale factor "
                         f"{_g(scale)}")
        if p.iter_size > 1:
            scale *= 1.0 / p.iter_size
        return scale

    def _log_rate(self, it, display):
        p = self.param
        if p.lr_policy == "multistep" and self.rule.current_step(it) > self.current_step:
            log.info(f"MultiStep Status: Iteration {it}, step = {self.rule.current_step(it)}")
        if display:
            log.info(f"Iteration {it}, lr = {_g(self.rule.rate(it))}")

    def apply_update(self):
        """Update every learnable parameter from its accumulated gradient (does not advance iter);
        inside step(), a weight planned to come from its factors is updated from them."""
        rate = self.rule.rate(self.iter)
        scale = self.gradient_scale()
        for li, layer in self._factored.values():
            passes = self.net.backward_passes[li]
            if passes != 1:
                raise PoseidonError(
                    f"iteration {self.iter}: layer '{layer.name}' ran backward {passes} "
                    f"times since clear_param_diffs(), but its weight is updated from the "
                    f"factors of one pass (engine/solvers/factored.py): to add several "
                    f"passes' gradients set iter_size in the solver, or call "
                    f"clear_param_diffs() before each pass")
        params, specs = self.net.learnable_params, self.net.learnable_param_specs
        plain = [pid for pid in range(len(params)) if pid not in self._factored]
        update_params(self.rule, self.net.flat, plain, self.iter, scale, rate)
        for pid, (li, layer) in self._factored.items():
            G, X = self.factored.factors(li, layer)
            update_from_factors(layer, self.rule, params[pid].data, self.history[pid], G, X,
                                self.iter, specs[pid].lr_mult, specs[pid].decay_mult, scale,
                                rate, self.factored.buffers)

    # ----- display and testing -----------------------------------------------------------------------
    @property
    def smoothed_loss(self):
        """The loss averaged over the last average_loss iterations (engine/solvers/smoothing.py:
        on a GPU read from the device here)."""
        return self._smoothed.value

    def _update_smoothed_loss(self, loss, start_iter):
        self._smoothed.add(loss, self.iter - start_iter, self.param.average_loss)

    def _display(self):
        now = time.perf_counter()
        lapse = now - self._timer
        per_s = (self.iter - self._iterations_last) / (lapse if lapse else 1)
        log.info(f"Iteration {self.iter} ({_g(per_s)} iter/s, {_g(lapse)}s/{self.param.display} "
                 f"iters), loss = {_g(self.smoothed_loss)}")
        self._timer = now
        self._iterations_last = self.iter
        evaluation.log_train_outputs(self.net)

    def test_all(self):
        self.check_recorded()
        self.last_test_results = [self.test(i) for i in range(len(self.test_nets))]
        return self.last_test_results

    def test(self, i):
        """test_iter[i] forward passes of test net i; logs and returns {output blob: mean value}
        (engine/solvers/evaluation.py)."""
        return evaluation.test_net(self, i)

    def _progress_bar(self, total):
        if not self.progress or total <= 0 or not sys.stderr.isatty():
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=total, initial=0, desc=f"iter {self.iter}", leave=False, dynamic_ncols=True)

    # ----- snapshots -------------------------------------------------------------------------------
    def snapshot_filename(self, extension):
        return f"{self.param.snapshot_prefix}_iter_{self.iter}{extension}"

    def snapshot(self):
        """Write <prefix>_iter_N.caffemodel(.h5), .solverstate(.h5) and .cursors.json, and the
        manifest over them last (engine/solvers/snapshots.py); returns the solverstate path."""
        self.check_recorded()                   # never a snapshot of a run that went NaN
        return self.hooks.snapshot(self, self._write_snapshot)

    def _write_snapshot(self):
        self.snapshot_files, state_file = snapshots.write(self)
        self.write_manifest(state_file, self.hooks.snapshot_files(self, state_file))
        return state_file

    def write_manifest(self, state_file, extra_files=()):
        """The snapshot's manifest, written last: its presence means the set is complete."""
        manifest.write_manifest(manifest.manifest_path(state_file),
                                list(self.snapshot_files) + list(extra_files),
                                {"iter": self.iter})

    def restore(self, path):
        """Resume from a .solverstate (or .solverstate.h5): weights, history and iter (current_step
        follows from iter), and the data cursors and random state from the .cursors.json beside it,
        when present."""
        self.hooks.restore(self, path, lambda p: snapshots.read(self, p))

    def cursor_state(self):
        """Where this process's data and random streams stand, and the convolution routes its
        train net runs (saved beside each snapshot, so a resume computes the same numbers)."""
        state = {"iter": self.iter, "rng": rng.get_state(), "train": self.net.data_cursors(),
                 "test": [t.data_cursors() for t in self.test_nets],
                 "conv_routes": self.net.conv_routes()}
        if self.replicas.count > 1:
            state["replicas"] = self.replicas.data_cursors()
        return state

    def load_cursor_state(self, state):
        """Put the data and random streams (and, when given, the iteration) where `state` says."""
        if state.get("iter") is not None:
            self.iter = int(state["iter"])
        if state.get("rng") is not None:
            rng.set_state(state["rng"])
        self.net.set_data_cursors(state.get("train"))
        self.replicas.set_data_cursors(state.get("replicas"))
        for net, cursors in zip(self.test_nets, state.get("test") or []):
            net.set_data_cursors(cursors)
        if state.get("conv_routes"):
            self.net.set_conv_routes(state["conv_routes"])


def _solver_param(solver_param_or_path, solver_type, level, stages, weights):
    """(the solver file or None, the SolverParameter as the arguments amend it): a copy of a
    given message, or the file read and upgraded."""
    if isinstance(solver_param_or_path, (str, os.PathLike)):
        source = os.fspath(solver_param_or_path)
        param = solverfile.read_solver(source)
        solverfile.upgrade_snapshot_prefix(param, source)
    else:
        source = None
        param = caffe_pb2.SolverParameter()
        param.CopyFrom(solver_param_or_path)
    if solver_type is not None:
        param.ClearField("solver_type")
        param.type = solver_type
    if level is not None:
        param.train_state.level = int(level)
    if stages:
        param.train_state.stage.extend(stages)
    if weights:
        param.weights.extend([weights] if isinstance(weights, str) else list(weights))
    return source, param


def get_solver(path_or_param, **kwargs):
    """The solver a solver file (or SolverParameter) describes; its `type` picks the update rule."""
    return Solver(path_or_param, **kwargs)
