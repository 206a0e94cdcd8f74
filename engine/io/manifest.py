"""Snapshot manifests: the list of a snapshot's files with their sizes and SHA-256 checksums.

The manifest is written last (atomically), so its presence means every file it names was complete.
Resuming checks it, and refuses a torn or mismatched set with a message naming the file, instead of
starting from half-written weights.
"""
import hashlib
import json
import os

from ..errors import ModelError
from .caffemodel import write_atomic


def snapshot_base(state_path):
    """`<prefix>_iter_N` for `<prefix>_iter_N.solverstate[.h5]`: the stem every snapshot file shares."""
    base = state_path[:-3] if state_path.endswith(".h5") else state_path
    if base.endswith(".solverstate"):
        base = base[:-len(".solverstate")]
    return base


def manifest_path(state_path):
    """`<prefix>_iter_N.manifest.json` for `<prefix>_iter_N.solverstate[.h5]`."""
    return snapshot_base(state_path) + ".manifest.json"


def file_digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path, files, info=None):
    """Record files (paths; stored relative to the manifest's folder) with size and checksum."""
    folder = os.path.dirname(os.path.abspath(path))
    entries = []
    for f in files:
        entries.append({"file": os.path.relpath(os.path.abspath(f), folder),
                        "bytes": os.path.getsize(f), "sha256": file_digest(f)})
    body = {"format": "poseidon-snapshot-manifest/1", "files": entries, "info": info or {}}
    write_atomic(path, json.dumps(body, indent=1).encode("utf-8"))


def read_manifest(path):
    """The manifest's body, {"files": [{"file", "bytes", "sha256"}, ...], "info": {...}}; a
    ModelError naming it when it cannot be read or is JSON of another shape (`[]`,
    `{"files": null}`: a file damaged, or not written here), which counts as a torn snapshot."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: snapshot manifest is unreadable ({e}); the snapshot may be torn: "
                         f"resume from an earlier one") from None
    entries = body.get("files") if isinstance(body, dict) else None
    if not isinstance(entries, list) or not all(_is_entry(entry) for entry in entries):
        raise ModelError(f"{path}: snapshot manifest does not list files with their sizes and "
                         f"checksums (damaged, or not written by a snapshot); the snapshot may be "
                         f"torn: resume from an earlier one")
    if not isinstance(body.get("info", {}), dict):
        body["info"] = {}
    return body


def _is_entry(entry):
    return (isinstance(entry, dict) and isinstance(entry.get("file"), str)
            and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str))


def verify_manifest(path):
    """Check every file the manifest names; raise ModelError naming the first that is missing,
    short or altered. Returns the manifest's info dict."""
    body = read_manifest(path)
    folder = os.path.dirname(os.path.abspath(path))
    for entry in body["files"]:
        target = os.path.join(folder, entry["file"])
        if not os.path.exists(target):
            raise ModelError(f"{path}: snapshot file {target} is missing; the snapshot is "
                             f"incomplete: resume from an earlier one")
        if os.path.getsize(target) != entry["bytes"] or file_digest(target) != entry["sha256"]:
            raise ModelError(f"{path}: snapshot file {target} does not match its checksum (torn or "
                             f"altered after the snapshot); resume from an earlier snapshot")
    return body.get("info", {})


def listed_files(path, suffixes):
    """The files of the manifest at `path` whose names end with one of `suffixes`, as paths
    beside the manifest (where verify_manifest checked them), in the manifest's order."""
    folder = os.path.dirname(os.path.abspath(path))
    return [os.path.join(folder, entry["file"]) for entry in read_manifest(path)["files"]
            if entry["file"].endswith(tuple(suffixes))]
