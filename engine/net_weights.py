"""A Net's weights in files: Caffe's binary .caffemodel (a NetParameter with blobs) and its HDF5
form, written from the net's parameter blobs and read back into them by layer name, as Caffe's
CopyTrainedLayersFrom does. Net.save, Net.copy_from and the others call these."""
import collections
import logging
import os

import numpy

from . import backend, prototxt
from .errors import ModelError
from .proto import caffe_pb2

log = logging.getLogger("poseidon")


def to_proto(net, write_diff=False):
    """The net's NetParameter with each layer's parameter blobs (and diffs, when asked)."""
    from .io.caffemodel import blob_to_proto
    out = caffe_pb2.NetParameter(name=net.name)
    for lp, layer in zip(net.param.layer, net.layers):
        lout = out.layer.add()
        lout.CopyFrom(lp)
        lout.ClearField("blobs")
        for blob in layer.blobs:
            diff = backend.to_numpy(blob.diff) if write_diff else None
            # float64 nets write double_data, as Caffe's Blob<double> does: exact resumes
            blob_to_proto(backend.to_numpy(blob.data), lout.blobs.add(), diff=diff,
                          double=net.dtype == numpy.float64)
    return out


def save(net, path):
    """Binary .caffemodel, written atomically."""
    from .io.caffemodel import write_net_proto
    write_net_proto(to_proto(net), path)


def save_hdf5(net, path):
    from .io.caffemodel import write_net_hdf5
    write_net_hdf5(path, collections.OrderedDict(
        (name, [backend.to_numpy(b.data) for b in layer.blobs])
        for name, layer in net.layer_dict.items() if layer.blobs))


def copy_from(net, path, report_missing=True):
    """Load weights by layer name from a .caffemodel (binary) or .h5 file, as Caffe does.

    Returns the names of the net's layers with parameters that the file gave nothing (they keep
    their fillers' values). Layers new in a fine-tuned net are expected there, but a file cut at
    a layer boundary (or empty) parses without error and simply lacks its last layers, so a
    warning lists them unless `report_missing` is False: a resume, where every layer must come
    from the file, asks for the list and refuses instead."""
    from .io import caffemodel
    if not os.path.exists(path):
        raise ModelError(f"{path}: weights file does not exist; check the path")
    if os.path.isdir(path):
        raise ModelError(f"{path}: is a folder; give a .caffemodel (or .caffemodel.h5) file")

    def read():
        if caffemodel.is_hdf5(path):
            return list(caffemodel.read_net_hdf5(path).items())
        proto = prototxt.upgrade_net(caffemodel.read_net_proto(path))
        return [(lp.name, list(lp.blobs)) for lp in proto.layer]

    source = caffemodel.read_or_refuse(
        path, read, "NetParameter", "weights file",
        "give a binary .caffemodel or .caffemodel.h5 (a torn copy or download also gives "
        "this: copy it again)", hdf5_fix=" (or use a binary .caffemodel)")
    return copy_arrays(net, path, source, report_missing)


def copy_arrays(net, path, source, report_missing=True):
    """Caffe's CopyTrainedLayersFrom over (layer name, blobs) pairs: layers matched by name; the
    file's other layers are skipped (a warning names them when none matched); a shape mismatch
    is an error. Returns the net's layers with parameters the file did not fill (copy_from)."""
    skipped, loaded = [], set()
    for name, blobs in source:
        layer = net.layer_dict.get(name)
        if layer is None or not blobs:
            if blobs:
                skipped.append(name)
            continue
        loaded.add(name)
        if len(blobs) != len(layer.blobs):
            raise ModelError(f"{path}: layer '{name}' has {len(blobs)} blobs in the weights file "
                             f"but {len(layer.blobs)} in the net; check that the file matches "
                             f"the model")
        for bi, (src, blob) in enumerate(zip(blobs, layer.blobs)):
            array = _stored_array(path, name, bi, src, blob)
            blob.data[...] = backend.to_xp(array.astype(net.dtype, copy=False), net.xp)
    missing = [name for name in net.params if name not in loaded]
    if skipped and not loaded and any(layer.blobs for layer in net.layers):
        log.warning(f"warning: {path}: none of its layers ({name_list(skipped, 5)}) is named "
                    f"like a layer with parameters of net '{net.name}' "
                    f"({name_list(net.params, len(net.params))}); nothing was loaded: check "
                    f"that the weights belong to this model (layers are matched by name)")
    elif missing and report_missing:
        log.warning(f"warning: {path}: has no weights for layer(s) {name_list(missing)} of "
                    f"net '{net.name}', which keep their initial values: expected for "
                    f"layers new in fine-tuning; otherwise the file is cut short or of "
                    f"another model: copy it again or check the model")
    return missing


def _stored_array(path, name, bi, src, blob):
    """Parameter bi of layer `name` as the file holds it (a BlobProto or an HDF5 array), shaped
    as the net's blob; a ModelError when its size or shape does not fit."""
    from .io.caffemodel import proto_to_array, shapes_match
    if not isinstance(src, caffe_pb2.BlobProto):
        array = numpy.asarray(src)
        if array.size != blob.count:
            raise ModelError(f"{path}: layer '{name}' parameter {bi} has shape "
                             f"{array.shape} in the weights file but {blob.shape} in "
                             f"the net; check that the file matches the model")
        return array.reshape(blob.shape)
    if not shapes_match(src, blob.shape):
        raise ModelError(f"{path}: layer '{name}' parameter {bi} has shape "
                         f"{_stored_shape(src)} in the weights file "
                         f"but {blob.shape} in the net; check that the file "
                         f"matches the model")
    try:
        return proto_to_array(src).reshape(blob.shape)
    except ValueError as e:
        raise ModelError(f"{path}: layer '{name}' parameter {bi}: {e}; the file "
                         f"is damaged: copy it again") from None


def _stored_shape(proto):
    """The shape a BlobProto declares (its N-d shape, else legacy num/channels/height/width)."""
    if proto.HasField("shape"):
        return tuple(int(d) for d in proto.shape.dim)
    return (proto.num, proto.channels, proto.height, proto.width)


def name_list(names, limit=8):
    """`'a', 'b', 'c' and 4 more`: layer names for a one-line message, at most `limit` shown."""
    names = list(names)
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
