"""Direct links: the KV store's push and its answer between two processes of one host, on a Unix
stream socket that the waiting thread reads itself.

Why: a ZeroMQ message crosses two I/O threads (the sender's and the receiver's), and the answer is
then handed from the receive thread to the sync thread that waits for it. On two cores that
training keeps busy, each of those hand-offs is a wake-up that waits for a core, and the wait
for a core, not the bytes, sets the round trip of a small push; the fewer threads a message
passes, the fewer such waits (docs/performance.md, "The distributed path on one host"). So a
worker's sync thread pushes a KV pair on a link of its own to the server and reads the answer
from that link; the server serves all its links on one thread (`Listener`; the KV store serves
its messages under one lock anyway) and answers on the link the push came on.

What stays on ZeroMQ: everything else (the coordinator, SFB's factors, initialisation, shutdown),
pushes over MAX_BYTES, every peer on another host, every process when the job runs with
`--ipc zmq` or `--ipc off`, and a thread whose link has closed (dist/transport/zmq_onehost.py
falls back).

Who can connect: the listening socket sits in the process's private 0700 folder beside its
ZeroMQ Unix-socket inbox (localipc.py), and an accepted connection must also come from a process
of this user (SO_PEERCRED). A reader allocates no more than MAX_HEADER_BYTES for a header
and MAX_MESSAGE_BYTES for a message; bytes beyond those bounds close the link (BadStream).

No deadlock: every socket is non-blocking and every read is incremental, so nobody ever waits in
the middle of a message. The worker's thread writes its push in full, reading whatever the server
wrote meanwhile; the server never waits to write: an answer that does not fit in the socket's
buffer is queued, and flushed by the listener's thread when the socket can take more, or by
whoever waits for it to be written (`Written.wait`, before the server reuses the values it sent).
"""
import math
import os
import select
import selectors
import socket
import struct
import threading
import time
from collections import deque

import numpy

_LENGTH = struct.Struct("<I")           # the header's length, before the header
BUFFER_BYTES = 4 << 20                  # asked for (the kernel caps it at net.core.*mem_max)
WAIT_SLICE = 0.1                        # the longest a wait goes without looking again
MAX_BYTES = 1 << 20                     # larger pushes go through ZeroMQ, whose I/O threads
                                        # write and read at once (the answers of a big layer
                                        # stream back while its later pairs still go out)
MAX_HEADER_BYTES = 1 << 16              # a header is a few hundred bytes; more is not a member's
MAX_MESSAGE_BYTES = 4 * MAX_BYTES       # what a reader allocates for one message at most
STAGE_BYTES = 1 << 14                   # what one read takes into a link's staging buffer
# A thread with nothing else to do while it waits for an answer (the worker's main thread in the
# sync after the last backward) may look for it without sleeping for this long, where the host
# has a core for every process of the job (dist/worker/hooks.spin_seconds): a thread asleep in select is
# woken through the scheduler, and that wake-up adds to the exposed sync. The bound is a few times
# the round trip of a small net's one bucket on one host, so such an answer is caught spinning,
# while a slower one costs at most this much CPU before the thread sleeps.
SPIN_SECONDS = 0.002
MAX_LINKS = 256                         # links a process opens (a thread each per server); then
                                        # its pushes go through ZeroMQ, sparing file descriptors


class LinkClosed(Exception):
    """The other end closed the link (or it broke)."""


class BadStream(ValueError):
    """Bytes on a link that no member writes (a header or message over the bounds): the link is
    closed, since what follows cannot be told apart."""


def _tune(sock):
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)
        except OSError:
            pass
    sock.setblocking(False)


def _views(header, arrays):
    views = deque([memoryview(_LENGTH.pack(len(header)) + header)])
    views.extend(memoryview(a).cast("B") for a in arrays if a.nbytes)
    return views


class Written:
    """Whether a message posted on a served link has left this process (its buffers may then be
    reused). `wait` writes the link's queue itself rather than wait for the link's thread."""

    __slots__ = ("link", "done")

    def __init__(self, link):
        self.link, self.done = link, False

    def wait(self, timeout=-1):
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while not self.done:
            if not self.link.flush():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("a direct link's peer has not read its answer in time")
                self.link.wait_writable(WAIT_SLICE if left is None else min(left, WAIT_SLICE))


