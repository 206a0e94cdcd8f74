"""Binary formats: blobs, .caffemodel, .binaryproto, .solverstate, Datum, HDF5, atomic writes.

Run: python -m pytest tests/engine/test_io_binary.py -q
"""
import io
import os
import struct

import numpy as np
import pytest

from poseidon.engine.io import caffemodel as cm
from poseidon.engine.io.datum import array_to_datum, datum_to_array
from poseidon.engine.proto import caffe_pb2

rng = np.random.default_rng(0)


# --------------------------------------------------------------------------- wire format by hand

def varint(n):
    out = b""
    while n > 0x7F:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def tag(field, wire_type):
    return varint(field << 3 | wire_type)


def length_delimited(field, payload):
    return tag(field, 2) + varint(len(payload)) + payload


def test_hand_encoded_blobproto_parses():
    """Bytes built from Caffe's field numbers alone must mean what we think they mean."""
    dims = (2, 3)
    values = [0.5, -1.0, 2.25, 3.0, -4.5, 1e-3]
    shape_msg = length_delimited(1, b"".join(varint(d) for d in dims))   # BlobShape.dim packed
    raw = (length_delimited(5, struct.pack("<6f", *values))              # BlobProto.data packed
           + length_delimited(7, shape_msg))                             # BlobProto.shape
    blob = caffe_pb2.BlobProto.FromString(raw)
    arr = cm.proto_to_array(blob)
    assert arr.dtype == np.float32 and arr.shape == dims
    np.testing.assert_array_equal(arr.ravel(), np.float32(values))
    # ...and our writer emits exactly these bytes (fields in number order, as Caffe's C++ does).
    assert cm.blob_to_proto(np.float32(values).reshape(dims)).SerializeToString() == raw


def test_hand_encoded_legacy_and_unpacked_blob():
    """Legacy num/channels/height/width varints and non-packed floats (old writers) still read."""
    raw = (tag(1, 0) + varint(1) + tag(2, 0) + varint(1) + tag(3, 0) + varint(2)
           + tag(4, 0) + varint(2)
           + b"".join(tag(5, 5) + struct.pack("<f", v) for v in (1, 2, 3, 4)))
    arr = cm.proto_to_array(caffe_pb2.BlobProto.FromString(raw))
    np.testing.assert_array_equal(arr, np.float32([1, 2, 3, 4]).reshape(1, 1, 2, 2))


# --------------------------------------------------------------------------- blobs

@pytest.mark.parametrize("shape", [(), (5,), (4, 3), (2, 3, 4, 5), (2, 1, 3, 2, 2)])
def test_blob_roundtrip(shape):
    a = rng.standard_normal(shape).astype(np.float32)
    back = cm.proto_to_array(cm.blob_to_proto(a))
    assert back.dtype == np.float32 and back.shape == shape
    np.testing.assert_array_equal(back, a)


def test_blob_double_and_diff():
    a, g = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    p = cm.blob_to_proto(a, diff=g, double=True)
    assert len(p.data) == 0 and len(p.double_diff) == 12
    back = cm.proto_to_array(p)
    assert back.dtype == np.float64
    np.testing.assert_array_equal(back, a)
    np.testing.assert_array_equal(np.array(p.double_diff).reshape(3, 4), g)
    with pytest.raises(ValueError, match="diff"):
        cm.blob_to_proto(a, diff=g[:2])


def test_blob_to_proto_fills_given_proto():
    layer = caffe_pb2.LayerParameter()
    old = layer.blobs.add(num=9, channels=9)
    cm.blob_to_proto(np.ones((2, 2), np.float32), old)
    assert not old.HasField("num") and list(old.shape.dim) == [2, 2]


def test_blob_count_mismatch_is_an_error():
    p = caffe_pb2.BlobProto(data=[1, 2, 3])
    p.shape.dim.extend([2, 2])
    with pytest.raises(ValueError, match="3 values"):
        cm.proto_to_array(p)


