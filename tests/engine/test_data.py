"""LMDB storage, sharded reading, the Data layer and the data-set converters."""
import io
import json
import os
import pickle
import tarfile
import warnings

import numpy
import pytest

from poseidon.engine import rng
from poseidon.engine.blob import Blob
from poseidon.engine.errors import DataError
from poseidon.engine.io.caffemodel import write_binaryproto
from poseidon.engine.io.datasets import (cifar10_to_lmdb, compute_mean, digits_arrays, images_to_lmdb,
                                make_digits_lmdb)
from poseidon.engine.io.datum import array_to_datum, datum_to_array
from poseidon.engine.io.lmdb_store import ShardedReader, iter_records, write_lmdb
from poseidon.engine.layer import TEST, TRAIN
from poseidon.engine.proto import caffe_pb2
from tests.engine.harness import make_layer


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def datum_bytes(arr, label):
    return array_to_datum(arr, label).SerializeToString()


def write_images(path, images, labels=None, shards=1):
    labels = range(len(images)) if labels is None else labels
    return write_lmdb(str(path), (datum_bytes(a, l) for a, l in zip(images, labels)),
                      shards=shards)


def labelled_db(path, n, shards=1, shape=(1, 2, 2)):
    """n records whose label is their index (and whose pixels hold it too)."""
    images = [numpy.full(shape, i % 256, numpy.uint8) for i in range(n)]
    write_images(path, images, shards=shards)
    return str(path)


def label_of(value):
    return caffe_pb2.Datum.FromString(value).label


def data_layer(source, batch, phase=TEST, extra="", transform="", shard=None, prefetch=2):
    layer = make_layer(f'type: "Data" top: "data" top: "label" '
                       f'data_param {{ source: "{source}" batch_size: {batch} backend: LMDB '
                       f'prefetch: {prefetch} {extra} }} '
                       f'transform_param {{ {transform} }}', phase=phase, dtype=numpy.float64)
    if shard is not None:
        layer.shard = shard
    top = [Blob((), numpy.float64), Blob((), numpy.float64)]
    layer.setup([], top)
    return layer, top


def forward(layer, top):
    layer.reshape([], top)
    layer.forward([], top)
    return top[0].data.copy(), top[1].data.copy()


@pytest.fixture(autouse=True)
def _seeded():
    rng.seed(1234)


# ------------------------------------------------------------------------------------------------
# writing and reading
# ------------------------------------------------------------------------------------------------
def test_write_and_read_back_uint8_and_float(tmp_path):
    r = numpy.random.default_rng(0)
    u8 = [r.integers(0, 256, (3, 4, 5), dtype=numpy.uint8) for _ in range(5)]
    f32 = [r.standard_normal((2, 3, 3)).astype(numpy.float32) for _ in range(3)]
    records = [array_to_datum(a, i) for i, a in enumerate(u8 + f32)]   # Datum messages too
    path = str(tmp_path / "db")
    assert write_lmdb(path, records, map_size=1 << 12) == 8               # the map has to grow
    assert os.path.isfile(os.path.join(path, "data.mdb"))
    got = list(iter_records(path))
    assert [k for k, _ in got] == [b"%08d" % i for i in range(8)]
    for (key, value), want in zip(got, u8 + f32):
        arr = datum_to_array(caffe_pb2.Datum.FromString(value))
        assert arr.dtype == want.dtype and numpy.array_equal(arr, want)
    # (key, value) pairs are kept as given and read in LMDB's sorted key order
    write_lmdb(str(tmp_path / "pairs"), [("b", b"2"), ("a", b"1"), (b"c", b"3")])
    assert list(iter_records(str(tmp_path / "pairs"))) == [(b"a", b"1"), (b"b", b"2"),
                                                           (b"c", b"3")]
    with pytest.raises(DataError, match="exists and is not empty"):
        write_lmdb(path, records)


def test_commit_every_and_failed_write_cleans_up(tmp_path):
    path = str(tmp_path / "big")
    assert write_lmdb(path, (b"x" * 10 for _ in range(2500))) == 2500
    assert len(ShardedReader(path)) == 2500

    def broken():
        yield b"ok"
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        write_lmdb(str(tmp_path / "broken"), broken())
    assert not os.path.exists(tmp_path / "broken")


