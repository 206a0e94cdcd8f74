"""The Transport interface and its ZeroMQ implementation, with CURVE.

`Transport` is the small interface (bind, connect, send, receive/next, close) the rest of `dist`
uses, after ps-lite's Van; `ZmqTransport` is the ZeroMQ implementation, so another transport could
be added beside it. This file holds the transport's set-up (sockets, CURVE, connections) and its
sending; what happens to a message once it arrives is in zmq_receive.py, and the choice of a
one-host path for a message in zmq_onehost.py (both are base classes of ZmqTransport).

Why it is shaped this way:
- Each process has ONE incoming socket (a PULL "inbox"; the coordinator's is a ROUTER) owned by a
  receive thread that files messages in a Mailbox keyed by (type, key, iteration); sync threads
  wait there with a deadline.
- Outgoing sockets (a PUSH per peer, a DEALER to the coordinator) are used by several sync threads;
  ZeroMQ sockets are not thread-safe, so each has its own lock. Large frames go with copy=False and
  a tracker; a caller waits on the receipt before it reuses the buffer.
- Between processes of a job the sockets are CURVE-authenticated and encrypted (security.py),
  except on the one-host paths, which the file system protects instead (onehost/).
- With --priority (scheduler.py) every message to a peer goes through that peer's sender thread,
  which hands its slices to the socket lower layer first, with a window of bytes in flight; the
  direct links are then off (a link belongs to the thread that sends on it).
- Worker 0 and the coordinator share a process (dist/job/session.py): their messages to each other
  (the loss allreduce of every iteration, heartbeats, barriers) are handed from one transport to
  the other in the process (`attach_local`), decoded, checked and filed as if received, instead of
  crossing two ZeroMQ I/O threads, CURVE and a receive thread each way.
"""
import json
import struct
import threading
import time

import numpy
import zmq

from ..job import security
from ..errors import AbortError, DeadlineError, DistError
from ..job.roles import COORDINATOR
from . import slices
from .bandwidth import TokenBucket
from .mailbox import Mailbox
from .scheduler import WINDOW_SLICES, PeerScheduler, current_priority
from .rules import DecodingOnly
from .wire import FLAG_JSON, FLAG_SHARED, Msg, Receipt, encode_header
from .zmq_onehost import ZmqOneHost
from .zmq_receive import ZmqReceiveSide

ZERO_COPY_BYTES = 64 * 1024            # frames at least this big are sent with copy=False + tracker


class Transport:
    """The interface the rest of `dist` uses. Ranks are integers; COORDINATOR (-1) is the
    coordinator service. Implementations: ZmqTransport."""

    def bind(self, host):
        raise NotImplementedError

    def connect(self, rank, address):
        raise NotImplementedError

    def send(self, dest, mtype, iteration=0, key=0, aux=0, arrays=(), obj=None, shared=False):
        raise NotImplementedError

    def receive(self, mtype, key, iteration, count=1, timeout=None, what=None, senders=None,
                spin=0.0):
        raise NotImplementedError

    def next(self, timeout=None):
        raise NotImplementedError

    def close(self, linger=1.0):
        raise NotImplementedError


