"""Damaged LMDB files give one DataError naming the database file or shard, never a crash.

A data.mdb cut short is refused when it is opened: reading it would kill the process with SIGBUS,
so that case is only run in a subprocess (tests/tools/test_bad_input.py, "lmdb: data file cut in half");
here a cut shard of a folder is run the same way, and the in-process cases are those lmdb reports
as errors (a page of garbage) or that the decoder must catch (a Datum of negative sizes).
"""
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy
import pytest

from poseidon.engine.errors import DataError
from poseidon.engine.io.batch import decode_batch
from poseidon.engine.io.datum import array_to_datum
from poseidon.engine.io.lmdb_store import ShardedReader, write_lmdb
from poseidon.engine.proto import caffe_pb2

ROOT = Path(__file__).resolve().parents[2]


def records(n, negative_at=None):
    """n (3, 4, 4) uint8 Datum records; record `negative_at` is a -1 x -1 x 5 Datum of 5 bytes."""
    out = []
    for i in range(n):
        image = numpy.full((3, 4, 4), i % 256, numpy.uint8)
        datum = (caffe_pb2.Datum(channels=-1, height=-1, width=5, data=bytes(5))
                 if i == negative_at else array_to_datum(image, i))
        out.append(datum.SerializeToString())
    return out


def page_size(path):
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        return env.stat()["psize"]
    finally:
        env.close()


def overwrite_first_leaf(path):
    """Garbage over the page holding the database's first key (read when it is opened)."""
    data = Path(path) / "data.mdb"
    raw = bytearray(data.read_bytes())
    size = page_size(path)
    first = raw.index(b"%08d" % min(int(k) for k in _keys(path))) // size
    raw[first * size:(first + 1) * size] = bytes((5 * i + 11) % 256 for i in range(size))
    data.write_bytes(bytes(raw))


def _keys(path):
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return [key.decode() for key, _ in txn.cursor()]
    finally:
        env.close()


def test_a_page_of_garbage_in_one_shard_names_the_shard(tmp_path):
    source = tmp_path / "folder"
    write_lmdb(str(source), records(200), shards=2)
    overwrite_first_leaf(source / "shard-00001")
    with pytest.raises(DataError) as err:
        reader = ShardedReader(str(source))
        reader.read(400)
    text = str(err.value)
    assert "shard-00001" in text and f"data source '{source}'" in text
    assert "MDB_CORRUPTED" in text and "copy it again" in text


def test_a_cut_shard_is_refused_with_the_bytes_needed_and_present(tmp_path):
    """In a subprocess: before the fix the read below ended in SIGBUS."""
    source = tmp_path / "folder"
    write_lmdb(str(source), records(300), shards=3)
    data = source / "shard-00002" / "data.mdb"
    whole = data.read_bytes()
    data.write_bytes(whole[:len(whole) // 2])
    code = ("import sys\nfrom poseidon.engine.errors import DataError\n"
            "from poseidon.engine.io.lmdb_store import ShardedReader\n"
            "try:\n    ShardedReader(sys.argv[1]).read(600)\n"
            "except DataError as e:\n    print(e)\n    sys.exit(1)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    result = subprocess.run([sys.executable, "-c", code, str(source)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stderr}"
    assert f"'{data}' is cut short: it needs {len(whole)} bytes but holds {len(whole) // 2}" \
        in result.stdout
    assert "Traceback" not in result.stderr


def test_negative_sizes_name_the_key_and_the_shard(tmp_path):
    source = tmp_path / "folder"
    write_lmdb(str(source), records(6, negative_at=3), shards=2)     # record 3 -> shard 1
    reader = ShardedReader(str(source))
    batch = reader.read(6)
    with pytest.raises(DataError) as err:
        decode_batch(batch, str(source), where=reader.shard_of)
    text = str(err.value)
    assert "record '00000003'" in text and os.path.join(str(source), "shard-00001") in text
    assert "(-1, -1, 5)" in text
    # alone in its batch too (the size test that two negative sizes pass is not enough)
    with pytest.raises(DataError, match=r"'00000003'.*\(-1, -1, 5\)"):
        decode_batch([batch[3]], str(source))
