"""Caffe-compatible LMDB databases of Datum records: writing and sharded reading (one open
database, shared between readers, is in lmdb_shard.py; batch decoding in batch.py).

Layout (Caffe's, see caffe-facts (h)): one LMDB environment directory holding ``data.mdb`` (and
``lock.mdb``), the unnamed main database, key = any byte string (records are read in LMDB's sorted
key order), value = ``Datum.SerializeToString()``. Databases made by Caffe's ``convert_imageset`` /
``convert_cifar_data`` read here unchanged, and the ones written here read in Caffe.

A *source* is either ONE database (a directory holding ``data.mdb``) or a FOLDER of shard databases
(sub-directories each holding ``data.mdb``; shard i is the i-th in sorted name order). The writers
here deal records round-robin over shards (record i goes to shard i % S) and keep the global index
in the key, and a reader of a folder takes its shards round-robin (one record from each in turn), so
one reader of a folder sees the records in exactly the order one database would give.

Sharding rule (`ShardedReader`, reader ``rank`` r of ``size`` n; this is Caffe 1.0's multi-GPU
``DataLayer::Skip`` rule): think of the single reader's stream, the records in order, restarting
from the first record after the last (Caffe's wrap-around), as positions p = 0, 1, 2, ... holding
record p mod N. Reader r reads the positions p = r, r + n, r + 2n, ...: its j-th record is position
r + j*n. So with batch size K, reader r's batch b holds positions b*n*K + r + k*n (k = 0..K-1), and
the n readers' batches b together hold positions b*n*K ... b*n*K + n*K - 1, which is exactly batch b
of one reader with batch size n*K (as a set; putting reader r's k-th record at slot r + k*n of the
big batch gives it in order). This holds over any number of iterations, wrap-around included, for
any N.

For a folder of S shards, reader r takes shards r, r+n, r+2n, ... and reads them round-robin; the
global record i (dealt to shard i % S) lands in reader (i % S) % n, which is i % n when S is a
multiple of n, so the rule above holds exactly (wrap-around included when N is also a multiple of
n; otherwise each reader restarts its own shards when they run out, which shifts the mapping near
the end of each epoch while every record is still read once per reader epoch). When S is NOT a
multiple of n, the first S % n readers get one shard more than the others, each reader cycles
through its own shards at its own pace (epochs of different lengths), and the batch identity above
no longer holds; every record is still read by exactly one reader. A warning says so. Fewer shards
than readers is an error.
"""
import json
import os
import shutil
import warnings

from ..errors import DataError
from .batch import decode_batch  # noqa: F401  (importable from here too, for callers of the reader)
from .lazy_lmdb import lmdb
from .lmdb_shard import Shard

DEFAULT_MAP_SIZE = 1 << 26          # 64 MiB to start; doubled whenever the map fills
COMMIT_EVERY = 1000                 # as Caffe's converters
_LEVELDB_FILES = ("CURRENT", "LOCK", "LOG")
_CREATE_HINT = "create it with `poseidon data …` (see `poseidon data --help`)"


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------
def _as_bytes(value, what):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    serialize = getattr(value, "SerializeToString", None)
    if serialize is not None:
        return serialize()
    raise TypeError(f"{what} must be bytes, str or a protobuf message, got {type(value).__name__}")


def _refuse_existing(path):
    if os.path.isfile(path):
        raise DataError(f"cannot write LMDB '{path}': a file of that name exists; "
                        f"remove it or choose another output path")
    if os.path.isdir(path) and os.listdir(path):
        raise DataError(f"cannot write LMDB '{path}': the directory exists and is not empty "
                        f"(an earlier conversion?); remove it or choose another output path")


