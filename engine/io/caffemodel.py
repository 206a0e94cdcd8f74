"""Caffe's binary weight, solver-state and mean files, byte-compatible with Caffe.

Formats (all written through :func:`write_atomic`, so a crash mid-snapshot never
leaves a torn file behind):

* ``.caffemodel``   -- a serialized ``NetParameter`` whose layers carry ``blobs``;
* ``.solverstate``  -- a serialized ``SolverState`` (iteration, history blobs);
* ``.binaryproto``  -- one ``BlobProto`` (mean images, as compute_image_mean writes);
* ``.caffemodel.h5`` / ``.solverstate.h5`` -- Caffe's HDF5 snapshot layout (h5py).

Everything here is numpy-only; callers convert CuPy arrays first (``cupy.asnumpy``).
"""
import errno
import io
import os
import tempfile
from typing import NamedTuple

import numpy as np

from poseidon.engine.errors import DiskFullError, ModelError
from poseidon.engine.proto import caffe_pb2

_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


class SolverStateData(NamedTuple):
    """Contents of a solver snapshot, whichever format it came from."""
    iter: int
    learned_net: str
    history: list
    current_step: int


# --------------------------------------------------------------------------- atomic writes

def _refuse_if_full(path, error):
    """Raise DiskFullError naming `path` when `error` is a full disk or quota (one line for the
    user instead of an OSError's traceback); return otherwise."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(f"{path}: cannot be written: the disk is full ({error.strerror}); it "
                            f"was left as it was, with no half-written copy: free space on that "
                            f"disk, or write elsewhere (a snapshot: set snapshot_prefix), and run "
                            f"again") from None


def write_atomic(path, data_bytes, mode=None):
    """Write ``data_bytes`` to ``path`` so readers see the old file or the new one, never half.

    The bytes go to a temporary file in the same folder (same filesystem, so the
    rename is atomic), are flushed and fsync'ed, then ``os.replace`` swaps it in.
    The file gets ``mode`` when given, else the old file's mode, else a usual 0644.
    A full disk (or quota) raises DiskFullError naming ``path``, after the temporary
    file is removed: the old file, if any, is left as it was.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".",
                                   suffix=".tmp")
    except OSError as e:
        _refuse_if_full(path, e)
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data_bytes)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file 0600, so it is never readable by others before the chmod
        if mode is None:
            mode = os.stat(path).st_mode & 0o7777 if os.path.exists(path) else 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        _refuse_if_full(path, e)
        raise
    try:  # make the rename itself durable; not every platform can open a folder
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------- blobs

def _varint(n):
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _packed(field, values, dtype):
    """Wire bytes of a packed repeated float/double field.

    Merging these raw bytes copies the array once, where ``RepeatedField.extend`` would make
    a Python float of every number, which matters for 100M-parameter models.
    """
    raw = np.ascontiguousarray(values, dtype=dtype).tobytes()
    return _varint(field << 3 | 2) + _varint(len(raw)) + raw if raw else b""


def blob_to_proto(array, proto=None, diff=None, double=False):
    """Fill ``proto`` (a new BlobProto if None) with ``array``'s shape and values.

    Like Caffe's ``Blob::ToProto``: the N-d ``shape`` field, values in ``data``
    (``double_data`` when ``double``), and ``diff`` / ``double_diff`` if given.
    """
    arr = np.asarray(array)
    proto = caffe_pb2.BlobProto() if proto is None else proto
    proto.Clear()
    proto.shape.dim.extend(int(d) for d in arr.shape)
    dtype, data_field, diff_field = ("<f8", 8, 9) if double else ("<f4", 5, 6)
    raw = _packed(data_field, arr.ravel(), dtype)
    if diff is not None:
        diff = np.asarray(diff)
        if diff.size != arr.size:
            raise ValueError(f"blob_to_proto: diff has {diff.size} values, data has {arr.size}")
        raw += _packed(diff_field, diff.ravel(), dtype)
    proto.MergeFromString(raw)
    return proto


def _legacy_dims(proto):
    return (proto.num, proto.channels, proto.height, proto.width)


def _has_legacy(proto):
    return any(proto.HasField(f) for f in ("num", "channels", "height", "width"))