class ZmqTransport(ZmqOneHost, ZmqReceiveSide, Transport):
    """ZeroMQ: a PULL inbox (ROUTER for the coordinator), a PUSH per peer, a DEALER to the
    coordinator; a receive thread; counters of payload and header bytes sent and received."""

    def __init__(self, rank, namer=None, timeout=30.0, bandwidth=None, router=False,
                 heartbeat=1.0, lost_after=10.0, name=None, keys=None, rules=None,
                 local_ipc=False, direct_links=None, shared_memory=False,
                 slice_bytes=slices.DEFAULT_SLICE_BYTES, priority=None, credit_bytes=None):
        self.rank = rank
        self._namer = namer or (lambda r: "the coordinator" if r == COORDINATOR else f"rank {r}")
        self.name = name or self._namer(rank)
        self.timeout = float(timeout)
        self.ctx = zmq.Context(io_threads=1)
        self.keys = keys
        self.gatekeeper = security.Gatekeeper(self.ctx, keys) if keys is not None else None
        self._inbox = self.ctx.socket(zmq.ROUTER if router else zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self.slice_bytes = int(slice_bytes)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, slices.inbox_limit(self.slice_bytes))
        # priority: 'on' (lower layers first), 'off' (arrival order) or None (no sender threads)
        self.priority = None if router else priority
        self.credit_bytes = int(credit_bytes or WINDOW_SLICES * self.slice_bytes)
        self._senders = {}                           # rank -> its PeerScheduler (with priority)
        self.slice_log = None                        # fn(peer, slice, start, end): --timeline
        if self.priority is not None:
            direct_links = False
        self._init_one_host(router, local_ipc, direct_links, shared_memory)
        self.routes = {}                             # rank -> 'ipc' or 'tcp'
        self.rules = rules if rules is not None else DecodingOnly()   # dist/coord/checks.py's WireRules
        self._taken = {}                             # (type, key) -> last iteration taken
        self._last_drop = {}                         # sender -> why its last message was dropped
        self._router = router
        self._out = {}                               # rank -> (socket, lock)
        self._out_lock = threading.Lock()
        self.mailbox = Mailbox(self._namer)
        self._assembler = slices.Assembler(self._check_whole)
        self.bucket = TokenBucket(bandwidth) if bandwidth else None
        self.address = None
        self.counters_lock = threading.Lock()
        self.sent_payload = self.sent_header = self.recv_payload = self.recv_header = 0
        self.sent_messages = self.recv_messages = self.dropped_messages = 0
        self.direct_sent = self.direct_received = 0  # messages that went on direct links
        self.slices_sent = self.slices_received = 0  # slices of messages larger than a slice
        self.recv_types = {}                         # type name -> messages accepted
        self.heartbeat = float(heartbeat)
        self.lost_after = float(lost_after)
        self._watched = {}                           # rank -> last time heard
        self._handlers = {}                          # type -> fn(msg) run on the receive thread
        self._local_peers = {}                       # rank -> its transport in this process
        self.on_abort = []                           # fn(error) run once when the job aborts
        self._aborted = False
        self._closing = threading.Event()
        self._thread = None
        self._beat_to_coordinator = False
        self._last_beat = 0.0
        self.handle(Msg.HEARTBEAT, lambda msg: None)
        self.handle(Msg.ABORT, self._on_abort_message)

    # ----- set-up ---------------------------------------------------------------------------------
    def bind(self, host="127.0.0.1", port=None):
        """Bind the inbox on host (a free port unless given); returns the tcp:// address peers use.

        With local_ipc the inbox is first bound on a Unix socket in a private directory
        (dist/transport/onehost/localipc.py) with ZeroMQ's NULL mechanism, and only then made a
        CURVE server for TCP: ZeroMQ copies a socket's security options into each endpoint when
        it is bound, so the one inbox takes CURVE over TCP and NULL on the Unix socket only."""
        self._bind_one_host()
        if self.keys is not None:
            security.secure_server(self._inbox, self.keys)
        bind_host = "*" if host in ("0.0.0.0", "*") else host
        if port:
            self._inbox.bind(f"tcp://{bind_host}:{port}")
            endpoint = f"tcp://{host}:{port}"
        else:
            port = self._inbox.bind_to_random_port(f"tcp://{bind_host}")
            endpoint = f"tcp://{host}:{port}"
        self.address = endpoint
        return endpoint

    def advertise(self, host):
        """The address others should use when the inbox was bound on all interfaces."""
        port = self.address.rsplit(":", 1)[1]
        self.address = f"tcp://{host}:{port}"
        return self.address

    def connect(self, rank, address, local=None):
        """An outgoing socket to `rank` (a PUSH to its inbox, or a DEALER to the coordinator):
        to the Unix socket `local` describes when localipc.reachable admits it (same host, this
        user; no CURVE), else to the TCP address (CURVE unless the job is insecure)."""
        with self._out_lock:
            if rank in self._out:
                return
            ipc = self._inbox_route(local)
            sock = self.ctx.socket(zmq.DEALER if rank == COORDINATOR else zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout * 1000))
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, slices.inbox_limit(self.slice_bytes))
            if rank == COORDINATOR:
                sock.setsockopt(zmq.IDENTITY, struct.pack("<i", self.rank))
            if self.keys is not None and ipc is None:
                security.secure_client(sock, self.keys)
            sock.connect(ipc or address)
            self._out[rank] = (sock, threading.Lock())
            if self.priority is not None and rank != COORDINATOR:
                sock.copy_threshold = 0      # small frames too are tracked (the window)
                self._senders[rank] = PeerScheduler(
                    lambda item, rank=rank: self._put_slice(rank, item), self.credit_bytes,
                    ordered=self.priority == "on", timeout=self.timeout, name=self.name,
                    peer=self._namer(rank),
                    on_slice=lambda item, start, end, rank=rank: self._slice_sent(
                        rank, item, start, end))
            self.routes[rank] = "ipc" if ipc else "tcp"
            if ipc:
                self._note_direct_link(rank, local)

    def connected(self, rank):
        return rank in self._out

    def handle(self, mtype, fn):
        """Run fn(msg) on the receive thread for this message type instead of filing it."""
        self._handlers[mtype] = fn

    def attach_local(self, rank, peer):
        """From now on hand messages for `rank` to `peer`, its transport in this same process,
        without sockets. Why: worker 0 and the coordinator share a process, and the loss they
        reduce every iteration would otherwise cross two I/O threads, CURVE and two receive
        threads to go nowhere, taking CPU from training every iteration. Attach before the first
        message to `rank`, so none overtakes another."""
        self._local_peers[rank] = peer

    def watch(self, rank):
        """Fail every waiter if nothing arrives from `rank` for `lost_after` seconds."""
        self._watched[rank] = time.monotonic()

    def unwatch(self, rank):
        self._watched.pop(rank, None)

    def silent_ranks(self, now=None):
        """The watched ranks heard from longer than `lost_after` seconds ago, in rank order."""
        now = time.monotonic() if now is None else now
        return sorted(r for r, seen in list(self._watched.items()) if now - seen > self.lost_after)

    def drop_notes(self, ranks):
        """One line for each of `ranks` whose last message this transport dropped, saying why."""
        with self.counters_lock:
            return [f"{self.name} dropped {self._namer(s)}'s last message: {self._last_drop[s]}"
                    for s in ranks if s in self._last_drop]

    def beat_to_coordinator(self, on=True):
        self._beat_to_coordinator = on

    def start(self):
        self._thread = threading.Thread(target=self._loop, name=f"recv-{self.rank}", daemon=True)
        self._thread.start()

    # ----- sending ----------------------------------------------------------------------------------
    def send(self, dest, mtype, iteration=0, key=0, aux=0, arrays=(), obj=None, shared=False):
        """Send arrays (numpy, contiguous) and/or a JSON-able obj; returns a Receipt.

        Frames of at least ZERO_COPY_BYTES go zero-copy: wait on the receipt before changing them.
        A message of more than the slice size goes in slices (dist/transport/slices.py), counted
        as one message. shared: a KV push or answer whose arrays are in the server's shared
        memory (no arrays)."""
        flags = FLAG_SHARED if shared else 0
        arrays = list(arrays)
        if obj is not None:
            text = json.dumps(obj).encode("utf-8")
            if len(text) > slices.MAX_JSON_BYTES:
                raise DistError(f"{self.name}: {Msg(mtype).name} to {self._namer(dest)} carries "
                                f"{len(text)} bytes of JSON, more than a process takes "
                                f"({slices.MAX_JSON_BYTES})")
            arrays.insert(0, numpy.frombuffer(text, numpy.uint8))
            flags |= FLAG_JSON
        arrays = [numpy.ascontiguousarray(a) for a in arrays]
        header = encode_header(mtype, self.rank, int(iteration), int(key), int(aux), arrays, flags)
        payload = sum(a.nbytes for a in arrays)
        peer = self._local_peers.get(dest)
        if peer is not None:             # no network between them: no bandwidth cap either
            peer._take_in_local(header, [a.copy() for a in arrays])
            return self._count_sent(payload, header, (), dest, mtype)
        size = self.slice_bytes if dest != COORDINATOR else min(self.slice_bytes,
                                                                 slices.DEFAULT_SLICE_BYTES)
        sender = self._senders.get(dest)
        if sender is not None:
            return self._schedule(sender, dest, (mtype, key, iteration), header, arrays,
                                  payload, size)
        if payload <= size:
            trackers = self._put(dest, mtype, header, arrays, key, iteration, payload)
            return self._count_sent(payload, header, trackers, dest, mtype)
        trackers, headers = [], 0
        parts = slices.cut(header, arrays, size)
        for head, part in parts:
            trackers += self._put(dest, mtype, head, [part], key, iteration, part.nbytes)
            headers += len(head)
        with self.counters_lock:
            self.slices_sent += len(parts)
        return self._count_sent(payload, headers, trackers, dest, mtype)

    def _schedule(self, sender, dest, message, header, arrays, payload, size):
        """Queue a message's slices on dest's sender at this thread's priority; its Receipt,
        done once every slice has left. Frames ZeroMQ would copy are copied now (the caller may
        change them as soon as send returns, as it may today); larger ones are sent from the
        caller's arrays, which it leaves alone until the receipt is done, as for any zero-copy
        frame."""
        def kept(a):
            return a if a.nbytes >= ZERO_COPY_BYTES else a.copy()
        if payload <= size:
            parts = [(header, [kept(a) for a in arrays], payload + len(header))]
        else:
            parts = [(head, [kept(part)], part.nbytes + len(head))
                     for head, part in slices.cut(header, arrays, size)]
            with self.counters_lock:
                self.slices_sent += len(parts)
        handover = sender.submit(current_priority(), parts, message)
        return self._count_sent(payload, sum(len(head) for head, _, _ in parts), [handover],
                                dest, message[0])

    def _put_slice(self, dest, item):
        """A sender thread's send of one queued slice (the cap's tokens taken here, so that the
        cap orders the wire as the scheduler does)."""
        if self.bucket is not None:
            self.bucket.consume(item.nbytes)
        return self._put_socket(dest, item.mtype, item.header, item.frames, track_all=True)

    def _slice_sent(self, dest, item, start, end):
        log = self.slice_log
        if log is not None:
            log(self._namer(dest), item, start, end)

    def _put(self, dest, mtype, header, arrays, key, iteration, payload):
        """Send one message (or slice) on a direct link or the socket to dest; its trackers."""
        if self.bucket is not None:
            self.bucket.consume(payload + len(header))
        written = self._send_direct(dest, mtype, header, arrays, key, iteration, payload)
        if written is not None:
            return list(written)
        return self._put_socket(dest, mtype, header, arrays)

    def _put_socket(self, dest, mtype, header, arrays, track_all=False):
        """Send one message (or slice) on the socket to dest; its trackers. track_all: every
        frame but the header goes zero-copy with a tracker (a sender thread's window counts
        what ZeroMQ still holds; the frames are its own copies or the caller's large arrays)."""
        try:
            sock, lock = self._out[dest]
        except KeyError:
            raise DistError(f"{self.name} has no connection to {self._namer(dest)}") from None
        trackers = []
        try:
            with lock:
                last = len(arrays)
                sock.send(header, zmq.SNDMORE if last else 0, copy=True)
                for i, a in enumerate(arrays):
                    more = zmq.SNDMORE if i < last - 1 else 0
                    if a.nbytes >= ZERO_COPY_BYTES or (track_all and a.nbytes):
                        t = sock.send(memoryview(a.reshape(-1)).cast("B"), more, copy=False,
                                      track=True)
                        trackers.append(t)
                    else:
                        sock.send(a.tobytes(), more, copy=True)
        except zmq.Again:
            raise DeadlineError(f"{self.name} could not send {Msg(mtype).name} to "
                                f"{self._namer(dest)} within {self.timeout:g} s: is it still "
                                f"running?") from None
        return trackers

    def _count_sent(self, payload, header, trackers, dest, mtype):
        header_bytes = header if isinstance(header, int) else len(header)
        with self.counters_lock:
            self.sent_payload += payload
            self.sent_header += header_bytes
            self.sent_messages += 1
        what = (f"{self.name}'s {Msg(mtype).name} to {self._namer(dest)}" if trackers else None)
        return Receipt(payload, header_bytes, trackers, self.timeout, what,
                       stopped=lambda: self.mailbox.error)

    # ----- receiving ----------------------------------------------------------------------------------
    def receive(self, mtype, key=0, iteration=0, count=1, timeout=None, what=None, senders=None,
                spin=0.0):
        """Wait (deadline: timeout, default --timeout) for `count` messages of (type, key, it).
        `spin`: seconds the wait may look at a direct link without sleeping (a thread with
        nothing else to do; onehost.SPIN_SECONDS).

        A deadline error also tells why the last message from an awaited sender was dropped
        (a shape or dtype that disagrees with this process's is reported naming both)."""
        try:
            got = self.mailbox.take(mtype, key, iteration, count,
                                    self.timeout if timeout is None else timeout, what, senders,
                                    self._pump_for(mtype, key, iteration, spin))
        except DeadlineError as e:
            notes = self.drop_notes(senders or [])
            if notes:
                raise DeadlineError(f"{e}; {'; '.join(notes)}") from None
            raise
        k = (mtype, key)
        with self.counters_lock:
            if self._taken.get(k, iteration - 1) < iteration:
                self._taken[k] = iteration
        return got

    def set_book(self, book):
        """Check the shapes of what arrives against the book from now on (workers)."""
        self.rules.set_book(book)

    def next(self, timeout=None):
        return self.mailbox.next(timeout)

    def set_fifo(self, types):
        self.mailbox.set_fifo(types)

    def fail(self, error):
        """Make every present and future wait raise `error` (and run the on_abort hooks once);
        what the sender threads still hold is dropped, failing with it."""
        self.mailbox.fail(error)
        for sender in list(self._senders.values()):
            sender.fail(error)
        if not self._aborted:
            self._aborted = True
            for fn in list(self.on_abort):
                try:
                    fn(error)
                except Exception:   # pragma: no cover - a hook must not stop the others
                    pass

    @property
    def error(self):
        return self.mailbox.error

    def _on_abort_message(self, msg):
        reason = (msg.obj or {}).get("reason", "the job was aborted")
        self.fail(AbortError(reason))

    # ----- closing ---------------------------------------------------------------------------------
    def counters(self):
        with self.counters_lock:
            return {"sent_payload": self.sent_payload, "sent_header": self.sent_header,
                    "recv_payload": self.recv_payload, "recv_header": self.recv_header,
                    "sent_messages": self.sent_messages, "recv_messages": self.recv_messages,
                    "dropped_messages": self.dropped_messages,
                    "direct_messages": {"sent": self.direct_sent,
                                        "received": self.direct_received},
                    "slices": {"sent": self.slices_sent, "received": self.slices_received},
                    "send_order": self._send_order(),
                    "received_by_type": dict(self.recv_types),
                    "refused_connections": self.gatekeeper.refused if self.gatekeeper else 0,
                    "admitted_connections": self.gatekeeper.admitted if self.gatekeeper else 0,
                    "routes": {self._namer(r): how for r, how in sorted(self.routes.items())}}

    def _send_order(self):
        """--priority as this process ran it: the order, the window, the most bytes in flight."""
        if self.priority is None:
            return {"order": "arrival, no sender threads"}
        return {"order": "lower layers first" if self.priority == "on" else "arrival",
                "window_bytes": self.credit_bytes,
                "peak_in_flight_bytes": max((s.peak_inflight for s in self._senders.values()),
                                            default=0)}

    def close(self, linger=1.0):
        """Stop the receive thread and close the sockets; `linger` seconds to flush what is queued
        (the sender threads' queues first, then ZeroMQ's)."""
        self._remove_inbox_folder()         # first: nothing below may keep the folder behind
        deadline = time.monotonic() + linger
        for sender in list(self._senders.values()):
            sender.close(max(0.0, deadline - time.monotonic()))
        self._closing.set()
        self._close_links()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        with self._out_lock:
            for sock, lock in self._out.values():
                sock.setsockopt(zmq.LINGER, int(linger * 1000))
                sock.close()
            self._out.clear()
        self._inbox.close(0)
        if self.gatekeeper is not None:
            self.gatekeeper.stop()
        self.ctx.term()