class LMDBWriter:
    """Puts records into a new LMDB, committing every `commit_every` and growing the map as needed."""

    def __init__(self, path, map_size=DEFAULT_MAP_SIZE, commit_every=COMMIT_EVERY):
        _refuse_existing(path)
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.map_size = int(map_size)
        self.commit_every = int(commit_every)
        self.count = 0
        self._pending = []
        self._env = lmdb.open(path, map_size=self.map_size, subdir=True, meminit=False,
                              max_dbs=0)

    def put(self, key, value):
        self._pending.append((_as_bytes(key, "key"), _as_bytes(value, "value")))
        if len(self._pending) >= self.commit_every:
            self.commit()

    def commit(self):
        while self._pending:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in self._pending:
                        if not txn.put(key, value, overwrite=False):
                            raise DataError(f"cannot write LMDB '{self.path}': key "
                                            f"'{key.decode('utf-8', 'replace')}' is given twice")
            except lmdb.MapFullError:
                self.map_size *= 2            # the aborted transaction is retried in a larger map
                self._env.set_mapsize(self.map_size)
                continue
            self.count += len(self._pending)
            self._pending = []

    def close(self):
        if self._env is not None:
            self.commit()
            self._env.sync()
            self._env.close()
            self._env = None

    def abort(self):
        if self._env is not None:
            self._env.close()
            self._env = None


def shard_names(shards):
    """Sub-directory names of a shard folder, in index order (sorted name order = index order)."""
    width = max(5, len(str(shards - 1)))
    return [f"shard-{i:0{width}d}" for i in range(shards)]


def write_lmdb(path, records_iter, key_format="%08d", shards=1, map_size=DEFAULT_MAP_SIZE,
               commit_every=COMMIT_EVERY):
    """Write records to a new LMDB at `path` (or a folder of `shards` shard LMDBs); returns the count.

    Each record is either a value (serialized Datum bytes, or a Datum message), keyed
    ``key_format % i`` by its index i, or a ``(key, value)`` pair (key str or bytes). With shards > 1,
    `path` becomes a folder of shard databases (`shard_names`) and record i goes to shard i % shards
    (round-robin, keys unchanged), so a `ShardedReader` of the folder gives the original order.
    Commits every `commit_every` records; the memory map starts at `map_size` bytes and doubles when
    full. An existing non-empty `path` is refused; on failure the partial output is removed.
    """
    shards = int(shards)
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    _refuse_existing(path)
    created = not os.path.exists(path)
    writers = []
    try:
        if shards == 1:
            writers = [LMDBWriter(path, map_size, commit_every)]
        else:
            os.makedirs(path, exist_ok=True)
            for name in shard_names(shards):
                writers.append(LMDBWriter(os.path.join(path, name), map_size, commit_every))
        for i, record in enumerate(records_iter):
            if isinstance(record, tuple):
                key, value = record
            else:
                key, value = key_format % i, record
            writers[i % shards].put(key, value)
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        if created:
            shutil.rmtree(path, ignore_errors=True)
        else:  # an empty directory that was there before: leave it empty again
            for entry in os.listdir(path):
                full = os.path.join(path, entry)
                shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)
        raise
    return sum(w.count for w in writers)


# ------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------
def _is_lmdb_dir(path):
    return os.path.isfile(os.path.join(path, "data.mdb"))


def _looks_like_leveldb(path):
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if "CURRENT" in names and any(n.startswith("MANIFEST-") for n in names):
        return True
    return any(n.endswith((".ldb", ".sst")) for n in names)


def _leveldb_error(source, where=None):
    where = f" (shard '{where}')" if where else ""
    return DataError(f"data source '{source}'{where} is a LevelDB database: LevelDB is not "
                     f"supported, only LMDB; convert it to LMDB (e.g. re-run Caffe's "
                     f"convert_imageset with --backend=lmdb, or `poseidon data …`) and set "
                     f"`backend: LMDB`")