# ------------------------------------------------------------------------------------------------
# sharding
# ------------------------------------------------------------------------------------------------
def check_identity(source, n, k, iterations):
    """n readers with batch k == one reader with batch n*k, slot r + j*n = reader r's j-th."""
    single = ShardedReader(source)
    readers = [ShardedReader(source, r, n) for r in range(n)]
    for _ in range(iterations):
        big = [label_of(v) for _, v in single.read(n * k)]
        parts = [[label_of(v) for _, v in rd.read(k)] for rd in readers]
        interleaved = [parts[s % n][s // n] for s in range(n * k)]
        assert interleaved == big
        assert sorted(sum(parts, [])) == sorted(big)


@pytest.mark.parametrize("n,k", [(2, 4), (3, 4), (4, 1)])
def test_sharding_identity_one_db(tmp_path, n, k):
    source = labelled_db(tmp_path / "db", 23)          # 23: not a multiple of n, wraps unevenly
    check_identity(source, n, k, iterations=12)         # 12 * n * k records: several wrap-arounds
    assert sum(len(ShardedReader(source, r, n)) for r in range(n)) == 23
    reader = ShardedReader(source, 1, 3)
    assert [label_of(v) for _, v in reader.read(9)] == [1, 4, 7, 10, 13, 16, 19, 22, 2]


@pytest.mark.parametrize("n,shards", [(2, 4), (4, 4), (3, 6)])
def test_sharding_identity_folder(tmp_path, n, shards):
    source = labelled_db(tmp_path / "folder", 24, shards=shards)
    assert sorted(os.listdir(source)) == sorted(os.listdir(source))[:shards]
    # one reader of the round-robin shards reads the original order, and wraps
    assert [label_of(v) for _, v in ShardedReader(source).read(30)] == \
        list(range(24)) + list(range(6))
    check_identity(source, n, k=5, iterations=10)
    assert [len(ShardedReader(source, r, n)) for r in range(n)] == [24 // n] * n


def test_shards_not_a_multiple_and_too_few(tmp_path):
    source = labelled_db(tmp_path / "folder", 9, shards=3)
    with pytest.warns(UserWarning, match="not a multiple"):
        readers = [ShardedReader(source, r, 2) for r in range(2)]
    assert [len(r) for r in readers] == [6, 3]          # reader 0 takes shards 0 and 2
    assert [label_of(v) for _, v in readers[0].read(7)] == [0, 2, 3, 5, 6, 8, 0]
    with pytest.raises(DataError, match="3 shard database.*4 readers"):
        ShardedReader(source, 0, 4)


@pytest.mark.parametrize("shards", [1, 3])
def test_reader_cursor_round_trip(tmp_path, shards):
    source = labelled_db(tmp_path / "db", 10, shards=shards)
    reader = ShardedReader(source, 0, 1)
    reader.read(7)
    saved = json.loads(json.dumps(reader.cursor()))
    ahead = reader.read(12)                              # runs over the wrap-around
    other = ShardedReader(source, 0, 1)
    other.set_cursor(saved)
    assert other.read(12) == ahead
    for entry in ("keys", "key"):                        # without stored keys: stepping
        saved.pop(entry, None)
    other.set_cursor(saved)
    assert other.read(12) == ahead
    with pytest.raises(DataError, match="does not fit"):
        ShardedReader(source, 0, 2 if shards == 1 else 3).set_cursor(saved)


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------
def test_source_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist: create it with `poseidon data"):
        ShardedReader(str(tmp_path / "nope"))
    write_lmdb(str(tmp_path / "empty"), [])
    with pytest.raises(DataError, match="is empty"):
        ShardedReader(str(tmp_path / "empty"))
    leveldb = tmp_path / "leveldb"
    leveldb.mkdir()
    for name in ("CURRENT", "LOCK", "LOG", "MANIFEST-000001", "000003.ldb"):
        (leveldb / name).write_bytes(b"")
    with pytest.raises(DataError, match="LevelDB is not supported.*convert it to LMDB"):
        ShardedReader(str(leveldb))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "readme.txt").write_text("hi")
    with pytest.raises(DataError, match="not an LMDB database"):
        ShardedReader(str(tmp_path / "plain"))


def test_layer_backend_errors(tmp_path):
    with pytest.raises(DataError, match="layer 'under_test'.*does not exist"):
        data_layer(str(tmp_path / "nope"), 2)
    source = labelled_db(tmp_path / "db", 4)
    with pytest.raises(DataError, match="LEVELDB.*LevelDB is not supported"):
        make_layer(f'type: "Data" top: "data" data_param {{ source: "{source}" batch_size: 2 '
                   f'backend: LEVELDB }}').setup([], [Blob()])
    # no backend given: an LMDB source is read as LMDB
    layer = make_layer(f'type: "Data" top: "data" top: "label" '
                       f'data_param {{ source: "{source}" batch_size: 2 }}')
    top = [Blob(), Blob()]
    layer.setup([], top)
    assert forward(layer, top)[1].tolist() == [0, 1]
    layer.shutdown()


def test_corrupt_records_name_the_key(tmp_path):
    good = datum_bytes(numpy.zeros((1, 2, 2), numpy.uint8), 0)
    short = caffe_pb2.Datum(channels=1, height=2, width=2, data=b"abc").SerializeToString()
    write_lmdb(str(tmp_path / "a"), [("k0", good), ("k1", b"\x0a\xff\xff")])
    write_lmdb(str(tmp_path / "b"), [("k0", good), ("k1", short)])
    write_lmdb(str(tmp_path / "c"), [("k0", good),
                                     ("k1", datum_bytes(numpy.zeros((1, 3, 2), numpy.uint8), 1))])
    for name, pattern in (("a", "'k1'.*not a valid Datum"), ("b", "'k1'.*corrupt Datum"),
                          ("c", r"'k1'.*\(1, 3, 2\).*'k0'.*\(1, 2, 2\)")):
        layer, top = data_layer(str(tmp_path / name), 2)
        with pytest.raises(DataError, match=pattern):
            forward(layer, top)
        with pytest.raises(DataError):               # stays failed, does not hang
            forward(layer, top)
        layer.shutdown()


# ------------------------------------------------------------------------------------------------
# the Data layer
# ------------------------------------------------------------------------------------------------
def reference(images, mean, scale, crop, offsets, flips):
    """Caffe's per-pixel loops: source pixel (crop offset) - mean at the source pixel, * scale,
    written to the (mirrored) output position."""
    out = []
    for img, (ho, wo), flip in zip(images, offsets, flips):
        c, h, w = img.shape
        res = numpy.zeros((c, crop, crop))
        for ch in range(c):
            for y in range(crop):
                for x in range(crop):
                    m = mean[ch, ho + y, wo + x] if mean.ndim == 3 else mean[ch]
                    xo = crop - 1 - x if flip else x
                    res[ch, y, xo] = (float(img[ch, ho + y, wo + x]) - m) * scale
        out.append(res)
    return numpy.array(out)


@pytest.fixture
def images_db(tmp_path):
    r = numpy.random.default_rng(5)
    images = r.integers(0, 256, (6, 3, 6, 7), dtype=numpy.uint8)
    source = str(tmp_path / "img")
    write_images(source, images)
    return source, images


def test_test_phase_center_crop_mean_file_scale(tmp_path, images_db):
    source, images = images_db
    mean = numpy.random.default_rng(6).uniform(0, 255, (3, 6, 7)).astype(numpy.float32)
    mean_file = str(tmp_path / "mean.binaryproto")
    write_binaryproto(mean, mean_file)
    layer, top = data_layer(source, 4, TEST, transform=f'crop_size: 4 scale: 0.5 '
                                                       f'mean_file: "{mean_file}"')
    assert top[0].shape == (4, 3, 4, 4) and top[1].shape == (4,)
    data, labels = forward(layer, top)
    want = reference(images[:4], mean.astype(numpy.float64), 0.5, 4, [(1, 1)] * 4, [False] * 4)
    numpy.testing.assert_allclose(data, want, rtol=1e-6, atol=1e-4)
    assert labels.tolist() == [0, 1, 2, 3]
    data, labels = forward(layer, top)                   # wraps: records 4, 5, 0, 1
    assert labels.tolist() == [4, 5, 0, 1]
    layer.shutdown()
    # the legacy data_param fields mean the same
    legacy, top2 = data_layer(source, 4, TEST, extra=f'crop_size: 4 scale: 0.5 '
                                                     f'mean_file: "{mean_file}"')
    numpy.testing.assert_allclose(forward(legacy, top2)[0], want, rtol=1e-6, atol=1e-4)
    legacy.shutdown()


def test_mean_value_and_mirror(images_db):
    source, images = images_db
    layer, top = data_layer(source, 6, TEST, prefetch=0,
                            transform="mean_value: 10 mean_value: 20 mean_value: 30 "
                                      "scale: 2 mirror: true")
    data, _ = forward(layer, top)
    mean = numpy.array([10.0, 20.0, 30.0])
    plain = (images.astype(numpy.float64) - mean[:, None, None]) * 2.0
    flips = [numpy.array_equal(d, p[..., ::-1]) for d, p in zip(data, plain)]
    keeps = [numpy.array_equal(d, p) for d, p in zip(data, plain)]
    assert all(f or k for f, k in zip(flips, keeps))
    layer.shutdown()
    # mirror happens in TEST too: over a few batches both outcomes occur
    seen = set()
    layer, top = data_layer(source, 6, TEST, transform="mirror: true")
    for _ in range(4):
        d, _ = forward(layer, top)
        seen.update(numpy.array_equal(x, im[..., ::-1]) for x, im in zip(d, images))
    assert seen == {True, False}
    layer.shutdown()
    # a single mean_value applies to every channel
    layer, top = data_layer(source, 2, TEST, transform="mean_value: 100")
    numpy.testing.assert_array_equal(forward(layer, top)[0], images[:2] - 100.0)
    layer.shutdown()


def test_float_data_records(tmp_path):
    arrays = numpy.random.default_rng(1).standard_normal((4, 2, 3, 3)).astype(numpy.float32)
    write_images(tmp_path / "f", arrays)
    layer, top = data_layer(str(tmp_path / "f"), 4, TEST, transform="scale: 3")
    numpy.testing.assert_allclose(forward(layer, top)[0], arrays * numpy.float32(3), rtol=1e-6)
    layer.shutdown()


def crops_of(out, images, crop):
    """(h, w, flipped) offsets explaining each output sample."""
    found = []
    for o, img in zip(out, images):
        hits = [(h, w, f) for h in range(img.shape[1] - crop + 1)
                for w in range(img.shape[2] - crop + 1) for f in (False, True)
                if numpy.array_equal(o, (img[:, h:h + crop, w:w + crop][..., ::-1] if f
                                         else img[:, h:h + crop, w:w + crop]))]
        assert hits, "an output sample is no crop of its record"
        found.append(hits[0])
    return found


def test_train_random_crops_are_deterministic(images_db):
    source, images = images_db

    def run(seed):
        rng.seed(seed)
        layer, top = data_layer(source, 3, TRAIN, transform="crop_size: 3 mirror: true",
                                prefetch=3)
        out = [forward(layer, top)[0] for _ in range(4)]
        layer.shutdown()
        return out

    a, b, c = run(7), run(7), run(8)
    assert all(numpy.array_equal(x, y) for x, y in zip(a, b))
    assert not all(numpy.array_equal(x, y) for x, y in zip(a, c))
    batch_images = [images[[(3 * i + j) % 6 for j in range(3)]] for i in range(4)]
    offsets = sum((crops_of(o, im, 3) for o, im in zip(a, batch_images)), [])
    assert len({(h, w) for h, w, _ in offsets}) > 1          # random, not all the centre


def test_layer_cursor_restores_the_next_batches(images_db):
    source, _ = images_db
    layer, top = data_layer(source, 4, TRAIN, transform="crop_size: 3 mirror: true", prefetch=3)
    forward(layer, top)
    forward(layer, top)
    import time
    time.sleep(0.05)                                      # let the prefetcher run ahead
    cursor = json.loads(json.dumps(layer.get_cursor()))
    assert cursor["reader"]["position"] == 8 % 6            # consumed, not prefetched
    ahead = [forward(layer, top) for _ in range(3)]
    layer.set_cursor(cursor)
    again = [forward(layer, top) for _ in range(3)]
    rng.seed(999)                                           # another layer, another seed
    other, top2 = data_layer(source, 4, TRAIN, transform="crop_size: 3 mirror: true")
    other.set_cursor(cursor)
    third = [forward(other, top2) for _ in range(3)]
    for (d1, l1), (d2, l2), (d3, l3) in zip(ahead, again, third):
        assert numpy.array_equal(d1, d2) and numpy.array_equal(d1, d3)
        assert numpy.array_equal(l1, l2) and numpy.array_equal(l1, l3)
    for lay in (layer, other):
        thread = lay._thread
        lay.shutdown()
        assert not thread.is_alive()


def test_layer_reads_its_shard(tmp_path):
    source = labelled_db(tmp_path / "db", 10)
    layer, top = data_layer(source, 3, TRAIN, shard=(1, 2))
    assert forward(layer, top)[1].tolist() == [1, 3, 5]
    assert forward(layer, top)[1].tolist() == [7, 9, 1]
    layer.shutdown()


# ------------------------------------------------------------------------------------------------
# data sets
# ------------------------------------------------------------------------------------------------
def read_all(source):
    out = [caffe_pb2.Datum.FromString(v) for _, v in iter_records(source)]
    return numpy.array([datum_to_array(d) for d in out]), numpy.array([d.label for d in out])


def test_digits_demo_set(tmp_path):
    info = make_digits_lmdb(str(tmp_path / "digits"))
    train_x, train_y = read_all(info["train"])
    test_x, test_y = read_all(info["test"])
    assert train_x.shape[1:] == test_x.shape[1:] == (3, 32, 32)
    assert train_x.dtype == numpy.uint8 and train_x.max() == 255
    assert len(train_y) + len(test_y) == 1797 and len(test_y) == info["test_count"] == 359
    assert set(train_y) == set(test_y) == set(range(10))
    assert numpy.array_equal(train_x[:, 0], train_x[:, 2])          # grey replicated
    assert numpy.array_equal(train_x[:, :, ::4, ::4].repeat(4, 2).repeat(4, 3), train_x)
    train_set = {x.tobytes() for x in train_x}
    assert not any(x.tobytes() in train_set for x in test_x)        # disjoint
    # shards: same records, same single-reader order
    sharded = make_digits_lmdb(str(tmp_path / "sharded"), shards=3)
    assert len(os.listdir(sharded["train"])) == 3
    sx, sy = read_all(sharded["train"])
    assert numpy.array_equal(sx, train_x) and numpy.array_equal(sy, train_y)
    (tx, ty), _ = digits_arrays()
    assert numpy.array_equal(tx, train_x)


def fake_cifar_batches(r, sizes=(3, 2, 2, 2, 2, 4)):
    return [(r.integers(0, 256, (n, 3072), dtype=numpy.uint8), r.integers(0, 10, n).tolist())
            for n in sizes]


def test_cifar10_python_archive(tmp_path):
    batches = fake_cifar_batches(numpy.random.default_rng(2))
    archive = tmp_path / "cifar-10-python.tar.gz"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    with tarfile.open(archive, "w:gz") as tar:
        for name, (data, labels) in zip(names, batches):
            blob = pickle.dumps({b"batch_label": name.encode(), b"labels": labels,
                                 b"data": data, b"filenames": [b"x.png"] * len(labels)},
                                protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    out = cifar10_to_lmdb(str(archive), str(tmp_path / "out"))
    assert out["train_count"] == 11 and out["test_count"] == 4
    assert out["train"].endswith("cifar10_train_lmdb")
    keys = [k for k, _ in iter_records(out["train"])]
    assert keys == [b"%05d" % i for i in range(11)]
    x, y = read_all(out["train"])
    want = numpy.concatenate([b[0] for b in batches[:5]]).reshape(-1, 3, 32, 32)  # RGB planes
    assert numpy.array_equal(x, want) and y.tolist() == sum((b[1] for b in batches[:5]), [])
    x, y = read_all(out["test"])
    assert numpy.array_equal(x, batches[5][0].reshape(-1, 3, 32, 32))
    # the binary format, extracted
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    for name, (data, labels) in zip(names, batches):
        rec = numpy.concatenate([numpy.array(labels, numpy.uint8)[:, None], data], axis=1)
        (folder / f"{name}.bin").write_bytes(rec.tobytes())
    out2 = cifar10_to_lmdb(str(tmp_path), str(tmp_path / "out2"), shards=2)
    x2, y2 = read_all(out2["train"])
    assert numpy.array_equal(x2, want)
    with pytest.raises(DataError, match="missing"):
        cifar10_to_lmdb(str(tmp_path / "out"), str(tmp_path / "out3"))


def cifar_folder(folder, first_batch):
    """A CIFAR-10 python folder: data_batch_1 holds `first_batch` (bytes), the others one image."""
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(first_batch)
    for name in [f"data_batch_{i}" for i in range(2, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps(
            {b"labels": [1], b"data": numpy.zeros((1, 3072), numpy.uint8)}, protocol=2))
    return folder


@pytest.mark.parametrize("protocol, numpy1", [(2, True), (2, False), (4, False),
                                              (pickle.HIGHEST_PROTOCOL, False)])
def test_cifar10_batches_as_pickled_by_python_and_numpy_versions(tmp_path, protocol, numpy1):
    """The globals a real batch names pass the allow-list: the archive's own (written by numpy 1,
    numpy.core.multiarray._reconstruct) and what Python 3 and numpy 2 write when re-pickling."""
    data = numpy.arange(2 * 3072, dtype=numpy.uint8).reshape(2, 3072)
    blob = pickle.dumps({b"batch_label": b"x", b"labels": [3, 4], b"data": data,
                         b"filenames": [b"a.png", b"b.png"]}, protocol=protocol)
    if numpy1:          # GLOBAL opcodes name the module in text: as numpy 1 wrote it
        assert b"numpy._core.multiarray" in blob
        blob = blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    out = cifar10_to_lmdb(str(cifar_folder(tmp_path / "cifar", blob)), str(tmp_path / "out"))
    x, y = read_all(out["train"])
    assert numpy.array_equal(x[:2], data.reshape(2, 3, 32, 32)) and y[:2].tolist() == [3, 4]


@pytest.mark.parametrize("module, name", [("numpy.f2py.__main__", "ndarray"),
                                          ("numpy.testing", "dtype"), ("os", "system"),
                                          ("numpy", "load")])
def test_cifar10_batch_naming_another_global_is_refused_unloaded(tmp_path, module, name, capfd):
    """Only the full names a batch needs are allowed: numpy.f2py.__main__ runs f2py's command
    line when merely imported, so it must be refused before anything is imported."""
    import sys
    crafted = f"c{module}\n{name}\n.".encode()
    folder = cifar_folder(tmp_path / "cifar", crafted)
    was_loaded = module in sys.modules
    with pytest.raises(DataError, match=rf"data_batch_1 \(in {folder}\) names the Python global "
                                        rf"{module}\.{name},"):
        cifar10_to_lmdb(str(folder), str(tmp_path / "out"))
    assert (module in sys.modules) == was_loaded
    assert capfd.readouterr().out == ""


def test_images_to_lmdb(tmp_path):
    from PIL import Image
    root = tmp_path / "imgs"
    (root / "sub").mkdir(parents=True)
    r = numpy.random.default_rng(3)
    pics = {"sub/a b.png": r.integers(0, 256, (5, 6, 3), dtype=numpy.uint8),
            "c.png": r.integers(0, 256, (5, 6, 3), dtype=numpy.uint8),
            "sub/d.png": r.integers(0, 256, (4, 4, 3), dtype=numpy.uint8)}
    for rel, arr in pics.items():
        Image.fromarray(arr).save(root / rel)
    listing = tmp_path / "list.txt"
    listing.write_text("sub/a b.png 3\nc.png 1\n\nsub/d.png 7\n")
    res = images_to_lmdb(f"{root}/", str(listing), str(tmp_path / "out"))
    assert res["count"] == 3
    got = [(k, caffe_pb2.Datum.FromString(v)) for k, v in iter_records(res["path"])]
    assert [k for k, _ in got] == [b"00000000_sub/a b.png", b"00000001_c.png",
                                   b"00000002_sub/d.png"]
    for (_, d), (rel, arr), label in zip(got, pics.items(), (3, 1, 7)):
        assert d.label == label
        assert numpy.array_equal(datum_to_array(d), arr[:, :, ::-1].transpose(2, 0, 1))  # BGR
    # resize, gray, shuffle, encoded
    res = images_to_lmdb(f"{root}/", str(listing), str(tmp_path / "gray"), resize=(8, 9),
                         gray=True, shuffle=True, seed=1)
    x, _ = read_all(res["path"])
    assert x.shape == (3, 1, 8, 9)
    res = images_to_lmdb(f"{root}/", str(listing), str(tmp_path / "enc"), encoded=True)
    datums = [caffe_pb2.Datum.FromString(v) for _, v in iter_records(res["path"])]
    assert all(d.encoded for d in datums)
    assert numpy.array_equal(datum_to_array(datums[1]), pics["c.png"][:, :, ::-1].transpose(2, 0, 1))
    # the Data layer decodes encoded records (one shape per batch)
    layer, top = data_layer(res["path"], 2, TEST)
    numpy.testing.assert_array_equal(forward(layer, top)[0][1],
                                     pics["c.png"][:, :, ::-1].transpose(2, 0, 1))
    layer.shutdown()
    listing.write_text("sub/a b.png 3\nmissing.png 2\n")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        res = images_to_lmdb(f"{root}/", str(listing), str(tmp_path / "skip"))
    assert res["count"] == 1 and res["skipped"] == ["missing.png"]


def test_compute_mean(tmp_path):
    images = numpy.random.default_rng(4).integers(0, 256, (7, 3, 4, 5), dtype=numpy.uint8)
    write_images(tmp_path / "db", images, shards=2)
    mean = compute_mean(str(tmp_path / "db"), chunk=3)
    assert mean.dtype == numpy.float32 and mean.shape == (3, 4, 5)
    numpy.testing.assert_allclose(mean, images.mean(axis=0), rtol=1e-6)


def test_layer_parameter_errors_and_rand_skip(tmp_path, images_db):
    from poseidon.engine.errors import LayerError
    source, _ = images_db
    with pytest.raises(LayerError, match="crop_size 8 is larger"):
        data_layer(source, 2, transform="crop_size: 8")
    with pytest.raises(LayerError, match="2 mean_value entries for 3-channel"):
        data_layer(source, 2, transform="mean_value: 1 mean_value: 2")
    with pytest.raises(LayerError, match="both mean_file and mean_value"):
        data_layer(source, 2, transform='mean_value: 1 mean_file: "m"')
    write_binaryproto(numpy.zeros((3, 5, 5), numpy.float32), str(tmp_path / "m5"))
    with pytest.raises(DataError, match=r"mean of shape \(3, 5, 5\).*\(3, 6, 7\)"):
        data_layer(source, 2, transform=f'mean_file: "{tmp_path / "m5"}"')
    with pytest.raises(DataError, match="mean_file .* does not exist"):
        data_layer(source, 2, transform=f'mean_file: "{tmp_path / "none"}"')
    firsts = set()
    for seed in range(8):
        rng.seed(seed)
        layer, top = data_layer(source, 1, extra="rand_skip: 5")
        firsts.add(int(forward(layer, top)[1][0]))
        layer.shutdown()
    assert firsts <= set(range(5)) and len(firsts) > 1