def test_shapes_match_legacy_right_aligned():
    ip = caffe_pb2.BlobProto(num=1, channels=1, height=10, width=20)
    assert cm.shapes_match(ip, (10, 20))
    assert cm.shapes_match(ip, (1, 10, 20))
    assert not cm.shapes_match(ip, (20, 10))
    assert not cm.shapes_match(ip, (1, 1, 1, 10, 20))
    bias = caffe_pb2.BlobProto(num=1, channels=1, height=1, width=10)
    assert cm.shapes_match(bias, (10,))
    modern = cm.blob_to_proto(np.zeros((10, 20), np.float32))
    assert cm.shapes_match(modern, (10, 20)) and not cm.shapes_match(modern, (1, 1, 10, 20))


# --------------------------------------------------------------------------- files

def _net():
    net = caffe_pb2.NetParameter(name="tiny")
    conv = net.layer.add(name="conv1", type="Convolution", bottom=["data"], top=["conv1"])
    conv.convolution_param.num_output = 4
    cm.blob_to_proto(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), conv.blobs.add())
    cm.blob_to_proto(rng.standard_normal(4).astype(np.float32), conv.blobs.add())
    return net


def test_caffemodel_roundtrip(tmp_path):
    net = _net()
    path = tmp_path / "tiny.caffemodel"
    cm.write_net_proto(net, path)
    back = cm.read_net_proto(path)
    assert back == net
    np.testing.assert_array_equal(cm.proto_to_array(back.layer[0].blobs[0]),
                                  cm.proto_to_array(net.layer[0].blobs[0]))


def test_read_net_proto_rejects_garbage(tmp_path):
    bad = tmp_path / "broken.caffemodel"
    bad.write_bytes(b'name: "text, not binary"\nlayer { }\n')
    with pytest.raises(ValueError, match="broken.caffemodel"):
        cm.read_net_proto(bad)
    h5 = tmp_path / "weights.caffemodel.h5"
    h5.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 32)
    with pytest.raises(ValueError, match="HDF5"):
        cm.read_net_proto(h5)
    assert cm.is_hdf5(h5) and not cm.is_hdf5(bad)


def test_binaryproto_legacy_mean(tmp_path):
    mean = rng.uniform(0, 255, (3, 4, 5)).astype(np.float32)
    path = tmp_path / "mean.binaryproto"
    cm.write_binaryproto(mean, path)
    raw = caffe_pb2.BlobProto.FromString(path.read_bytes())
    assert (raw.num, raw.channels, raw.height, raw.width) == (1, 3, 4, 5)
    assert not raw.HasField("shape")      # exactly what compute_image_mean writes
    back = cm.read_binaryproto(path)
    assert back.shape == (1, 3, 4, 5)
    np.testing.assert_array_equal(back[0], mean)


def test_solverstate_roundtrip(tmp_path):
    hist = [rng.standard_normal((4, 3)).astype(np.float32), np.zeros(4, np.float32)]
    path = tmp_path / "snap_iter_100.solverstate"
    cm.write_solverstate(path, 100, "snap_iter_100.caffemodel", hist, current_step=2)
    st = cm.read_solverstate(path)
    assert (st.iter, st.learned_net, st.current_step) == (100, "snap_iter_100.caffemodel", 2)
    assert len(st.history) == len(hist)
    for a, b in zip(hist, st.history):
        np.testing.assert_array_equal(a, b)


def test_atomic_write_leaves_no_temp_files(tmp_path):
    path = tmp_path / "model.caffemodel"
    for i in range(3):
        cm.write_atomic(path, bytes([i]) * 10)
    cm.write_net_proto(_net(), tmp_path / "other.caffemodel")
    assert sorted(os.listdir(tmp_path)) == ["model.caffemodel", "other.caffemodel"]
    assert path.read_bytes() == b"\x02" * 10
    with pytest.raises(TypeError):          # a failing write keeps the old file, no debris
        cm.write_atomic(path, "not bytes")
    assert path.read_bytes() == b"\x02" * 10
    assert sorted(os.listdir(tmp_path)) == ["model.caffemodel", "other.caffemodel"]


