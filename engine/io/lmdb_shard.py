"""One open LMDB database of a reader: its read-only environment, shared by every reader of the
same file in the process, and one long read transaction with its cursor (`Shard`). A damaged file
read at any point gives one DataError naming it, never lmdb's traceback or a SIGBUS."""
import functools
import os
import threading

from ..errors import DataError
from .lazy_lmdb import lmdb

# LMDB allows one open environment per database file and process: readers of the same files
# (a train and a test net, or several ranks in one process) share it, each with its own
# transaction. Keyed by the data file's identity, so a database re-created at the same path is
# opened afresh.
_ENVS = {}
_ENVS_LOCK = threading.Lock()


def _file_id(path):
    st = os.stat(os.path.join(path, "data.mdb"))
    return (st.st_dev, st.st_ino) if st.st_ino else os.path.realpath(path)


def _check_complete(env, path):
    """Refuse a data file shorter than the pages its meta page says were written.

    LMDB maps the file and trusts it: a half-copied data.mdb opens fine, and the first read of a
    page past its end kills the process with SIGBUS (no message, no traceback). The meta pages at
    the start survive such a cut and name the last page in use, so the size needed is known."""
    data_file = os.path.join(path, "data.mdb")
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    present = os.path.getsize(data_file)
    if present < needed:
        raise DataError(f"LMDB file '{data_file}' is cut short: it needs {needed} bytes but holds "
                        f"{present} (a copy or download that did not finish?): copy it again, or "
                        f"re-create the database with `poseidon data …`")


def _acquire_env(path):
    with _ENVS_LOCK:
        key = _file_id(path)
        entry = _ENVS.get(key)
        if entry is None:
            env = lmdb.open(path, readonly=True, lock=False, readahead=False, subdir=True,
                            max_readers=1024, max_dbs=0)
            try:
                _check_complete(env, path)
            except BaseException:
                env.close()
                raise
            entry = _ENVS[key] = [env, 0]
        entry[1] += 1
        return key, entry[0]


def _release_env(key):
    with _ENVS_LOCK:
        entry = _ENVS.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _ENVS[key]
            entry[0].close()


def _reading(method):
    """Turn lmdb's errors while reading a shard (a page overwritten with garbage gives
    MDB_CORRUPTED) into one DataError naming the shard, instead of a traceback."""
    @functools.wraps(method)
    def guarded(shard, *args):
        try:
            return method(shard, *args)
        except lmdb.Error as e:
            raise shard.damaged(e) from None
    return guarded


class Shard:
    """One open LMDB: a (shared) read-only environment, one long read transaction and a cursor.

    The reader moves the cursor through the methods below only, so that a damaged file read at
    any point gives the same one line."""

    def __init__(self, path, source):
        self.path = path
        self.source = source
        self.env = None
        try:
            self._key, env = _acquire_env(path)
        except (lmdb.Error, OSError) as e:
            raise DataError(f"data source '{source}': '{path}' is not a readable LMDB "
                            f"database ({e}); re-create it with `poseidon data …`") from None
        self.env = env
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    @_reading
    def _open(self):
        self.txn = self.env.begin(buffers=False)
        self.length = int(self.txn.stat()["entries"])
        self.cur = self.txn.cursor()
        self.cur.first()

    def damaged(self, error):
        where = "" if self.path == self.source else f" (a shard of data source '{self.source}')"
        return DataError(f"LMDB database '{self.path}'{where} cannot be read ({error}): its file "
                         f"is damaged; copy it again, or re-create it with `poseidon data …`")

    @_reading
    def first(self):
        self.cur.first()

    @_reading
    def step(self, count=1):
        for _ in range(count):
            self.cur.next()

    @_reading
    def item(self):
        return self.cur.item()

    @_reading
    def key(self):
        return self.cur.key()

    @_reading
    def holds(self, key):
        return self.txn.get(key) is not None

    @_reading
    def seek_index(self, index, key_hex=None):
        """Put the cursor on the index-th record (by key when given, else by stepping)."""
        if key_hex is not None and self.cur.set_key(bytes.fromhex(key_hex)):
            return
        self.cur.first()
        for _ in range(index):
            self.cur.next()

    def close(self):
        if self.env is not None:
            txn = getattr(self, "txn", None)
            if txn is not None:
                txn.abort()
            self.env = None
            _release_env(self._key)
