"""A solver file: reading it (with Caffe's upgrades), checking its values, finding the files it
names, and placing an error on the line of the field it is about. `check_solver_file` does all of
it without building a net, so a distributed launch can refuse a bad file before any process starts.
"""
import logging
import os
import re

from ..errors import ModelError
from ..layer import TEST, TRAIN
from ..proto import caffe_pb2
from . import rules

log = logging.getLogger("poseidon")


def at_key(error, source):
    """A solver error with the file:line of the solver field it names (the first one named that
    the file sets), in place of its "solver:" prefix."""
    message = str(error)
    for prefix in ("solver: ", f"{source}: "):
        if message.startswith(prefix):
            message = message[len(prefix):]
    where = source or "solver"
    if source:
        fields = [f.name for f in caffe_pb2.SolverParameter.DESCRIPTOR.fields]
        named = sorted((m.start(), name) for name in fields
                       for m in [re.search(rf"(?<![\w-]){name}(?![\w-])", message)] if m)
        from ..prototxt import field_line
        for _, name in named:
            line = field_line(source, name)
            if line:
                where = f"{source}:{line}"
                break
    return type(error)(f"{where}: {message}")


def check_param(p, where):
    """The solver's values Caffe would refuse, each with one line naming the field."""
    for name in ("base_lr", "max_iter", "snapshot", "display", "test_interval"):
        if getattr(p, name) < 0:
            raise ModelError(f"{where}: {name} must be >= 0, got {getattr(p, name):g}; give a "
                             f"non-negative value")
    if p.snapshot_format == caffe_pb2.SolverParameter.HDF5:
        try:
            import h5py  # noqa: F401
        except ImportError:
            raise ModelError(f"{where}: snapshot_format: HDF5 needs h5py: pip install h5py, or "
                             f"remove snapshot_format (binary protobuf)") from None
    if p.iter_size < 1:
        raise ModelError(f"{where}: iter_size must be at least 1, got {p.iter_size}")
    if p.average_loss < 1:
        raise ModelError(f"{where}: average_loss should be non-negative and at least 1, got "
                         f"{p.average_loss}")
    if p.snapshot > 0 and not p.HasField("snapshot_prefix"):
        raise ModelError(f"{where}: snapshot is specified but snapshot_prefix is not; add "
                         f"snapshot_prefix: \"<folder>/<name>\"")


def resolve(path, what, source):
    """A file named in the solver: relative to the cwd first, then to the solver file's folder."""
    if os.path.exists(path):
        return path
    if source and not os.path.isabs(path):
        beside = os.path.join(os.path.dirname(os.path.abspath(source)), path)
        if os.path.exists(beside):
            return beside
    looked = "the current directory" + (
        f" and {os.path.dirname(os.path.abspath(source))}" if source else "")
    raise ModelError(f"{source or 'solver'}: {what} '{path}' does not exist (looked in {looked}); "
                     f"check the path")


def read_solver(path):
    from ..prototxt import read_solver
    return read_solver(path)


def upgrade_snapshot_prefix(param, path):
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
    source = os.fspath(path)
    param = read_solver(source)
    try:
        check_param(param, source)
        rules.make_rule(param)
    except ModelError as e:
        raise at_key(e, source) from None

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
            check_graph(resolve(getattr(param, field), "net file", source), TRAIN,
                        param.train_state if param.HasField("train_state") else None)
    tests = list(param.test_net) or ([param.net] * len(param.test_iter)
                                     if param.HasField("net") else [])
    for i, name in enumerate(tests):
        check_graph(resolve(name, "test net file", source), TEST,
                    param.test_state[i] if i < len(param.test_state) else None)
    return param
