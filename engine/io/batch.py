"""A batch of (key, serialized Datum) records -> one array (N, C, H, W) and labels (N,).

Kept apart from lmdb_store.py (which finds and reads the records) because the decoding does not
care where the records come from: the Data layer, `poseidon mean` and the tests hand it records.
Every refusal is a DataError naming the record's key and the database holding it.
"""
import numpy

from ..errors import DataError


def _key_text(key):
    return key.decode("utf-8", "replace") if isinstance(key, (bytes, bytearray)) else str(key)


def decode_batch(records, source="?", color=None, where=None):
    """Decode (key, serialized Datum) records into one array (N, C, H, W) and labels (N,) int64.

    The array is uint8 when every record holds uint8 `data` (raw or encoded), float32 otherwise.
    Encoded images are decoded by engine.io.datum (BGR like OpenCV); `color` True/False forces 3
    channels / gray for them (force_color / force_gray), None keeps the file's channels.
    Raises DataError naming the key for a corrupt record or a shape differing from the first one,
    and the database holding it: `where(key)` (e.g. ShardedReader.shard_of) when given, else
    `source`.
    """
    from ..proto import caffe_pb2
    from google.protobuf.message import DecodeError

    def origin(key):
        return where(key) if where is not None else source

    n = len(records)
    labels = numpy.empty(n, numpy.int64)
    raw, shape0, key0 = [], None, None
    all_raw = True
    for i, (key, value) in enumerate(records):
        try:
            datum = caffe_pb2.Datum.FromString(value)
        except DecodeError as e:
            raise DataError(f"record '{_key_text(key)}' of '{origin(key)}' is not a valid Datum "
                            f"({e}): the database is corrupt or was not written by Caffe or "
                            f"`poseidon data`; re-create it") from None
        labels[i] = datum.label
        arr, shape = _datum_contents(datum, key, origin, color)
        if shape0 is None:
            shape0, key0 = shape, key
        elif shape != shape0:
            raise DataError(f"record '{_key_text(key)}' of '{origin(key)}' has shape {shape} but "
                            f"record '{_key_text(key0)}' of the same batch has shape {shape0}: "
                            f"records batched together must have one shape (resize the images "
                            f"when converting)")
        if not isinstance(arr, bytes):
            all_raw = all_raw and arr.dtype == numpy.uint8
        raw.append(arr)
    return _stack(raw, all_raw, n, shape0), labels


def _datum_contents(datum, key, origin, color):
    """(contents, (C, H, W)) of one Datum: its raw bytes as stored, or an array (a decoded
    image, or float_data); a corrupt record is a DataError naming its key and origin(key)."""
    if datum.encoded:
        from .datum import datum_to_array
        try:
            arr = numpy.asarray(datum_to_array(datum, color=color))
        except ValueError as e:
            raise DataError(f"record '{_key_text(key)}' of '{origin(key)}': cannot decode its "
                            f"encoded image ({e})") from None
        if arr.ndim == 2:
            arr = arr[None]
        return arr, tuple(arr.shape)
    shape = (datum.channels, datum.height, datum.width)
    size = shape[0] * shape[1] * shape[2]
    nbytes, nfloats = len(datum.data), len(datum.float_data)
    if min(shape) <= 0:           # two negative sizes would pass the size test below
        raise DataError(f"record '{_key_text(key)}' of '{origin(key)}' is a corrupt "
                        f"Datum: its shape {shape} (channels, height, width) has a size "
                        f"that is not positive; re-create the database")
    if nbytes != size and nfloats != size:
        raise DataError(f"record '{_key_text(key)}' of '{origin(key)}' is a corrupt Datum: "
                        f"shape {shape} but {nbytes} data bytes and {nfloats} float_data "
                        f"values; re-create the database")
    arr = (datum.data if nbytes == size
           else numpy.asarray(datum.float_data, numpy.float32).reshape(shape))
    return arr, shape


def _stack(raw, all_raw, n, shape0):
    """The batch (n,) + shape0 of the records' contents: uint8 when all_raw, else float32; one
    join when every record is raw bytes."""
    if all_raw and all(isinstance(r, bytes) for r in raw):
        return numpy.frombuffer(b"".join(raw), numpy.uint8).reshape((n,) + shape0)
    dtype = numpy.uint8 if all_raw else numpy.float32
    batch = numpy.empty((n,) + shape0, dtype)
    for i, r in enumerate(raw):
        batch[i] = (numpy.frombuffer(r, numpy.uint8).reshape(shape0)
                    if isinstance(r, bytes) else r)
    return batch
