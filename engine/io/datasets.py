"""Making Caffe-compatible LMDB data sets: the embedded digits demo, CIFAR-10, image lists, means.

Every writer here produces what Caffe's own tools produce (caffe-facts (e), (h)): serialized Datum
values, uint8 C x H x W planes, committed every 1000 records, and with `shards` > 1 a folder of
shard databases with records dealt round-robin (see engine.io.lmdb_store).
"""
import io
import os
import pickle
import tarfile
import warnings

import numpy

from ..errors import DataError
from .batch import decode_batch
from .datum import array_to_datum
from .lmdb_store import ShardedReader, write_lmdb


def _records(images, labels, key_format):
    for i, (img, label) in enumerate(zip(images, labels)):
        yield key_format % i, array_to_datum(img, int(label)).SerializeToString()


# ------------------------------------------------------------------------------------------------
# the embedded demo set
# ------------------------------------------------------------------------------------------------
def digits_arrays(test_fraction=0.2, seed=0):
    """scikit-learn's 1797 handwritten digits as 3 x 32 x 32 uint8 images, split train/test.

    Each 8x8 image (values 0..16) is upsampled x4 (nearest neighbour), scaled by 255/16 (rounded)
    and replicated to 3 channels. The split is a fixed permutation from `seed`; both parts keep the
    permuted (mixed) order. Returns ((train_x, train_y), (test_x, test_y)).
    """
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = numpy.asarray(digits.images, numpy.float64)            # (1797, 8, 8), 0..16
    labels = numpy.asarray(digits.target, numpy.int64)
    big = images.repeat(4, axis=1).repeat(4, axis=2)                  # (N, 32, 32)
    big = numpy.clip(numpy.rint(big * (255.0 / 16.0)), 0, 255).astype(numpy.uint8)
    big = numpy.repeat(big[:, None], 3, axis=1)                       # (N, 3, 32, 32)
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    order = numpy.random.default_rng(seed).permutation(len(labels))
    n_test = int(round(len(labels) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return (big[train], labels[train]), (big[test], labels[test])


def make_digits_lmdb(out_dir, shards=1, test_fraction=0.2, seed=0):
    """Write the digits demo set as out_dir/train and out_dir/test (LMDBs, or shard folders).

    Keys %08d; returns {"train": path, "test": path, "train_count": n, "test_count": m,
    "shape": (3, 32, 32), "classes": 10}.
    """
    (tx, ty), (vx, vy) = digits_arrays(test_fraction, seed)
    os.makedirs(out_dir, exist_ok=True)
    out = {}
    for part, x, y in (("train", tx, ty), ("test", vx, vy)):
        path = os.path.join(out_dir, part)
        out[part] = path
        out[f"{part}_count"] = write_lmdb(path, _records(x, y, "%08d"), shards=shards)
    out["shape"], out["classes"] = (3, 32, 32), 10
    return out


# ------------------------------------------------------------------------------------------------
# CIFAR-10
# ------------------------------------------------------------------------------------------------
class _RefusedGlobal(pickle.UnpicklingError):
    """A batch names a global outside the allow-list (a crafted file, not CIFAR-10's)."""


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles only plain data and numpy arrays (CIFAR-10's batches), nothing executable.

    A pickle can name any importable callable; the few a CIFAR-10 batch needs are allowed by
    full name. Matching on the package alone would let a file name any function of any numpy
    submodule (f2py's command line among them)."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),    # arrays, as the archive (numpy 1) wrote them
        ("numpy._core.multiarray", "_reconstruct"),   # the same, re-pickled under numpy 2
        ("numpy.core.numeric", "_frombuffer"),        # arrays in pickle protocol 5
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),                        # bytes in Python 3's protocol 2
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise _RefusedGlobal(f"{module}.{name}")


_CIFAR_PY = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
_CIFAR_BIN = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def _cifar_files(archive_path):
    """{basename: bytes} of the CIFAR-10 batch files in a .tar.gz or a folder, and the format."""
    found = {}
    wanted = set(_CIFAR_PY) | set(_CIFAR_BIN)
    if os.path.isfile(archive_path):
        try:
            with tarfile.open(archive_path, "r:*") as tar:
                for member in tar.getmembers():
                    base = os.path.basename(member.name)
                    if member.isfile() and base in wanted:
                        found[base] = tar.extractfile(member).read()
        except tarfile.TarError as e:
            raise DataError(f"'{archive_path}' is not a CIFAR-10 archive ({e}): give "
                            f"cifar-10-python.tar.gz, cifar-10-binary.tar.gz or their extracted "
                            f"folder") from None
    elif os.path.isdir(archive_path):
        for dirpath, _, files in os.walk(archive_path):
            for base in files:
                if base in wanted and base not in found:
                    with open(os.path.join(dirpath, base), "rb") as f:
                        found[base] = f.read()
    else:
        raise DataError(f"CIFAR-10 archive '{archive_path}' does not exist: download "
                        f"cifar-10-python.tar.gz or cifar-10-binary.tar.gz from "
                        f"https://www.cs.toronto.edu/~kriz/cifar.html and give its path")
    for names, kind in ((_CIFAR_PY, "python"), (_CIFAR_BIN, "binary")):
        if all(n in found for n in names):
            return {n: found[n] for n in names}, kind
    missing_py = [n for n in _CIFAR_PY if n not in found]
    missing_bin = [n for n in _CIFAR_BIN if n not in found]
    missing = missing_bin if len(missing_bin) < len(missing_py) else missing_py
    raise DataError(f"'{archive_path}' is not a complete CIFAR-10 python or binary archive: "
                    f"missing {', '.join(missing)}")


def _cifar_batch(name, blob, kind):
    """(images uint8 (n, 3, 32, 32) RGB planes, labels) of one batch file."""
    if kind == "binary":
        if len(blob) % 3073:
            raise DataError(f"CIFAR-10 file {name} has {len(blob)} bytes, not a multiple of the "
                            f"3073-byte record (label + 3x32x32): the archive is damaged")
        rec = numpy.frombuffer(blob, numpy.uint8).reshape(-1, 3073)
        return rec[:, 1:].reshape(-1, 3, 32, 32), rec[:, 0].astype(numpy.int64)
    try:
        d = _ArrayUnpickler(io.BytesIO(blob), encoding="bytes").load()
        data = numpy.asarray(d[b"data"] if b"data" in d else d["data"], numpy.uint8)
        labels = d[b"labels"] if b"labels" in d else d["labels"]
    except _RefusedGlobal as e:
        raise DataError(f"CIFAR-10 file {name} names the Python global {e}, which a CIFAR-10 "
                        f"batch never holds (only numpy arrays, lists and bytes), and was not "
                        f"loaded: use the archive from https://www.cs.toronto.edu/~kriz/cifar.html"
                        ) from None
    except Exception as e:
        raise DataError(f"CIFAR-10 file {name} is not a readable python batch ({e}): the archive "
                        f"is damaged") from None
    data = data.reshape(-1, 3, 32, 32)
    labels = numpy.asarray(labels, numpy.int64)
    if len(labels) != len(data):
        raise DataError(f"CIFAR-10 file {name} holds {len(data)} images but {len(labels)} labels")
    return data, labels


def cifar10_to_lmdb(archive_path, out_dir, shards=1):
    """Convert CIFAR-10 (python or binary format; .tar.gz or extracted folder) as Caffe does.

    Writes out_dir/cifar10_train_lmdb (data_batch_1..5, keys %05d = global index 0..49999) and
    out_dir/cifar10_test_lmdb (test_batch, keys 0..9999), the names Caffe's cifar10 example
    prototxts read; Datum 3 x 32 x 32 uint8 with the files' RGB planes (as convert_cifar_data).
    Returns {"train": path, "test": path, "train_count": n, "test_count": m}.
    """
    files, kind = _cifar_files(os.fspath(archive_path))
    names = _CIFAR_PY if kind == "python" else _CIFAR_BIN
    batches = [_cifar_batch(f"{n} (in {archive_path})", files[n], kind) for n in names]
    train, test = batches[:5], batches[5]
    os.makedirs(out_dir, exist_ok=True)
    out = {}
    for part, x, y in (("train", numpy.concatenate([b[0] for b in train]),
                        numpy.concatenate([b[1] for b in train])),
                       ("test", test[0], test[1])):
        path = os.path.join(out_dir, f"cifar10_{part}_lmdb")
        out[part] = path
        out[f"{part}_count"] = write_lmdb(path, _records(x, y, "%05d"), shards=shards)
    return out


# ------------------------------------------------------------------------------------------------
# image lists (convert_imageset)
# ------------------------------------------------------------------------------------------------
def read_image_list(list_file):
    """[(relative path, label)] from `relpath label` lines, split at the LAST space."""
    lines = []
    with open(list_file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            pos = line.rfind(" ")
            try:
                if pos < 0:
                    raise ValueError
                lines.append((line[:pos], int(line[pos + 1:])))
            except ValueError:
                raise DataError(f"{list_file}:{number}: expected `relative/path label`, got "
                                f"{line!r}") from None
    return lines


def load_image(path, height=0, width=0, gray=False):
    """An image file as OpenCV's imread gives it to Caffe: uint8 C x H x W, BGR (or 1-channel gray);
    resized (bilinear) to height x width when both are > 0."""
    from PIL import Image
    with Image.open(path) as img:
        img = img.convert("L" if gray else "RGB")
        if height > 0 and width > 0:
            img = img.resize((width, height), Image.BILINEAR)
        a = numpy.asarray(img)
    if gray:
        return numpy.ascontiguousarray(a[None])
    return numpy.ascontiguousarray(a[:, :, ::-1].transpose(2, 0, 1))


def _encoded_datum(path, label, height, width, gray):
    from PIL import Image
    from ..proto import caffe_pb2
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    with Image.open(path) as img:
        mode_ok = (img.mode == "L") if gray else (img.mode == "RGB")
        fmt = img.format or "PNG"
        if mode_ok and not (height > 0 and width > 0):
            with open(path, "rb") as f:        # as Caffe's ReadFileToDatum: the file's bytes
                data = f.read()
        else:                                  # decoded, converted/resized, re-encoded
            img = img.convert("L" if gray else "RGB")
            if height > 0 and width > 0:
                img = img.resize((width, height), Image.BILINEAR)
            buf = io.BytesIO()
            img.save(buf, format="JPEG" if ext in ("jpg", "jpeg") else fmt)
            data = buf.getvalue()
    return caffe_pb2.Datum(data=data, label=int(label), encoded=True)


def images_to_lmdb(root, list_file, out, shards=1, resize=(0, 0), gray=False, shuffle=False,
                   encoded=False, seed=0):
    """Caffe's convert_imageset: images listed in `list_file` (`relpath label`) under `root`.

    root is string-concatenated with each relpath (keep its trailing slash, as Caffe); resize =
    (height, width), applied (bilinear) only when both are > 0; gray loads 1 channel; shuffle
    permutes the list with numpy's Generator(seed) before writing; encoded stores the image file
    (re-encoded if converted or resized) with encoded=true. Raw images are stored BGR C x H x W
    like OpenCV. Key = "%08d_<relpath>" with the (shuffled) line index. Images that cannot be read
    are skipped with a warning (as Caffe, which logs and skips them).
    Returns {"path": out, "count": n, "skipped": [relpaths]}.
    """
    lines = read_image_list(list_file)
    if not lines:
        raise DataError(f"image list '{list_file}' holds no `relpath label` lines")
    if shuffle:
        order = numpy.random.default_rng(seed).permutation(len(lines))
        lines = [lines[i] for i in order]
    height, width = (int(v) for v in resize)
    skipped = []

    def records():
        for index, (rel, label) in enumerate(lines):
            path = f"{root}{rel}"
            try:
                if encoded:
                    datum = _encoded_datum(path, label, height, width, gray)
                else:
                    datum = array_to_datum(load_image(path, height, width, gray), label)
            except (OSError, ValueError) as e:
                warnings.warn(f"could not read image '{path}' ({e}); skipped")
                skipped.append(rel)
                continue
            yield f"{index:08d}_{rel}", datum.SerializeToString()

    count = write_lmdb(out, records(), shards=shards)
    if count == 0:
        raise DataError(f"none of the {len(lines)} images listed in '{list_file}' could be read "
                        f"under root '{root}' (is the root right, with its trailing slash?)")
    return {"path": out, "count": count, "skipped": skipped}


# ------------------------------------------------------------------------------------------------
# mean image (compute_image_mean)
# ------------------------------------------------------------------------------------------------
def compute_mean(source, chunk=1000):
    """float32 C x H x W mean of every record of an LMDB source (one pass), as compute_image_mean.

    Write it with engine.io.caffemodel.write_binaryproto(mean, path) for transform_param.mean_file.
    """
    with ShardedReader(source) as reader:
        total, done, acc = len(reader), 0, None
        while done < total:
            batch, _ = decode_batch(reader.read(min(chunk, total - done)), reader.source,
                                    where=reader.shard_of)
            part = batch.sum(axis=0, dtype=numpy.float64)
            if acc is not None and acc.shape != part.shape:
                raise DataError(f"data source '{source}' holds records of shapes {acc.shape} and "
                                f"{part.shape}: a mean needs one shape")
            acc = part if acc is None else acc + part
            done += len(batch)
    return (acc / total).astype(numpy.float32)
