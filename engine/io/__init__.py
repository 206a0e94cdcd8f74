"""Readers and writers for Caffe's on-disk formats (weights, solver state, means, Datum, LMDB).

The names pycaffe's `caffe.io` offers for Datum and BlobProto are here too:

    from poseidon.engine import io
    datum = io.array_to_datum(image_chw, label=3); image = io.datum_to_array(datum)
    mean = io.read_binaryproto("mean.binaryproto")          # (1, C, H, W), as Caffe reads it
"""
from .caffemodel import proto_to_array as blobproto_to_array  # noqa: F401
from .caffemodel import blob_to_proto as array_to_blobproto  # noqa: F401
from .caffemodel import read_binaryproto, write_binaryproto  # noqa: F401
from .datasets import load_image  # noqa: F401
from .datum import array_to_datum, datum_to_array  # noqa: F401
