"""A KV server's values and its local workers' gradients in shared memory (`--ipc auto`).

Why: on one host the sync after the last backward cannot be hidden, and a push and its answer
through a socket copy every byte five times (the worker into the socket, the socket into the
server, the server's answer out and in again, then into the parameter), each time from memory
that training has just evicted from the caches. With the values and gradients in one shared
mapping the push and its answer are headers only: the worker's gradient is in its own region,
the server sums the regions and updates its values in place, and the worker's parameters are
the values. (A worker places its parameters there, dist/worker/replicas.py: their data and diff become
views of the mapping; a parameter it cannot place is copied in and out.) What that saves is the
cold copies, not bandwidth, so it matters most for the one sync that cannot be hidden and for
nets whose parameters are large (docs/performance.md, "The distributed path on one host").

The mapping is a memfd of the server, which it advertises with the rest of its Unix-socket
details (pid, descriptor, device and inode) through the coordinator, over CURVE. A worker of the
same host and user opens it as /proc/<pid>/fd/<fd> (the kernel lets only this user, or root, do
so), checks it is the advertised file and large enough for the book's layout, and maps it. When
any of that fails the worker keeps sending the arrays on the link, as with `--ipc links`.

Layout (the same in every process, from the book): the values region, then one gradient region
per worker, each holding the server's KV pairs in book order, every pair 64-byte aligned.

Safety: only under BSP with the `update` handler (relaxed consistency and the bandwidth cap keep
the arrays on the wire). A worker reads the values only after the server's answer and writes its
region again only in its next backward, after that answer; the server writes the values only when
every worker has pushed the pair's next gradient, so nobody reads what is being written, and it
never writes a worker's region (dist/kv/store.KVServer.gradient_sum).
"""
import fcntl
import logging
import mmap
import os
import stat

import numpy

ALIGN_BYTES = 64
# Once sized, the memfd's size is sealed: another process of this user that opens it through
# /proc could otherwise shrink it, and the server's (and every worker's) next access past the new
# end would be a SIGBUS. F_SEAL_SEAL keeps anyone from lifting or changing the seals.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Layout:
    """Where each KV pair of one server sits in its segment (elements, from the segment's start
    of a region)."""

    def __init__(self, book, server_index, workers):
        self.dtype = numpy.dtype(book.data["dtype"])
        step = max(1, ALIGN_BYTES // self.dtype.itemsize)
        self.slots = {}
        offset = 0
        for rec in book.pairs_on_server(server_index):
            self.slots[rec.id] = (offset, rec.length)
            offset += -(-rec.length // step) * step
        self.region = offset                 # elements in one region
        self.workers = workers
        self.nbytes = (1 + workers) * offset * self.dtype.itemsize


class Segment:
    """One server's mapping: `values(pair)` and `grads(worker, pair)` are views into it."""

    def __init__(self, layout, mapping):
        self.layout, self._mapping = layout, mapping
        self.array = numpy.frombuffer(mapping, layout.dtype, (1 + layout.workers) * layout.region)

    def values(self, pair_id):
        offset, length = self.layout.slots[pair_id]
        return self.array[offset:offset + length]

    def grads(self, worker, pair_id):
        offset, length = self.layout.slots[pair_id]
        start = (1 + worker) * self.layout.region + offset
        return self.array[start:start + length]


class ServerMemory:
    """The server's memfd: made (empty) before registration so that it can be advertised, sized
    once the book says what the server holds."""

    def __init__(self):
        self.fd = os.memfd_create("poseidon-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)

    @classmethod
    def make(cls):
        """A ServerMemory, or None where memfds are not available (not Linux)."""
        if not hasattr(os, "memfd_create"):
            return None
        try:
            return cls()
        except OSError as e:
            logging.getLogger("poseidon").warning(f"no shared KV memory ({e}); KV pushes on "
                                                  f"this host carry their arrays")
            return None

    def describe(self):
        st = os.fstat(self.fd)
        return {"pid": os.getpid(), "fd": self.fd, "dev": st.st_dev, "ino": st.st_ino}

    def allocate(self, layout):
        """Size the memfd for layout, seal its size (SIZE_SEALS) and map it; returns the Segment
        (None for no pairs)."""
        if layout.nbytes == 0:
            return None
        os.ftruncate(self.fd, layout.nbytes)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        return Segment(layout, mmap.mmap(self.fd, layout.nbytes))


def open_segment(info, layout):
    """A worker's mapping of the server segment `info` advertises, or None (with the reason
    logged at debug level) when it is not reachable from here or not what the layout needs."""
    log = logging.getLogger("poseidon")
    if not isinstance(info, dict) or layout.nbytes == 0:
        return None
    try:
        pid, fd = int(info["pid"]), int(info["fd"])
        path = f"/proc/{pid}/fd/{fd}"
        handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (KeyError, TypeError, ValueError, OSError) as e:
        log.debug(f"shared KV memory not opened ({e}); the arrays go on the link")
        return None
    try:
        st = os.fstat(handle)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or
                (st.st_dev, st.st_ino) != (info.get("dev"), info.get("ino"))):
            log.debug(f"{path} is not the advertised shared KV memory")
            return None
        if st.st_size < layout.nbytes:
            log.debug(f"{path} holds {st.st_size} bytes, the book's layout {layout.nbytes}")
            return None
        if fcntl.fcntl(handle, fcntl.F_GET_SEALS) & SIZE_SEALS != SIZE_SEALS:
            log.debug(f"{path} is not sealed at its size (it could shrink under the mapping)")
            return None
        return Segment(layout, mmap.mmap(handle, layout.nbytes))
    except OSError as e:
        log.debug(f"shared KV memory not mapped ({e}); the arrays go on the link")
        return None
    finally:
        os.close(handle)          # the mapping keeps the memory