def proto_to_array(blob_proto):
    """BlobProto -> numpy array: float32 from ``data``, float64 from ``double_data``.

    Without a ``shape`` field the blob is read in the legacy 4-D
    (num, channels, height, width) form, as Caffe's ``Blob::FromProto`` does.
    """
    if blob_proto.HasField("shape"):
        shape = tuple(int(d) for d in blob_proto.shape.dim)
    else:
        shape = tuple(int(d) for d in _legacy_dims(blob_proto))
    if len(blob_proto.double_data):
        values = np.array(blob_proto.double_data, dtype=np.float64)
    else:
        values = np.array(blob_proto.data, dtype=np.float32)
    count = int(np.prod(shape, dtype=np.int64))
    if values.size != count:
        raise ValueError(f"BlobProto holds {values.size} values but its shape {shape} "
                         f"needs {count}")
    return values.reshape(shape)


def shapes_match(proto, shape):
    """Caffe's ``Blob::ShapeEquals``: does a stored blob fit a layer blob of ``shape``?

    Legacy num/channels/height/width are compared right-aligned with missing
    leading axes read as 1, so an InnerProduct weight saved as 1x1xNxK matches
    (N, K) and a bias saved as 1x1x1xN matches (N,).
    """
    shape = tuple(int(d) for d in shape)
    if _has_legacy(proto):
        padded = (1,) * (4 - len(shape)) + shape
        return len(shape) <= 4 and padded == tuple(_legacy_dims(proto))
    return tuple(int(d) for d in proto.shape.dim) == shape


# --------------------------------------------------------------------------- protobuf files

def is_hdf5(path):
    """True when ``path`` starts with the HDF5 signature (a .caffemodel.h5 / .solverstate.h5)."""
    with open(os.fspath(path), "rb") as f:
        return f.read(len(_HDF5_MAGIC)) == _HDF5_MAGIC


def _read_proto(path, message, what):
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(_HDF5_MAGIC):
        raise ValueError(f"{path} is an HDF5 file, not a binary {what}; "
                         "read it with the *_hdf5 functions")
    try:
        message.ParseFromString(data)
    except Exception as e:  # google.protobuf.message.DecodeError and friends
        raise ValueError(f"{path} is not a binary {what} ({e}); "
                         "a text .prototxt is read with google.protobuf.text_format") from None
    return message


def unreadable_reason(error, message):
    """Why a weights or solver-state file could not be read, short enough for a one-line error."""
    if "Error parsing message" in str(error):
        return f"protobuf cannot parse it as a Caffe {message}"
    return str(error)[:120]


def read_or_refuse(path, read, message, what, fix, hdf5_fix=""):
    """read()'s result; a damaged file (or an HDF5 one without h5py) as one ModelError line naming
    `path`, what it should be (`what`), the protobuf `message` that failed, and `fix`."""
    try:
        return read()
    except ImportError:
        raise ModelError(f"{path}: is an HDF5 {what} and reading it needs h5py: pip install "
                         f"h5py{hdf5_fix}") from None
    except (ValueError, OSError, KeyError) as e:
        raise ModelError(f"{path}: not a readable {what} ({unreadable_reason(e, message)}); "
                         f"{fix}") from None


def read_net_proto(path):
    """Read a binary NetParameter (e.g. a .caffemodel); ValueError if unparseable."""
    return _read_proto(path, caffe_pb2.NetParameter(), "NetParameter (.caffemodel)")


def write_net_proto(net_param, path):
    """Serialize a NetParameter to ``path`` atomically."""
    write_atomic(path, net_param.SerializeToString())


def read_binaryproto(path):
    """Read a BlobProto file (mean image) as Caffe's Blob sees it: legacy files give (N, C, H, W)."""
    return proto_to_array(_read_proto(path, caffe_pb2.BlobProto(), "BlobProto (.binaryproto)"))


def write_binaryproto(array, path):
    """Write ``array`` as compute_image_mean does: legacy num=1/channels/height/width, float data.

    (C, H, W) gets num=1; fewer axes are padded with leading 1s; more than four
    axes cannot be said in the legacy form and go into ``shape`` instead.
    """
    arr = np.asarray(array, dtype=np.float32)
    if arr.ndim > 4:
        proto = blob_to_proto(arr)
    else:
        proto = caffe_pb2.BlobProto()
        proto.num, proto.channels, proto.height, proto.width = (1,) * (4 - arr.ndim) + arr.shape
        proto.MergeFromString(_packed(5, arr.ravel(), "<f4"))
    write_atomic(path, proto.SerializeToString())


