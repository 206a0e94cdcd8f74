"""The training loop: Caffe's Solver (solver.cpp) around the update rules of rules.py.

    solver = get_solver("prototxt/cifar10/cifar10_quick_solver.prototxt")
    solver.solve()                      # or solver.step(n), as pycaffe

One iteration of `step` (Caffe's Solver::Step, same order and same log lines):
  ClearParamDiffs -> test all nets when iter % test_interval == 0 (at iter 0 only if
  test_initialization) -> forward_backward() (iter_size passes, mean loss) -> check_finite(loss)
  -> smoothed loss and the display lines -> apply_update() (clip -> 1/iter_size -> regularize ->
  rule, for every learnable parameter; InnerProduct weights from their factors, block by block:
  engine/solvers/factored.py) -> iter += 1 -> snapshot when iter % snapshot == 0.
`clear_param_diffs`, `forward_backward`, `check_finite`, `apply_update`, `grad_norm_sq`, `test` and
`snapshot` are the seams a distributed trainer overrides; the loop itself stays here.

Logging goes to the "poseidon" logger in glog's line format (GlogFormatter), so Caffe's log parsers
(tools/extra/parse_log.py) read it; `log_to_stderr()` installs the handler.
"""
import datetime
import json
import logging
import math
import os
import re
import sys
import time
from collections import OrderedDict

import numpy

from .. import backend, rng
from ..errors import ModelError, PoseidonError
from ..layer import TEST, TRAIN
from ..io import manifest
from ..proto import caffe_pb2
from . import rules
from .factored import FactoredWeights, update_from_factors

log = logging.getLogger("poseidon")


# ----- logging in glog's format -------------------------------------------------------------------
class GlogFormatter(logging.Formatter):
    """`I1123 10:00:00.123456 <pid> solver.py:123] message`, as glog writes Caffe's lines."""

    LETTERS = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E",
               logging.CRITICAL: "F"}

    def format(self, record):
        t = datetime.datetime.fromtimestamp(record.created)
        letter = self.LETTERS.get(record.levelno, "I")
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return (f"{letter}{t:%m%d %H:%M:%S}.{t.microsecond:06d} {record.process} "
                f"{record.filename}:{record.lineno}] {message}")


def final_accuracy_lines(solver):
    """'Final test accuracy (net #i): x' for each accuracy output of the solver's last test."""
    return [f"Final test {name} (net #{i}): {float(value):.4f}"
            for i, results in enumerate(getattr(solver, "last_test_results", None) or [])
            for name, value in results.items() if "accuracy" in name]


def log_to_stderr(level=logging.INFO, stream=None):
    """Send the "poseidon" logger to stderr (or `stream`) in glog format; idempotent."""
    for handler in log.handlers:
        if isinstance(handler.formatter, GlogFormatter):
            break
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(GlogFormatter())
        log.addHandler(handler)
    log.setLevel(level)
    return handler


def _logging_configured():
    return bool(log.handlers or logging.getLogger().handlers)


def _g(x):
    """A number as C++'s ostream prints a float (6 significant digits, %g)."""
    return f"{float(x):.6g}"


# ----- the solver ------------------------------------------------------------------------------------

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

