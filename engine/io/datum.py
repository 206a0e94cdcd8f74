"""Caffe ``Datum`` records (the values stored in LMDB/LevelDB data sets) <-> numpy (C, H, W).

A Datum holds one example in one of three forms, checked in Caffe's order:
encoded image file bytes (``encoded=True``), raw uint8 CHW bytes in ``data``,
or floats in ``float_data``.  Decoded images come out BGR, as OpenCV gives
them to Caffe, so means and pretrained weights line up.
"""
import io

import numpy as np

from poseidon.engine.io.caffemodel import _packed
from poseidon.engine.proto import caffe_pb2


def array_to_datum(arr_chw, label=0):
    """Pack a (C, H, W) array (or (H, W), taken as C=1) into a Datum.

    uint8 goes to ``data`` bytes like convert_imageset; any other dtype to
    ``float_data`` as float32.
    """
    arr = np.asarray(arr_chw)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise ValueError(f"array_to_datum expects (C, H, W) or (H, W), got shape {arr.shape}")
    c, h, w = arr.shape
    datum = caffe_pb2.Datum(channels=c, height=h, width=w, label=int(label))
    if arr.dtype == np.uint8:
        datum.data = np.ascontiguousarray(arr).tobytes()
    else:  # packed bytes parse into the (unpacked) float_data field fast
        datum.MergeFromString(_packed(6, arr.ravel(), "<f4"))
    return datum


def _decode_image(data, color):
    """Decode image file bytes to (C, H, W) like OpenCV's imdecode (uint8 for 8-bit files).

    color=None keeps the file's channels (IMREAD_UNCHANGED: gray -> 1, colour -> BGR,
    alpha -> BGRA); True forces 3-channel BGR; False forces 1-channel gray.
    """
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("decoding encoded Datum images needs Pillow: pip install Pillow") from None
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:
        raise ValueError(f"Datum has encoded=true but its data is not a readable image ({e})") from None
    mode = img.mode
    if color is not None:
        target = "RGB" if color else "L"
    elif mode in ("L", "F") or mode.startswith("I"):
        target = None                   # gray (8/16/32-bit) stays one channel
    elif mode == "1":
        target = "L"
    elif mode in ("LA", "PA", "RGBA") or (mode == "P" and "transparency" in img.info):
        target = "RGBA"
    else:
        target = "RGB"                  # RGB, palette, CMYK, YCbCr, ...
    if target and target != mode:
        img = img.convert(target)
    a = np.asarray(img)
    if a.ndim == 2:
        return a[None].copy()
    if a.shape[2] == 4:
        a = a[:, :, [2, 1, 0, 3]]  # RGBA -> BGRA
    else:
        a = a[:, :, ::-1]          # RGB -> BGR
    return np.ascontiguousarray(a.transpose(2, 0, 1))


def datum_to_array(datum, color=None):
    """Datum -> numpy (C, H, W): uint8 for ``data``/encoded images, float32 for ``float_data``.

    ``color`` only matters for encoded images (see ``_decode_image``; it plays
    the role of TransformationParameter.force_color / force_gray).
    Raises ValueError naming the mismatch when the Datum is corrupt.
    """
    if datum.encoded:
        if not datum.data:
            raise ValueError("Datum has encoded=true but no image bytes in data")
        return _decode_image(datum.data, color)
    c, h, w = datum.channels, datum.height, datum.width
    if c <= 0 or h <= 0 or w <= 0:
        raise ValueError(f"Datum has invalid shape channels={c} height={h} width={w}")
    n = c * h * w
    if datum.data:
        if len(datum.data) != n:
            raise ValueError(f"Datum data has {len(datum.data)} bytes but channels*height*width "
                             f"= {c}*{h}*{w} = {n}")
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(c, h, w).copy()
    if len(datum.float_data):
        if len(datum.float_data) != n:
            raise ValueError(f"Datum float_data has {len(datum.float_data)} values but "
                             f"channels*height*width = {c}*{h}*{w} = {n}")
        return np.array(datum.float_data, dtype=np.float32).reshape(c, h, w)
    raise ValueError(f"Datum of shape {c}x{h}x{w} holds no data and no float_data")