def inspect_source(source):
    """('db', [path]) for one database or ('folder', [shard paths]) for a folder; DataError if neither."""
    source = os.fspath(source)
    if not os.path.exists(source):
        raise DataError(f"LMDB source '{source}' does not exist: {_CREATE_HINT}")
    if os.path.isfile(source):
        hint = (f"give its directory '{os.path.dirname(source) or '.'}'"
                if os.path.basename(source) == "data.mdb" else "give the directory holding data.mdb")
        raise DataError(f"LMDB source '{source}' is a file: an LMDB source is a directory "
                        f"holding data.mdb (or a folder of such directories); {hint}")
    if _is_lmdb_dir(source):
        return "db", [source]
    if _looks_like_leveldb(source):
        raise _leveldb_error(source)
    subdirs = sorted(d for d in os.listdir(source) if os.path.isdir(os.path.join(source, d)))
    shards = [os.path.join(source, d) for d in subdirs if _is_lmdb_dir(os.path.join(source, d))]
    if not shards:
        for d in subdirs:
            if _looks_like_leveldb(os.path.join(source, d)):
                raise _leveldb_error(source, d)
        raise DataError(f"data source '{source}' is not an LMDB database (no data.mdb inside) nor "
                        f"a folder of LMDB shard databases: {_CREATE_HINT}")
    return "folder", shards