class _Reader:
    """Incremental parse of the byte stream into (header, arrays): length, header, each array.

    A read takes what the socket holds in one call into a staging buffer and parses it from
    there: a header-only message (a push or answer in shared memory) costs one `recv`, not one
    for its length, one for its header and a third that finds the socket empty (that third call
    is skipped whenever a read returned less than it asked for: the socket was empty then, and
    the caller's select wakes again for anything newer). Array bytes beyond the staging buffer
    are read straight into the array."""

    def __init__(self, parse):
        self._parse = parse
        self._stage = bytearray(STAGE_BYTES)
        self._staged = memoryview(self._stage)
        self._pos = self._end = 0            # the staged bytes not parsed yet
        self._start()

    def _start(self):
        self._length = bytearray(_LENGTH.size)
        self._header = None
        self._arrays = None
        self._index = 0
        self._view = memoryview(self._length)
        self._got = 0

    def _advance(self):
        """The current buffer is full: move to the next; returns a finished message or None."""
        if self._header is None:
            length = _LENGTH.unpack(self._length)[0]
            if length > MAX_HEADER_BYTES:
                raise BadStream(f"a header of {length} bytes (at most {MAX_HEADER_BYTES})")
            self._header = bytearray(length)
            self._view, self._got = memoryview(self._header), 0
            if len(self._header):
                return None
        if self._arrays is None:
            header = bytes(self._header)
            specs = self._parse(header)
            size = sum(dtype.itemsize * math.prod(shape) for dtype, shape in specs)
            if size > MAX_MESSAGE_BYTES:
                raise BadStream(f"a message of {size} bytes (a link carries at most "
                                f"{MAX_MESSAGE_BYTES})")
            self._arrays = [numpy.empty(shape, dtype) for dtype, shape in specs]
            self._header = header
            self._index = -1
        while True:
            self._index += 1
            if self._index == len(self._arrays):
                done = (self._header, self._arrays)
                self._start()
                return done
            a = self._arrays[self._index]
            if a.nbytes:
                self._view, self._got = memoryview(a.reshape(-1)).cast("B"), 0
                return None

    def read(self, sock):
        """Every whole message that can be read now without waiting (raises LinkClosed)."""
        done = []
        drained = False
        while True:
            if self._got == len(self._view):
                msg = self._advance()
                if msg is not None:
                    done.append(msg)
                continue
            if self._pos < self._end:            # staged bytes into the current buffer
                n = min(self._end - self._pos, len(self._view) - self._got)
                self._view[self._got:self._got + n] = self._staged[self._pos:self._pos + n]
                self._got += n
                self._pos += n
                continue
            if drained:
                return done
            want = len(self._view) - self._got
            direct = want >= STAGE_BYTES         # a large array: no detour through the stage
            target = self._view[self._got:] if direct else self._staged
            try:
                n = sock.recv_into(target, 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return done
            except OSError as e:
                raise LinkClosed(str(e)) from None
            if n == 0:
                raise LinkClosed("the other end closed the link")
            if direct:
                self._got += n
            else:
                self._pos, self._end = 0, n
            drained = n < len(target)


class Link:
    """One connected Unix stream socket between two processes of the job."""

    def __init__(self, sock, peer, parse):
        _tune(sock)
        self.sock = sock
        self.peer = peer               # the rank at the other end (None on the accepting side)
        self.lock = threading.Lock()   # one writer at a time; guards the queue
        self.open = True
        self._queue = deque()          # [views, Written] not yet written (served links)
        self._reader = _Reader(parse)
        self.on_pending = None         # a served link: tells its listener to write the queue

    @classmethod
    def connect(cls, path, peer, parse):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        return cls(sock, peer, parse)

    # ----- writing ------------------------------------------------------------------------------
    def _write_some(self, views):
        """Write what the socket takes now; drops the written views (and parts) from views."""
        while views:
            try:
                sent = self.sock.sendmsg(views, (), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.open = False
                raise LinkClosed(str(e)) from None
            while sent:
                first = views[0]
                if sent >= len(first):
                    sent -= len(first)
                    views.popleft()
                else:
                    views[0] = first[sent:]
                    sent = 0

    def send(self, header, arrays, timeout, on_messages):
        """Write one whole message now (a worker's push). While the socket is full, read what the
        peer wrote and hand it to on_messages(list of (header, arrays)). TimeoutError after
        `timeout` seconds; LinkClosed if the link broke."""
        views = _views(header, arrays)
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                self._write_some(views)
                if not views:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the peer has not read for the whole deadline")
                readable, _, _ = select.select([self.sock], [self.sock], [],
                                               min(left, WAIT_SLICE))
                if readable:
                    msgs = self._reader.read(self.sock)
                    if msgs:
                        on_messages(msgs)

    def post(self, header, arrays):
        """Queue one message (a server's answer) and write what the socket takes now; never
        waits. Returns a Written to wait on before the arrays are changed."""
        written = Written(self)
        with self.lock:
            if not self.open:
                raise LinkClosed("the link is closed")
            self._queue.append([_views(header, arrays), written])
            self._flush_locked()
            left = bool(self._queue)
        if left and self.on_pending is not None:
            self.on_pending(self)
        return written

    def _flush_locked(self):
        while self._queue:
            views, written = self._queue[0]
            self._write_some(views)
            if views:
                return False
            written.done = True
            self._queue.popleft()
        return True

    def flush(self):
        """Write what the socket takes of the queue now; True when the queue is empty."""
        with self.lock:
            try:
                return self._flush_locked()
            except LinkClosed:
                self._drop_queue()
                return True

    def _drop_queue(self):
        for _, written in self._queue:
            written.done = True          # never to be written: the buffers are free again
        self._queue.clear()

    def pending(self):
        return bool(self._queue)

    def wait_writable(self, timeout):
        try:
            select.select([], [self.sock], [], timeout)
        except (OSError, ValueError):
            pass

    # ----- reading ------------------------------------------------------------------------------
    def read_ready(self, timeout, spin=0.0):
        """Wait up to timeout seconds for data, then every whole message readable now. With
        `spin`, look without sleeping for up to that many seconds first (see SPIN_SECONDS)."""
        if not self.open:
            raise LinkClosed("the link is closed")
        if spin > 0:
            end = time.perf_counter() + min(spin, timeout)
            while True:
                msgs = self._reader.read(self.sock)
                if msgs:
                    return msgs
                if time.perf_counter() >= end:
                    break
        try:
            readable, _, _ = select.select([self.sock], [], [], timeout)
        except (OSError, ValueError) as e:
            raise LinkClosed(str(e)) from None
        return self._reader.read(self.sock) if readable else []

    def close(self):
        self.open = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.on_pending is None:      # a served link's socket is closed by its listener
            self.sock.close()


class Listener:
    """The listening socket of one process and the links it accepted, all served by one thread
    (the KV store serves its messages under one lock anyway): it reads every message that
    arrives and hands it to `on_message(header, arrays, link)`, and writes queued answers when
    a socket can take them."""

    def __init__(self, path, parse, on_message, on_error, name):
        self.path = path
        self._parse, self._on_message, self._on_error = parse, on_message, on_error
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._links = set()
        self._pending = set()            # links whose queue waits for the socket
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=f"{name}-links", daemon=True)
        self._thread.start()

    def _wake(self):
        try:
            os.write(self._wake_w, b"w")
        except OSError:                  # full (a wake-up is pending anyway) or closed
            pass

    def _on_pending(self, link):
        with self._lock:
            self._pending.add(link)
        self._wake()

    def _loop(self):
        try:
            while not self._closing:
                for key, events in self._selector.select():
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                    else:
                        self._serve(key.data, events)
                with self._lock:
                    pending, self._pending = self._pending, set()
                for link in pending:
                    if link in self._links and link.pending():
                        self._selector.modify(link.sock, selectors.EVENT_READ |
                                              selectors.EVENT_WRITE, link)
        finally:
            for link in list(self._links):
                self._drop(link)
            self._selector.close()
            self._sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _accept(self):
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not _same_user(sock):
                sock.close()
                continue
            link = Link(sock, None, self._parse)
            link.on_pending = self._on_pending
            self._links.add(link)
            self._selector.register(sock, selectors.EVENT_READ, link)

    def _serve(self, link, events):
        try:
            if events & selectors.EVENT_READ:
                for header, arrays in link._reader.read(link.sock):
                    self._on_message(header, arrays, link)
            if link.flush() and events & selectors.EVENT_WRITE:
                self._selector.modify(link.sock, selectors.EVENT_READ, link)
        except LinkClosed:
            self._drop(link)
        except Exception as e:           # a header that cannot be a member's: the link is unusable
            self._on_error(e)
            self._drop(link)

    def _drop(self, link):
        self._links.discard(link)
        try:
            self._selector.unregister(link.sock)
        except (KeyError, ValueError):
            pass
        link.open = False
        with link.lock:
            link._drop_queue()
        link.sock.close()

    def close(self):
        self._closing = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(5)


def _same_user(sock):
    """Whether the process at the other end runs as this user (Linux SO_PEERCRED)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.geteuid()
