"""`--resume auto`: find the newest COMPLETE snapshot of a solver's snapshot_prefix.

A snapshot counts only when its manifest (written last) is there and every file it names still
matches its checksum; a newer set torn by a crash (files without a manifest, or a file cut short)
is skipped with a line saying why. A distributed snapshot must also carry a cursor file for every
other worker of this job, and no more (the data cursors are per shard), else it belongs to a run
with another worker count and is skipped too (one process, workers=None, takes any: it can
restore a distributed snapshot's weights and solver state). Only rank 0 (the local launcher, or worker 0 of a multi-host
job) looks: the snapshot lives on worker 0's disk and worker 0 hands the others their state.
"""
import glob
import os
import re

from poseidon.engine.errors import ModelError
from poseidon.engine.io import manifest

_ITER = re.compile(r"_iter_(\d+)\.(manifest\.json|caffemodel(\.h5)?|solverstate(\.h5)?)$")


def snapshot_settings(solver_path):
    """(snapshot_prefix as the engine will use it, Caffe's defaults applied; snapshot interval)."""
    from poseidon.engine.solvers.solverfile import read_solver, upgrade_snapshot_prefix
    param = read_solver(solver_path)
    upgrade_snapshot_prefix(param, solver_path)
    return param.snapshot_prefix, param.snapshot


def _state_file(manifest_file):
    states = manifest.listed_files(manifest_file, (".solverstate", ".solverstate.h5"))
    if not states:
        raise ModelError(f"{manifest_file}: names no .solverstate file")
    return states[0], [entry["file"] for entry in manifest.read_manifest(manifest_file)["files"]]


def newest_complete(prefix, workers=None, say=print):
    """The .solverstate of the newest complete snapshot under `prefix` for a job of `workers`
    workers (None: one process), or None. `say` gets one line per newer snapshot skipped and why."""
    found, unlisted = [], set()
    for path in glob.glob(glob.escape(prefix) + "_iter_*"):
        m = _ITER.search(path)
        if m and path[:m.start()] == prefix:
            if m.group(2) == "manifest.json":
                found.append((int(m.group(1)), path))
            else:
                unlisted.add(int(m.group(1)))
    unlisted -= {it for it, _ in found}
    for it, path in sorted(found + [(it, None) for it in unlisted], reverse=True):
        if path is None:
            say(f"skipping the snapshot of iteration {it}: it has no manifest (a crash while it "
                f"was being written)")
            continue
        try:
            manifest.verify_manifest(path)
            state, files = _state_file(path)
        except (ModelError, OSError, ValueError, KeyError) as e:
            say(f"skipping the snapshot of iteration {it}: {e}")
            continue
        base = os.path.basename(manifest.snapshot_base(state))
        cursors = {int(m.group(1)) for f in files
                   for m in [re.fullmatch(re.escape(base) + r"\.cursors\.worker-(\d+)\.json", f)]
                   if m}
        if workers is not None and cursors != set(range(1, workers)):
            say(f"skipping the snapshot of iteration {it} ({path}): it was written by a run of "
                f"{len(cursors) + 1} worker(s), this one has {workers}")
            continue
        return state
    return None