class ShardedReader:
    """Reads (key, serialized Datum) records of an LMDB source as reader `rank` of `size`.

    See the module docstring for the sharding rule; in short: for one database, reader r's j-th
    record is record (r + j*n) mod N of the database (Caffe 1.0's multi-GPU rule), so n readers
    with batch K read at every iteration exactly the records one reader with batch n*K reads
    (reader r's k-th record of batch b = record b*n*K + r + k*n, mod N). For a folder of S shards,
    reader r takes shards r, r+n, r+2n, ... (sorted name order) and reads them round-robin, which
    is the same rule when the records were dealt round-robin to the shards (as `write_lmdb` does)
    and S is a multiple of n. When S is not a multiple of n, the first S % n readers hold one shard
    more and the readers' epochs differ in length (a warning is issued); fewer shards than readers
    is a DataError. Everything wraps around at the end to the first record, as Caffe does.
    """

    def __init__(self, source, rank=0, size=1):
        self.source = os.fspath(source)
        self.rank, self.size = int(rank), int(size)
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"reader rank {rank} of {size} is out of range")
        self.kind, paths = inspect_source(self.source)
        self.num_shards = len(paths) if self.kind == "folder" else 0
        if self.kind == "folder":
            if len(paths) < self.size:
                raise DataError(f"data source '{self.source}' holds {len(paths)} shard "
                                f"database(s) but {self.size} readers (workers) read it: give "
                                f"at least one shard per reader (re-create it with --shards "
                                f"{self.size} or a multiple) or run fewer workers")
            if len(paths) % self.size:
                warnings.warn(f"data source '{self.source}' holds {len(paths)} shards, not a "
                              f"multiple of the {self.size} readers: the first "
                              f"{len(paths) % self.size} reader(s) get one shard more, epochs differ between readers and the "
                              f"distributed batches are not those of one reader", stacklevel=2)
            paths = paths[self.rank::self.size]
        self._shards = []
        try:
            for p in paths:
                shard = Shard(p, self.source)
                self._shards.append(shard)
                if shard.length == 0:
                    where = "" if self.kind == "db" else f" (shard '{os.path.basename(p)}')"
                    raise DataError(f"LMDB source '{self.source}'{where} is empty (0 records): "
                                    f"re-create it with `poseidon data …`")
        except BaseException:
            self.close()
            raise
        self.total = sum(s.length for s in self._shards)   # records of the reader's database(s)
        self._lengths = [s.length for s in self._shards]
        self._max_len = max(self._lengths)
        # state: one db -> the next global position; folder -> (row, slot)
        self._pos = 0
        self._row = 0
        self._slot = 0
        if self.kind == "db":
            self._goto(self.rank % self.total)

    # ----- one database -------------------------------------------------------------------------
    def _goto(self, position):
        self._shards[0].seek_index(position)
        self._pos = position

    def _advance_db(self, steps):
        n = self.total
        steps %= n
        if steps == 0:
            return
        if self._pos + steps >= n:                # wrap around: restart from the first record
            self._goto((self._pos + steps) % n)
            return
        self._shards[0].step(steps)
        self._pos += steps

    # ----- folder of shards ---------------------------------------------------------------------
    def _locate(self):
        """Normalise (row, slot) to the next readable record, wrapping around at the end."""
        m = len(self._shards)
        while True:
            if self._row >= self._max_len:
                self._row, self._slot = 0, 0
                for s in self._shards:
                    s.first()
            if self._slot >= m:
                self._row, self._slot = self._row + 1, 0
                continue
            if self._row < self._lengths[self._slot]:
                return self._shards[self._slot]
            self._slot += 1

    # ----- public API ---------------------------------------------------------------------------
    def peek_record(self):
        """The (key, value) next_record would return, without moving."""
        shard = self._shards[0] if self.kind == "db" else self._locate()
        return shard.item()

    def next_record(self):
        """(key bytes, serialized Datum bytes) of this reader's next record; wraps at the end."""
        if self.kind == "db":
            item = self._shards[0].item()
            self._advance_db(self.size)
            return item
        shard = self._locate()
        item = shard.item()
        shard.step()
        self._slot += 1
        return item

    def read(self, count):
        return [self.next_record() for _ in range(count)]

    def shard_of(self, key):
        """The database of this reader holding `key` (the source itself when it is one database),
        for messages about one record."""
        if self.kind == "db":
            return self.source
        for shard in self._shards:
            if shard.holds(key):
                return shard.path
        return self.source

    def skip(self, count):
        """Skip records (Caffe's rand_skip): `count` positions of the global stream for one
        database (readers given the same count stay a partition of one reader's stream), or
        count // size of this reader's own records for a folder."""
        count = int(count)
        if self.kind == "db":
            self._advance_db(count)
        else:
            for _ in range(count // self.size):
                self.next_record()

    def __len__(self):
        """Records this reader sees per epoch (positions r, r+n, ... below N for one database)."""
        if self.kind == "db":
            return max(0, (self.total - self.rank + self.size - 1) // self.size)
        return self.total

    def cursor(self):
        """A small JSON-able dict of the reading position (restore with set_cursor)."""
        state = {"source": self.source, "kind": self.kind, "rank": self.rank, "size": self.size}
        if self.kind == "db":
            state["position"] = self._pos
            state["key"] = self._shards[0].key().hex()
        else:
            self._locate()
            state["row"], state["slot"] = self._row, self._slot
            keys = []
            for i, s in enumerate(self._shards):
                done = self._row + (1 if i < self._slot else 0)
                keys.append(s.key().hex() if done < s.length else None)
            state["keys"] = keys
        return state

    def set_cursor(self, state):
        if isinstance(state, str):
            state = json.loads(state)
        if (state.get("kind") != self.kind or int(state.get("rank", -1)) != self.rank
                or int(state.get("size", -1)) != self.size):
            raise DataError(f"data cursor for '{state.get('source')}' (reader "
                            f"{state.get('rank')} of {state.get('size')}, {state.get('kind')}) "
                            f"does not fit reader {self.rank} of {self.size} of '{self.source}' "
                            f"({self.kind}): resume with the same data and number of workers")
        if self.kind == "db":
            position = int(state["position"]) % self.total
            self._shards[0].seek_index(position, state.get("key"))
            self._pos = position
        else:
            row, slot = int(state["row"]), int(state["slot"])
            keys = state.get("keys") or [None] * len(self._shards)
            for i, s in enumerate(self._shards):
                done = min(row + (1 if i < slot else 0), s.length)
                s.seek_index(done, keys[i] if i < len(keys) else None)
            self._row, self._slot = row, slot

    def close(self):
        for s in self._shards:
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def iter_records(source):
    """Every (key, value) of a source once, in single-reader order."""
    with ShardedReader(source) as reader:
        for _ in range(len(reader)):
            yield reader.next_record()
