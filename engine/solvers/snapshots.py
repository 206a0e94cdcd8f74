"""A solver's snapshot on disk and back: Caffe's files plus what Caffe's format has no field for.

    <prefix>_iter_N.caffemodel(.h5)     the weights (and diffs with snapshot_diff)
    <prefix>_iter_N.solverstate(.h5)    iteration, history, the weights file's name
    <prefix>_iter_N.cursors.json        the data cursors and the random state, so that a resumed run
                                        is bitwise the uninterrupted one
    <prefix>_iter_N.manifest.json       written last by the Solver, over all of them (io/manifest.py)

The Solver calls these through its snapshot/restore, around which its hooks may act (a distributed
job writes one snapshot for all its workers).
"""
import json
import logging
import os
from collections import OrderedDict

import numpy

from .. import backend
from ..errors import ModelError
from ..io import caffemodel, manifest
from ..net_weights import name_list
from ..proto import caffe_pb2

log = logging.getLogger("poseidon")


def cursor_path(state_path):
    return manifest.snapshot_base(state_path) + ".cursors.json"


def _layer_arrays(net, which):
    return OrderedDict((name, [backend.to_numpy(getattr(b, which)) for b in layer.blobs])
                       for name, layer in zip(net.layer_names, net.layers) if layer.blobs)


def _write_weights(solver, hdf5):
    p, net = solver.param, solver.net
    if hdf5:
        model_file = solver.snapshot_filename(".caffemodel.h5")
        log.info(f"Snapshotting to HDF5 file {model_file}")
        diffs = _layer_arrays(net, "diff") if p.snapshot_diff else None
        caffemodel.write_net_hdf5(model_file, _layer_arrays(net, "data"), diffs)
    else:
        model_file = solver.snapshot_filename(".caffemodel")
        log.info(f"Snapshotting to binary proto file {model_file}")
        if p.snapshot_diff:
            caffemodel.write_net_proto(net.to_proto(write_diff=True), model_file)
        else:
            net.save(model_file)
    return model_file


def write(solver):
    """Write the weights, the solver state and the cursors of `solver`; returns (the files written,
    the solverstate path). The manifest is the caller's, written after whatever it adds."""
    p = solver.param
    if not p.HasField("snapshot_prefix"):
        raise ModelError(f"{solver.source or 'solver'}: cannot snapshot: snapshot_prefix is not set")
    hdf5 = p.snapshot_format == caffe_pb2.SolverParameter.HDF5
    folder = os.path.dirname(p.snapshot_prefix)
    if folder:
        os.makedirs(folder, exist_ok=True)
    model_file = _write_weights(solver, hdf5)
    history = [backend.to_numpy(state[k]) for k in range(solver.rule.num_state)
               for state in solver.history]
    if hdf5:
        state_file = solver.snapshot_filename(".solverstate.h5")
        log.info(f"Snapshotting solver state to HDF5 file {state_file}")
        caffemodel.write_solverstate_hdf5(state_file, solver.iter, model_file, history,
                                          solver.current_step)
    else:
        state_file = solver.snapshot_filename(".solverstate")
        log.info(f"Snapshotting solver state to binary proto file {state_file}")
        caffemodel.write_solverstate(state_file, solver.iter, model_file, history,
                                     solver.current_step)
    cursors = cursor_path(state_file)
    caffemodel.write_atomic(cursors, json.dumps(solver.cursor_state()).encode("utf-8"))
    return [model_file, state_file, cursors], state_file


def _read_state(path):
    read = caffemodel.read_solverstate_hdf5 if path.endswith(".h5") else caffemodel.read_solverstate
    return caffemodel.read_or_refuse(
        path, lambda: read(path), "SolverState", "solver state",
        "give the .solverstate a snapshot wrote (a torn copy also gives this: resume from an "
        "earlier snapshot)")


def learned_net_path(name, state_path):
    """The weights file of the snapshot `state_path`: the one its manifest lists (and read() has
    just verified), beside it; without a manifest (a Caffe snapshot) the file called `name` beside
    it, then `name` as written. The solverstate's `name` is the path the snapshot was written to,
    relative to that run's folder: tried first, it would load another run's weights when two
    experiments share a relative snapshot_prefix."""
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


def _restore_history(solver, state, path):
    params = solver.net.learnable_params
    num_state = solver.rule.num_state
    expected = len(params) * num_state
    if len(state.history) != expected:
        raise ModelError(f"{path}: holds {len(state.history)} history blobs, the "
                         f"{solver.rule.type} solver of this net needs {expected} "
                         f"({len(params)} parameters x {num_state}); check the "
                         f"solver type and the model")
    log.info(f"{solver.rule.type}Solver: restoring history")
    for k in range(num_state):
        for i in range(len(params)):
            array = numpy.asarray(state.history[k * len(params) + i])
            target = solver.history[i][k]
            if array.size != target.size:
                raise ModelError(f"{path}: history blob {k * len(params) + i} has "
                                 f"{array.size} values, parameter "
                                 f"'{solver.net.learnable_param_specs[i].name}' has "
                                 f"{target.size}")
            target[...] = backend.to_xp(array.reshape(target.shape).astype(target.dtype),
                                        backend.get_array_module(target))


def read(solver, path):
    """Load the snapshot whose solverstate is `path` into `solver`: weights, history, iteration,
    and the cursors and random state when the .cursors.json is there (a Caffe snapshot has none)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelError(f"{path}: solver state file does not exist; check the --snapshot "
                         f"path (snapshots are <snapshot_prefix>_iter_N.solverstate)")
    if os.path.exists(manifest.manifest_path(path)):
        manifest.verify_manifest(manifest.manifest_path(path))
    else:
        log.warning(f"{path}: no snapshot manifest beside it (a Caffe snapshot?); "
                    f"resuming without checksum verification")
    state = _read_state(path)
    if state.learned_net:
        weights = learned_net_path(state.learned_net, path)
        try:
            missing = solver.net.copy_from(weights, report_missing=False)
        except ModelError as e:
            detail = str(e).split("; check that the file")[0]
            raise ModelError(f"{path}: is a snapshot of another net ({detail}); resume with "
                             f"the solver and model that wrote it") from None
        if missing:     # a weights file cut at a layer boundary still parses
            raise ModelError(f"{weights}: has no weights for layer(s) {name_list(missing)} of the "
                             f"net, and a resume needs them all (the file is cut short, or of "
                             f"another net): resume from an earlier snapshot")
    _restore_history(solver, state, path)
    solver.iter = int(state.iter)
    sidecar = cursor_path(path)
    if os.path.exists(sidecar):
        with open(sidecar, "r", encoding="utf-8") as f:
            extra = json.load(f)
        solver.load_cursor_state(dict(extra, iter=None))