def read_solverstate(path):
    """Read a binary .solverstate into a :class:`SolverStateData`."""
    st = _read_proto(path, caffe_pb2.SolverState(), "SolverState (.solverstate)")
    return SolverStateData(st.iter, st.learned_net, [proto_to_array(b) for b in st.history],
                           st.current_step)


def write_solverstate(path, iteration, learned_net, history_arrays, current_step=0):
    """Write a binary .solverstate as Caffe's SGDSolver does (one history blob per parameter)."""
    st = caffe_pb2.SolverState(iter=int(iteration), learned_net=str(learned_net),
                               current_step=int(current_step))
    for h in history_arrays:
        h = np.asarray(h)
        blob_to_proto(h, st.history.add(), double=h.dtype == np.float64)
    write_atomic(path, st.SerializeToString())


# --------------------------------------------------------------------------- HDF5

def _h5py():
    try:
        import h5py
    except ImportError:
        raise ImportError("HDF5 snapshots need h5py: pip install h5py "
                          "(or use the binary protobuf formats)") from None
    return h5py


def _h5_array(a):
    a = np.asarray(a)
    return a if a.dtype == np.float64 else a.astype(np.float32)


def _write_h5(path, fill):
    """Build the HDF5 file in memory, then hand the bytes to write_atomic."""
    h5py = _h5py()
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        fill(f)
    write_atomic(path, buf.getvalue())


def _read_indexed(group):
    """Datasets named "0", "1", ... in numeric order."""
    return [np.asarray(group[k]) for k in sorted(group.keys(), key=int)]


def write_net_hdf5(path, blobs, diffs=None):
    """Write ``{layer_name: [arrays]}`` in Caffe's Net::ToHDF5 layout: ``data/<layer>/<i>``.

    ``diffs`` (same structure) goes to ``diff/<layer>/<i>`` like snapshot_diff.
    """
    def fill(f):
        for top, tree in (("data", blobs), ("diff", diffs)):
            if tree is None:
                continue
            root = f.create_group(top)
            for layer, arrays in tree.items():
                g = root.create_group(layer)
                for i, a in enumerate(arrays):
                    g.create_dataset(str(i), data=_h5_array(a))
    _write_h5(path, fill)


def read_net_hdf5(path):
    """Read a Caffe HDF5 net (``.caffemodel.h5``) into ``{layer_name: [arrays]}``."""
    h5py = _h5py()
    with h5py.File(os.fspath(path), "r") as f:
        if "data" not in f:
            raise ValueError(f"{path} has no 'data' group: not a Caffe HDF5 net")
        return {name: _read_indexed(g) for name, g in f["data"].items()}


def write_solverstate_hdf5(path, iteration, learned_net, history_arrays, current_step=0):
    """Write Caffe's HDF5 solver state: ``iter``, ``learned_net``, ``current_step``, ``history/<i>``."""
    def fill(f):
        f.create_dataset("iter", data=np.array([iteration], dtype=np.int32))
        f.create_dataset("learned_net", data=np.bytes_(str(learned_net).encode()))
        f.create_dataset("current_step", data=np.array([current_step], dtype=np.int32))
        g = f.create_group("history")
        for i, h in enumerate(history_arrays):
            g.create_dataset(str(i), data=_h5_array(h))
    _write_h5(path, fill)


def read_solverstate_hdf5(path):
    """Read Caffe's HDF5 solver state into a :class:`SolverStateData`."""
    h5py = _h5py()
    with h5py.File(os.fspath(path), "r") as f:
        net = f["learned_net"][()]
        return SolverStateData(
            int(np.asarray(f["iter"]).reshape(-1)[0]),
            net.decode() if isinstance(net, bytes) else str(net),
            _read_indexed(f["history"]) if "history" in f else [],
            int(np.asarray(f["current_step"]).reshape(-1)[0]) if "current_step" in f else 0)