class Solver:
    """Caffe's Solver with the update rule of the solver file's `type`.

    solver_param_or_path: a SolverParameter or a solver prototxt path. dtype/xp: the nets' float type
    and array module (default: float32 on the mode set by engine.set_mode_cpu/gpu). shard=(rank,
    size): the train net's data shard. level/stages: merged into train_state (the CLI's --level and
    --stage). weights: extra .caffemodel paths to initialise from (like the solver's `weights`).
    progress: show a tqdm bar when stderr is a terminal. solver_type: the update rule to use whatever
    the file says (pycaffe's SGDSolver, AdamSolver, ...).
    """

    def __init__(self, solver_param_or_path, dtype=numpy.float32, xp=None, shard=(0, 1),
                 level=None, stages=None, weights=None, progress=False, test_shard=(0, 1),
                 solver_type=None):
        if isinstance(solver_param_or_path, (str, os.PathLike)):
            self.source = os.fspath(solver_param_or_path)
            param = _read_solver(self.source)
            _upgrade_snapshot_prefix(param, self.source)
        else:
            self.source = None
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
        self.param = param
        self.dtype = numpy.dtype(dtype)
        self.xp = xp or backend.default_xp()
        self.shard, self.test_shard = tuple(shard), tuple(test_shard)
        self.progress = progress
        if not _logging_configured():
            log_to_stderr()
        try:
            self._check_param()
            self.rule = rules.make_rule(param)
        except ModelError as e:
            raise self._at_key(e) from None
        if param.random_seed >= 0:
            rng.seed(param.random_seed)          # before the nets: fillers draw from it
        self.net = self._init_train_net()
        self.test_nets = self._init_test_nets()
        self.iter = 0
        self.history = [self.rule.init_state(p.data.shape, backend.get_array_module(p.data),
                                             p.data.dtype) for p in self.net.learnable_params]
        self.factored = FactoredWeights(self.net)
        self._deferred = {}                 # this iteration's weights updated from factors
        self.smoothed_loss = 0.0
        self._losses = []
        self.requested_early_exit = False
        self._action = None
        log.info("Solver scaffolding done.")

    # ----- construction ------------------------------------------------------------------------
    def _where(self):
        return self.source or "solver"

    def _at_key(self, error):
        """A solver error with the file:line of the solver field it names (the first one named
        that the file sets), in place of its "solver:" prefix."""
        message = str(error)
        for prefix in ("solver: ", f"{self.source}: "):
            if message.startswith(prefix):
                message = message[len(prefix):]
        where = self._where()
        if self.source:
            fields = [f.name for f in caffe_pb2.SolverParameter.DESCRIPTOR.fields]
            named = sorted((m.start(), name) for name in fields
                           for m in [re.search(rf"(?<![\w-]){name}(?![\w-])", message)] if m)
            from ..prototxt import field_line
            for _, name in named:
                line = field_line(self.source, name)
                if line:
                    where = f"{self.source}:{line}"
                    break
        return type(error)(f"{where}: {message}")

    def _check_param(self):
        p = self.param
        for name in ("base_lr", "max_iter", "snapshot", "display", "test_interval"):
            if getattr(p, name) < 0:
                raise ModelError(f"{self._where()}: {name} must be >= 0, got "
                                 f"{getattr(p, name):g}; give a non-negative value")
        if p.snapshot_format == caffe_pb2.SolverParameter.HDF5:
            try:
                import h5py  # noqa: F401
            except ImportError:
                raise ModelError(f"{self._where()}: snapshot_format: HDF5 needs h5py: pip install "
                                 f"h5py, or remove snapshot_format (binary protobuf)") from None
        if p.iter_size < 1:
            raise ModelError(f"{self._where()}: iter_size must be at least 1, got {p.iter_size}")
        if p.average_loss < 1:
            raise ModelError(f"{self._where()}: average_loss should be non-negative and at least "
                             f"1, got {p.average_loss}")
        if p.snapshot > 0 and not p.HasField("snapshot_prefix"):
            raise ModelError(f"{self._where()}: snapshot is specified but snapshot_prefix is not; "
                             f"add snapshot_prefix: \"<folder>/<name>\"")

    def _resolve(self, path, what):
        """A file named in the solver: relative to the cwd first, then to the solver file's folder."""
        if os.path.exists(path):
            return path
        if self.source and not os.path.isabs(path):
            beside = os.path.join(os.path.dirname(os.path.abspath(self.source)), path)
            if os.path.exists(beside):
                return beside
        looked = "the current directory" + (
            f" and {os.path.dirname(os.path.abspath(self.source))}" if self.source else "")
        raise ModelError(f"{self._where()}: {what} '{path}' does not exist (looked in {looked}); "
                         f"check the path")

    def _build_net(self, model, phase, state, shard):
        """A Net in `phase` whose NetState is Caffe's merge: phase < the net's own state < `state`."""
        from ..net import Net
        from .. import prototxt
        param = prototxt.read_net(model) if isinstance(model, str) else model
        merged = caffe_pb2.NetState(phase=phase)
        merged.MergeFrom(param.state)
        if state is not None:
            merged.MergeFrom(state)
        merged.phase = phase
        return Net(model, phase, level=merged.level, stages=list(merged.stage), dtype=self.dtype,
                   xp=self.xp, shard=shard, state=merged)

    def _init_train_net(self):
        p = self.param
        fields = ("net", "net_param", "train_net", "train_net_param")
        given = [f for f in fields if p.HasField(f)]
        if len(given) != 1:
            raise ModelError(f"{self._where()}: give exactly one of {', '.join(fields)} for the "
                             f"train net (found {', '.join(given) or 'none'})")
        source = given[0]
        if source.endswith("param"):
            log.info(f"Creating training net specified in {source}.")
            model = getattr(p, source)
        else:
            model = self._resolve(getattr(p, source), "net file")
            log.info(f"Creating training net from {source} file: {model}")
        net = self._build_net(model, TRAIN, p.train_state if p.HasField("train_state") else None,
                              self.shard)
        for entry in p.weights:
            for path in entry.split(","):
                if path:
                    path = self._resolve(path, "weights file")
                    log.info(f"Finetuning from {path}")
                    net.copy_from(path)
        return net

    def _init_test_nets(self):
        p = self.param
        generic = p.HasField("net") + p.HasField("net_param")
        specific = len(p.test_net_param) + len(p.test_net)
        if (generic and len(p.test_iter) < specific) or (not generic and len(p.test_iter) != specific):
            raise ModelError(f"{self._where()}: test_iter must be given once for each test net "
                             f"({specific} test nets, {len(p.test_iter)} test_iter values)")
        count = len(p.test_iter) if generic else specific
        if len(p.test_state) and len(p.test_state) != count:
            raise ModelError(f"{self._where()}: test_state must be unspecified or given once per "
                             f"test net ({count} test nets, {len(p.test_state)} test_state)")
        if count and p.test_interval <= 0:
            raise ModelError(f"{self._where()}: there are {count} test nets but test_interval is "
                             f"{p.test_interval}; set test_interval > 0")
        models = [(m, "test_net_param") for m in p.test_net_param]
        models += [(self._resolve(f, "test net file"), f"test_net file: {f}") for f in p.test_net]
        rest = count - len(models)
        if p.HasField("net_param"):
            models += [(p.net_param, "net_param")] * rest
        elif p.HasField("net"):
            models += [(self._resolve(p.net, "net file"), f"net file: {p.net}")] * rest
        nets = []
        for i, (model, described) in enumerate(models):
            log.info(f"Creating test net (#{i}) specified by {described}")
            state = p.test_state[i] if len(p.test_state) else None
            net = self._build_net(model, TEST, state, self.test_shard)
            net.share_with(self.net)
            nets.append(net)
        return nets

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
        start_iter, stop_iter = self.iter, self.iter + int(iters)
        self._losses = []
        self.smoothed_loss = 0.0
        self._timer = time.perf_counter()
        self._iterations_last = self.iter
        bar = self._progress_bar(stop_iter - start_iter)
        try:
            while self.iter < stop_iter:
                self.clear_param_diffs()
                if (p.test_interval and self.iter % p.test_interval == 0
                        and (self.iter > 0 or p.test_initialization)):
                    self.test_all()
                    if self.requested_early_exit:
                        break
                display = p.display and self.iter % p.display == 0
                loss = self.forward_backward()
                self.check_finite(loss)
                self._update_smoothed_loss(loss, start_iter)
                if display:
                    self._display()
                self.apply_update()
                self.iter += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{self.smoothed_loss:.4g}", refresh=False)
                action, self._action = self._action, None
                if (p.snapshot and self.iter % p.snapshot == 0) or action == "snapshot":
                    self.snapshot()
                if action == "stop":
                    self.requested_early_exit = True
                    break
        finally:
            if self._deferred:                  # left by an early exit or an error mid-step
                self._defer([])
            if bar is not None:
                bar.close()

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
            return
        if p.display and self.iter % p.display == 0:
            loss = self.net.Forward()
            self._update_smoothed_loss(loss, start_iter)
            log.info(f"Iteration {self.iter}, loss = {_g(self.smoothed_loss)}")
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")

    def request(self, action):
        """Ask the loop to 'snapshot' or 'stop' after the current iteration (signal handlers)."""
        if action not in ("snapshot", "stop", None):
            raise ValueError(f"action must be 'snapshot', 'stop' or None, got {action!r}")
        self._action = action

    # ----- seams ------------------------------------------------------------------------------------
    def clear_param_diffs(self):
        """Zero every parameter gradient before the iteration's backward (Caffe's ClearParamDiffs),
        but for the weights updated from sufficient factors this iteration (engine/solvers/
        factored.py): their layers skip the weight gradient, and nothing reads those diffs."""
        self._defer(self.factored.active(self.param))
        if not self._deferred:
            self.net.ClearParamDiffs()
            return
        self.net.clear_diffs([b for pid, b in enumerate(self.net.learnable_params)
                              if pid not in self._deferred])

    def _defer(self, entries):
        """Make `entries` [(param id, layer index, layer)] this iteration's factored weights (and
        no other layer skip its weight gradient)."""
        for _, _, layer in self.factored.entries:
            layer.defer_weight_grad = False
            layer.deferred_passes = 0
        self._deferred = {pid: (li, layer) for pid, li, layer in entries}
        for li, layer in self._deferred.values():
            layer.defer_weight_grad = True

    def _param_grad_finite(self, pid):
        """Whether parameter pid's gradient of this iteration is finite: its diff, or for a
        factored weight its factors (G and X, from which the gradient will be made)."""
        if pid in self._deferred:
            li, layer = self._deferred[pid]
            return all(all_finite(a) for a in self.factored.factors(li, layer))
        return all_finite(self.net.learnable_params[pid].diff)

    def forward_backward(self):
        """iter_size forward and backward passes of the train net (gradients accumulate); the mean loss."""
        n = self.param.iter_size
        loss = 0.0
        for _ in range(n):
            loss += self.net.Forward()
            self.net.Backward()
        return loss / n

    def check_finite(self, loss):
        """Stop with a PoseidonError when the loss or a parameter gradient is not finite, naming the
        iteration and the first layer (in backward order) whose gradient is not finite."""
        params = self.net.learnable_params
        diffs = [b.diff for pid, b in enumerate(params) if pid not in self._deferred]
        if (math.isfinite(loss) and math.isfinite(rules.global_norm_sq(diffs))
                and all(self._param_grad_finite(pid) for pid in self._deferred)):
            return
        pid_of = {id(b): pid for pid, b in enumerate(params)}
        culprit = None
        for li in reversed(range(len(self.net.layers))):
            layer = self.net.layers[li]
            for bi, blob in enumerate(layer.blobs):
                pid = pid_of.get(id(blob))
                if not (self._param_grad_finite(pid) if pid is not None else all_finite(blob.diff)):
                    culprit = (layer, bi)
                    break
            if culprit:
                break
        if culprit is None:
            if math.isfinite(loss):
                return   # the sum of squares overflowed; every gradient is finite
            detail = ("every parameter gradient is finite, so the forward pass made it: check the "
                      "input data and the loss layer's inputs")
        else:
            layer, bi = culprit
            detail = (f"the first non-finite parameter gradient (in backward order) is in layer "
                      f"'{layer.name}' (type {layer.type}), param #{bi}")
        self._defer([])                     # no update follows: backward is whole again
        raise PoseidonError(f"iteration {self.iter}: loss is {loss:g}; {detail}; lower base_lr or "
                            f"set clip_gradients (no snapshot was written)")

    def grad_norm_sq(self):
        """Sum of squared gradients over all learnable parameters (for clip_gradients)."""
        return rules.global_norm_sq([b.diff for b in self.net.learnable_params])

    def gradient_scale(self):
        """The factor applied to every raw gradient: clip_gradients' global factor times 1/iter_size."""
        p = self.param
        scale = 1.0
        if p.clip_gradients >= 0:
            norm_sq = self.grad_norm_sq()
            scale = rules.clip_factor(p.clip_gradients, norm_sq)
            if scale != 1.0:
                log.info(f"Gradient clipping: scaling down gradients (L2 norm "
                         f"{_g(math.sqrt(norm_sq))} > {_g(p.clip_gradients)}) by scale factor "
                         f"{_g(scale)}")
        if p.iter_size > 1:
            scale *= 1.0 / p.iter_size
        return scale

    def apply_update(self):
        """Update every learnable parameter from its accumulated gradient (does not advance iter)."""
        p = self.param
        rate = self.rule.rate(self.iter)
        if p.lr_policy == "multistep" and self.rule.current_step(self.iter) > self.current_step:
            log.info(f"MultiStep Status: Iteration {self.iter}, step = "
                     f"{self.rule.current_step(self.iter)}")
        if p.display and self.iter % p.display == 0:
            log.info(f"Iteration {self.iter}, lr = {_g(rate)}")
        scale = self.gradient_scale()
        for pid, (blob, spec, state) in enumerate(zip(
                self.net.learnable_params, self.net.learnable_param_specs, self.history)):
            if pid in self._deferred:
                li, layer = self._deferred[pid]
                if layer.deferred_passes != 1:
                    passes = layer.deferred_passes
                    self._defer([])
                    raise PoseidonError(
                        f"iteration {self.iter}: layer '{layer.name}' ran backward {passes} "
                        f"times since clear_param_diffs(), but its weight is updated from the "
                        f"factors of one pass (engine/solvers/factored.py): to add several "
                        f"passes' gradients set iter_size in the solver, or call "
                        f"clear_param_diffs() before each pass")
                G, X = self.factored.factors(li, layer)
                update_from_factors(layer, self.rule, blob.data, state, G, X, self.iter,
                                    spec.lr_mult, spec.decay_mult, scale, rate,
                                    self.factored.buffers)
            else:
                self.rule.update(blob.data, blob.diff, state, self.iter, spec.lr_mult,
                                 spec.decay_mult, scale, rate=rate)
        self._defer([])

    # ----- display and testing -----------------------------------------------------------------------
    def _update_smoothed_loss(self, loss, start_iter):
        window = self.param.average_loss
        if len(self._losses) < window:
            self._losses.append(loss)
            size = len(self._losses)
            self.smoothed_loss = (self.smoothed_loss * (size - 1) + loss) / size
        else:
            idx = (self.iter - start_iter) % window
            self.smoothed_loss += (loss - self._losses[idx]) / window
            self._losses[idx] = loss

    def _display(self):
        now = time.perf_counter()
        lapse = now - self._timer
        per_s = (self.iter - self._iterations_last) / (lapse if lapse else 1)
        log.info(f"Iteration {self.iter} ({_g(per_s)} iter/s, {_g(lapse)}s/{self.param.display} "
                 f"iters), loss = {_g(self.smoothed_loss)}")
        self._timer = now
        self._iterations_last = self.iter
        net = self.net
        k = 0
        for name in net.output_names:
            weight = net.blob_loss_weights.get(name, 0)
            for value in backend.to_numpy(net.blobs[name].data).reshape(-1):
                log.info(f"    Train net output #{k}: {name} = {_g(value)}{_loss_suffix(weight, value)}")
                k += 1

    def test_all(self):
        self.last_test_results = [self.test(i) for i in range(len(self.test_nets))]
        return self.last_test_results

    def test(self, i):
        """test_iter[i] forward passes of test net i; logs and returns {output blob: mean value}
        (a float for one-element blobs, else an array averaged element by element)."""
        p = self.param
        net = self.test_nets[i]
        n = p.test_iter[i]
        log.info(f"Iteration {self.iter}, Testing net (#{i})")
        sums = None
        loss = 0.0
        for _ in range(n):
            iter_loss = net.Forward()
            if p.test_compute_loss:
                loss += iter_loss
            if sums is None:
                sums = [net.blobs[name].data.astype(numpy.float64) for name in net.output_names]
            else:
                for acc, name in zip(sums, net.output_names):
                    acc += net.blobs[name].data
        if p.test_compute_loss and n > 0:
            log.info(f"Test loss: {_g(loss / n)}")
        results = OrderedDict()
        k = 0
        for acc, name in zip(sums or [], net.output_names):
            mean = backend.to_numpy(acc) / n
            weight = net.blob_loss_weights.get(name, 0)
            for value in mean.reshape(-1):
                log.info(f"    Test net output #{k}: {name} = {_g(value)}{_loss_suffix(weight, value)}")
                k += 1
            results[name] = float(mean.reshape(-1)[0]) if mean.size == 1 else mean
        return results

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
        """Write <prefix>_iter_N.caffemodel(.h5), .solverstate(.h5) and .cursors.json; returns the
        solverstate path."""
        from ..io import caffemodel
        p = self.param
        if not p.HasField("snapshot_prefix"):
            raise ModelError(f"{self._where()}: cannot snapshot: snapshot_prefix is not set")
        hdf5 = p.snapshot_format == caffe_pb2.SolverParameter.HDF5
        folder = os.path.dirname(p.snapshot_prefix)
        if folder:
            os.makedirs(folder, exist_ok=True)
        net = self.net
        if hdf5:
            model_file = self.snapshot_filename(".caffemodel.h5")
            log.info(f"Snapshotting to HDF5 file {model_file}")
            blobs = OrderedDict((name, [backend.to_numpy(b.data) for b in layer.blobs])
                                for name, layer in zip(net.layer_names, net.layers) if layer.blobs)
            diffs = None
            if p.snapshot_diff:
                diffs = OrderedDict((name, [backend.to_numpy(b.diff) for b in layer.blobs])
                                    for name, layer in zip(net.layer_names, net.layers) if layer.blobs)
            caffemodel.write_net_hdf5(model_file, blobs, diffs)
        else:
            model_file = self.snapshot_filename(".caffemodel")
            log.info(f"Snapshotting to binary proto file {model_file}")
            if p.snapshot_diff:
                caffemodel.write_net_proto(net.to_proto(write_diff=True), model_file)
            else:
                net.save(model_file)
        history = [backend.to_numpy(state[k]) for k in range(self.rule.num_state)
                   for state in self.history]
        current_step = self.current_step
        if hdf5:
            state_file = self.snapshot_filename(".solverstate.h5")
            log.info(f"Snapshotting solver state to HDF5 file {state_file}")
            caffemodel.write_solverstate_hdf5(state_file, self.iter, model_file, history, current_step)
        else:
            state_file = self.snapshot_filename(".solverstate")
            log.info(f"Snapshotting solver state to binary proto file {state_file}")
            caffemodel.write_solverstate(state_file, self.iter, model_file, history, current_step)
        sidecar = {"iter": self.iter, "rng": rng.get_state(), "train": net.data_cursors(),
                   "test": [t.data_cursors() for t in self.test_nets]}
        caffemodel.write_atomic(self.snapshot_filename(".cursors.json"),
                                json.dumps(sidecar).encode("utf-8"))
        self.snapshot_files = [model_file, state_file, self.snapshot_filename(".cursors.json")]
        self.write_manifest(state_file)
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
        from ..io import caffemodel
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ModelError(f"{path}: solver state file does not exist; check the --snapshot "
                             f"path (snapshots are <snapshot_prefix>_iter_N.solverstate)")
        if os.path.exists(manifest.manifest_path(path)):
            manifest.verify_manifest(manifest.manifest_path(path))
        else:
            log.warning(f"{path}: no snapshot manifest beside it (a Caffe snapshot?); "
                        f"resuming without checksum verification")
        try:
            state = (caffemodel.read_solverstate_hdf5(path) if path.endswith(".h5")
                     else caffemodel.read_solverstate(path))
        except ImportError:
            raise ModelError(f"{path}: is an HDF5 solver state and reading it needs h5py: pip "
                             f"install h5py") from None
        except (ValueError, OSError, KeyError) as e:
            reason = caffemodel.unreadable_reason(e, "SolverState")
            raise ModelError(f"{path}: not a readable solver state ({reason}); give the "
                             f".solverstate a snapshot wrote (a torn copy also gives this: resume "
                             f"from an earlier snapshot)") from None
        if state.learned_net:
            weights = self._learned_net(state.learned_net, path)
            try:
                missing = self.net.copy_from(weights, report_missing=False)
            except ModelError as e:
                detail = str(e).split("; check that the file")[0]
                raise ModelError(f"{path}: is a snapshot of another net ({detail}); resume with "
                                 f"the solver and model that wrote it") from None
            if missing:     # a weights file cut at a layer boundary still parses
                from ..net import name_list
                raise ModelError(f"{weights}: has no weights for layer(s) {name_list(missing)} "
                                 f"of the net, and a resume needs them all (the file is cut "
                                 f"short, or of another net): resume from an earlier snapshot")
        params = self.net.learnable_params
        expected = len(params) * self.rule.num_state
        if len(state.history) != expected:
            raise ModelError(f"{path}: holds {len(state.history)} history blobs, the "
                             f"{self.rule.type} solver of this net needs {expected} "
                             f"({len(params)} parameters x {self.rule.num_state}); check the "
                             f"solver type and the model")
        log.info(f"{self.rule.type}Solver: restoring history")
        for k in range(self.rule.num_state):
            for i, blob in enumerate(params):
                array = numpy.asarray(state.history[k * len(params) + i])
                target = self.history[i][k]
                if array.size != target.size:
                    raise ModelError(f"{path}: history blob {k * len(params) + i} has "
                                     f"{array.size} values, parameter "
                                     f"'{self.net.learnable_param_specs[i].name}' has "
                                     f"{target.size}")
                target[...] = backend.to_xp(array.reshape(target.shape).astype(target.dtype),
                                            backend.get_array_module(target))
        self.iter = int(state.iter)
        sidecar = _sidecar_path(path)
        if os.path.exists(sidecar):
            with open(sidecar, "r", encoding="utf-8") as f:
                extra = json.load(f)
            if extra.get("rng") is not None:
                rng.set_state(extra["rng"])
            self.net.set_data_cursors(extra.get("train"))
            for net, cursors in zip(self.test_nets, extra.get("test") or []):
                net.set_data_cursors(cursors)

    def _learned_net(self, name, state_path):
        """The weights file of the snapshot `state_path`: the one its manifest lists (and restore
        has just verified), beside it; without a manifest (a Caffe snapshot) the file called
        `name` beside it, then `name` as written. The solverstate's `name` is the path the
        snapshot was written to, relative to that run's folder: tried first, it would load another
        run's weights when two experiments share a relative snapshot_prefix."""
        listed = manifest.manifest_path(state_path)
        if os.path.exists(listed):
            found = manifest.listed_files(listed, (".caffemodel", ".caffemodel.h5"))
            if found:
                same = [f for f in found if os.path.basename(f) == os.path.basename(name)]
                return (same or found)[0]
        folder = os.path.dirname(os.path.abspath(state_path))
        for candidate in (os.path.join(folder, os.path.basename(name)), name):
            if os.path.exists(candidate):
                return candidate
        raise ModelError(f"{state_path}: its weights file '{name}' does not exist (looked in "
                         f"{folder} and the current directory)")