def test_a_full_disk_is_one_error_naming_the_file_and_leaves_the_old_one(tmp_path, monkeypatch):
    """ENOSPC (here from fsync, where delayed allocation reports it) ends the write with a
    DiskFullError naming the file; the temporary file is gone and the old file is untouched."""
    import errno
    from poseidon.engine.errors import DiskFullError, PoseidonError
    path = tmp_path / "run_iter_4.caffemodel"
    cm.write_atomic(path, b"old")

    def failing(code):
        def fsync(fd):
            raise OSError(code, os.strerror(code))
        return fsync
    monkeypatch.setattr(os, "fsync", failing(errno.ENOSPC))
    for target in (path, tmp_path / "run_iter_4.solverstate"):
        with pytest.raises(DiskFullError) as err:
            cm.write_atomic(target, b"new" * 1000)
        assert str(err.value).startswith(f"{target}: cannot be written: the disk is full")
        assert isinstance(err.value, PoseidonError) and isinstance(err.value, OSError)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["run_iter_4.caffemodel"]
    monkeypatch.setattr(os, "fsync", failing(errno.EIO))
    with pytest.raises(OSError) as err:       # other errors stay what they are
        cm.write_atomic(path, b"new")
    assert not isinstance(err.value, DiskFullError)


def test_write_atomic_mode_is_set_before_the_file_appears(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    cm.write_atomic(path, b"new", mode=0o600)
    assert os.stat(path).st_mode & 0o777 == 0o600 and path.read_bytes() == b"new"


IP2_NET = """name: "two"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip" top: "ip2"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } } }
"""


def test_copy_from_a_file_cut_at_a_layer_boundary_names_the_layers_left_out(tmp_path, caplog):
    """The cut parses (it is a shorter NetParameter); Caffe would copy 'ip' and say nothing about
    'ip2'. copy_from returns the layers left out and, unless told not to, logs one line."""
    from poseidon.engine.net import Net
    model = tmp_path / "two.prototxt"
    model.write_text(IP2_NET)
    Net(str(model), "TEST").save(str(tmp_path / "full.caffemodel"))
    full = cm.read_net_proto(tmp_path / "full.caffemodel")
    cut = caffe_pb2.NetParameter(name=full.name)
    cut.layer.extend(full.layer[:2])
    raw = (tmp_path / "full.caffemodel").read_bytes()
    assert raw.startswith(cut.SerializeToString())         # a cut of the bytes, at 'ip2'
    (tmp_path / "cut.caffemodel").write_bytes(cut.SerializeToString())
    (tmp_path / "empty.caffemodel").write_bytes(b"")
    net = Net(str(model), "TEST")
    with caplog.at_level("WARNING", logger="poseidon"):
        assert net.copy_from(str(tmp_path / "cut.caffemodel")) == ["ip2"]
        assert net.copy_from(str(tmp_path / "empty.caffemodel")) == ["ip", "ip2"]
        assert net.copy_from(str(tmp_path / "full.caffemodel")) == []
        assert net.copy_from(str(tmp_path / "cut.caffemodel"), report_missing=False) == ["ip2"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "cut.caffemodel: has no weights for layer(s) 'ip2' of net 'two'" in lines[0]
    assert "empty.caffemodel: has no weights for layer(s) 'ip', 'ip2'" in lines[1]


# --------------------------------------------------------------------------- HDF5

def test_hdf5_net_and_solverstate_roundtrip(tmp_path):
    h5py = pytest.importorskip("h5py", reason="h5py not installed")
    blobs = {"conv1": [rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
                       rng.standard_normal(4).astype(np.float32)],
             "ip": [rng.standard_normal((10, 12)).astype(np.float32)] * 11}
    path = tmp_path / "w.caffemodel.h5"
    cm.write_net_hdf5(path, blobs)
    with h5py.File(path, "r") as f:          # Caffe's layout
        assert f["data/conv1/1"].shape == (4,) and f["data/ip/10"].dtype == np.float32
    back = cm.read_net_hdf5(path)
    assert back.keys() == blobs.keys()
    for k in blobs:                          # "10" sorts after "9", not after "1"
        assert len(back[k]) == len(blobs[k])
        for a, b in zip(blobs[k], back[k]):
            np.testing.assert_array_equal(a, b)

    hist = [rng.standard_normal((2, 2)).astype(np.float32)]
    spath = tmp_path / "s.solverstate.h5"
    cm.write_solverstate_hdf5(spath, 7, "w.caffemodel.h5", hist, current_step=1)
    with h5py.File(spath, "r") as f:
        assert {"iter", "learned_net", "current_step", "history"} <= set(f.keys())
    st = cm.read_solverstate_hdf5(spath)
    assert (st.iter, st.learned_net, st.current_step) == (7, "w.caffemodel.h5", 1)
    np.testing.assert_array_equal(st.history[0], hist[0])
    assert sorted(os.listdir(tmp_path)) == ["s.solverstate.h5", "w.caffemodel.h5"]


# --------------------------------------------------------------------------- Datum

def test_datum_uint8_roundtrip():
    img = rng.integers(0, 256, (3, 4, 5), dtype=np.uint8)
    d = caffe_pb2.Datum.FromString(array_to_datum(img, label=7).SerializeToString())
    assert (d.channels, d.height, d.width, d.label, len(d.data)) == (3, 4, 5, 7, 60)
    out = datum_to_array(d)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, img)


def test_datum_float_roundtrip():
    x = rng.standard_normal((2, 3, 3)).astype(np.float32)
    d = array_to_datum(x, label=1)
    assert not d.data and len(d.float_data) == 18
    np.testing.assert_array_equal(datum_to_array(d), x)
    np.testing.assert_array_equal(datum_to_array(array_to_datum(x[0])), x[:1])   # (H, W)


def test_datum_encoded_png_is_bgr():
    Image = pytest.importorskip("PIL.Image", reason="Pillow not installed")
    rgb = rng.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG")
    d = caffe_pb2.Datum(data=buf.getvalue(), label=3, encoded=True)
    out = datum_to_array(d)
    assert out.shape == (3, 4, 6) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, rgb[:, :, ::-1].transpose(2, 0, 1))   # BGR, CHW
    assert datum_to_array(d, color=False).shape == (1, 4, 6)

    gray = io.BytesIO()
    Image.fromarray(rgb[:, :, 0], "L").save(gray, format="PNG")
    g = datum_to_array(caffe_pb2.Datum(data=gray.getvalue(), encoded=True))
    np.testing.assert_array_equal(g, rgb[None, :, :, 0])
    assert datum_to_array(caffe_pb2.Datum(data=gray.getvalue(), encoded=True),
                          color=True).shape == (3, 4, 6)


@pytest.mark.parametrize("datum, message", [
    (caffe_pb2.Datum(channels=3, height=2, width=2, data=b"\0" * 11), "11 bytes"),
    (caffe_pb2.Datum(channels=1, height=2, width=2, float_data=[1, 2, 3]), "3 values"),
    (caffe_pb2.Datum(channels=1, height=2, width=2), "no data"),
    (caffe_pb2.Datum(channels=0, height=2, width=2, data=b"\0"), "invalid shape"),
    (caffe_pb2.Datum(encoded=True, data=b"definitely not a png"), "not a readable image"),
])
def test_corrupt_datum_raises(datum, message):
    if datum.encoded:
        pytest.importorskip("PIL", reason="Pillow not installed")
    with pytest.raises(ValueError, match=message):
        datum_to_array(datum)
