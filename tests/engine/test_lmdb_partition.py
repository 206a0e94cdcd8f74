"""Property: n readers of an LMDB partition one reader's record stream, wrap-around included.

For one database of N records, reader r of n with batch K reads at its batch b the records at
positions b*n*K + r + k*n (k < K) of the single reader's stream, which restarts at the first
record after the last: so the n readers' batch b, slot r + k*n holding reader r's k-th record, is
exactly the single reader's batch b of n*K. Checked by key AND the whole serialized Datum, for
any N, n and K, over enough batches to wrap around at least twice: a reader that steps one past
the last record returns an empty record, whose label (0) the label-only tests cannot tell from
record 0's.

For a folder of S shards dealt round-robin, the same holds when S and N are multiples of n (the
module docstring of engine/io/lmdb_store.py), checked the same way.
"""
import itertools
import os
import tempfile

import lmdb
import numpy
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from poseidon.engine.io.datum import array_to_datum
from poseidon.engine.io.lmdb_store import ShardedReader, write_lmdb

_FOLDER = tempfile.TemporaryDirectory(prefix="lmdb-partition-")
_MADE = {}


def database(n_records, shards=1):
    """An LMDB (made once per shape) whose records differ in every byte that matters: label,
    pixels and size all depend on the index."""
    key = (n_records, shards)
    if key not in _MADE:
        path = f"{_FOLDER.name}/db-{n_records}-{shards}"
        write_lmdb(path, (array_to_datum(numpy.full((1, 1, 1 + i % 3), i % 251, numpy.uint8),
                                         label=i % 7).SerializeToString()
                          for i in range(n_records)), shards=shards)
        _MADE[key] = path
    return _MADE[key]


def stream(source, count):
    """The first `count` records of the single reader's stream, read with lmdb itself: every
    record of every shard in key order (the writer keys record i as %08d of i, whatever its
    shard), over and over."""
    paths = [source] if os.path.exists(os.path.join(source, "data.mdb")) else [
        os.path.join(source, d) for d in sorted(os.listdir(source))]
    once = []
    for path in paths:
        env = lmdb.open(path, readonly=True, lock=False)
        with env.begin() as txn:
            once += list(txn.cursor())
        env.close()
    return list(itertools.islice(itertools.cycle(sorted(once)), count))


def check_partition(source, n, k, batches):
    expected = stream(source, batches * n * k)
    assert all(key and value for key, value in expected)
    readers = [ShardedReader(source, r, n) for r in range(n)]
    try:
        for b in range(batches):
            parts = [reader.read(k) for reader in readers]
            together = [parts[s % n][s // n] for s in range(n * k)]
            assert together == expected[b * n * k:(b + 1) * n * k], f"batch {b}"
    finally:
        for reader in readers:
            reader.close()


def batches_to_wrap_twice(n_records, n, k):
    return 2 * n_records // (n * k) + 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_records=st.integers(1, 23), n=st.integers(1, 5), k=st.integers(1, 6))
def test_readers_partition_one_database(n_records, n, k):
    check_partition(database(n_records), n, k, batches_to_wrap_twice(n_records, n, k))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 4), shards_per_reader=st.integers(1, 3), per_reader=st.integers(1, 6),
       k=st.integers(1, 5))
def test_readers_partition_a_folder_of_shards(n, shards_per_reader, per_reader, k):
    n_records = n * per_reader
    shards = n * shards_per_reader
    if shards > n_records:
        return          # an empty shard is refused (tests/engine/test_data.py)
    check_partition(database(n_records, shards), n, k, batches_to_wrap_twice(n_records, n, k))


@pytest.mark.parametrize("n_records, n, k", [(5, 1, 5), (6, 2, 3), (7, 3, 2), (1, 4, 1)])
def test_the_stream_wraps_at_exactly_n_records(n_records, n, k):
    """The cases the property must cover at least: a batch ending on the last record, and a
    reader whose step lands exactly on N."""
    check_partition(database(n_records), n, k, batches_to_wrap_twice(n_records, n, k))