def _sidecar_path(state_path):
    return manifest.snapshot_base(state_path) + ".cursors.json"


def _loss_suffix(weight, value):
    return f" (* {_g(weight)} = {_g(weight * value)} loss)" if weight else ""


def _read_solver(path):
    from ..prototxt import read_solver
    return read_solver(path)


def _upgrade_snapshot_prefix(param, path):
    """Caffe's UpgradeSnapshotPrefixProperty: default to the solver path without its extension; a
    folder becomes <folder>/<solver file stem>."""
    if not param.HasField("snapshot_prefix"):
        param.snapshot_prefix = os.path.splitext(path)[0]
        log.info(f"snapshot_prefix was not specified and is set to {param.snapshot_prefix}")
    elif os.path.isdir(param.snapshot_prefix):
        stem = os.path.splitext(os.path.basename(path))[0]
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, stem)
        log.info(f"snapshot_prefix is a directory and is set to {param.snapshot_prefix}")


def check_solver_file(path):
    """Read a solver file and the net files it names, check the solver's values and each net's
    graph (tops, bottoms, phases), building no layer and reading no data. A distributed launch calls
    it first, so a bad file stops the job with one line before any process starts."""
    from .. import prototxt
    probe = Solver.__new__(Solver)
    probe.source = os.fspath(path)
    probe.param = param = _read_solver(probe.source)
    try:
        probe._check_param()
        rules.make_rule(param)
    except ModelError as e:
        raise probe._at_key(e) from None

    def check_graph(net_path, phase, state):
        net_param = prototxt.read_net(net_path)
        merged = caffe_pb2.NetState(phase=phase)
        merged.MergeFrom(net_param.state)
        if state is not None:
            merged.MergeFrom(state)
        merged.phase = phase
        try:
            prototxt.insert_splits(prototxt.filter_net(net_param, merged))
        except ModelError as e:
            lines = prototxt.layer_lines(net_path)
            named = sorted((str(e).find(f"layer '{n}'"), line) for n, line in lines.items()
                           if f"layer '{n}'" in str(e))
            raise ModelError(f"{net_path}:{named[0][1]}: {e}" if named else
                             f"{net_path}: {e}") from None

    for field in ("net", "train_net"):
        if param.HasField(field):
            check_graph(probe._resolve(getattr(param, field), "net file"), TRAIN,
                        param.train_state if param.HasField("train_state") else None)
    tests = list(param.test_net) or ([param.net] * len(param.test_iter)
                                     if param.HasField("net") else [])
    for i, name in enumerate(tests):
        check_graph(probe._resolve(name, "test net file"), TEST,
                    param.test_state[i] if i < len(param.test_state) else None)
    return param


def get_solver(path_or_param, **kwargs):
    """The solver a solver file (or SolverParameter) describes; its `type` picks the update rule."""
    return Solver(path_or_param, **kwargs)
