"""Messages between the processes of a job, over ZeroMQ.

Why it is shaped this way:
- Every message is one small binary header (struct: type, sender rank, iteration, key, aux, and for
  each array its dtype code and shape) followed by one frame per array, sent zero-copy. Parameters
  and factors are never pickled or turned into protobuf lists (the released Poseidon did that), and
  the header bytes are counted apart from the payload bytes, so the measured payload can be checked
  against what the cost model says a scheme must move.
- Each process has ONE incoming socket (a PULL "inbox"; the coordinator's is a ROUTER) owned by a
  receive thread that files messages in mailboxes keyed by (type, key, iteration). Sync threads
  wait on their mailbox with a deadline, so a lost or diverging peer gives an error that names what
  was awaited and from whom, not a silent hang (Horovod's most common complaint).
- Outgoing sockets (a PUSH per peer, a DEALER to the coordinator) are used by several sync threads;
  ZeroMQ sockets are not thread-safe, so each has its own lock. Large frames go with copy=False and
  a tracker; a caller waits on the receipt before it reuses the buffer.
- The receive thread also beats the heart: it sends a heartbeat to the coordinator and watches
  that it hears from the coordinator, and an ABORT from the coordinator fails every waiter at once.
- Between processes of one host, a worker's KV push of up to 1 MB and the server's answer go on
  a direct link instead (dist/directlink.py): a Unix socket of the pushing thread's own, which that
  thread reads itself while it waits for the answer, so neither ZeroMQ's I/O threads nor the
  receive thread are woken. Messages on links get the same checks, counters and handlers.
- Worker 0 and the coordinator share a process (dist/session.py): their messages to each other
  (the loss allreduce of every iteration, heartbeats, barriers) are handed from one transport to
  the other in the process (`attach_local`), decoded, checked and filed as if received, instead of
  crossing two ZeroMQ I/O threads, CURVE and a receive thread each way.
- `Transport` is the small interface (bind, connect, send, receive/next, close) the rest of `dist`
  uses; `ZmqTransport` is the ZeroMQ implementation, so another transport could be added.
"""
import enum
import json
import logging
import re
import socket
import struct
import sys
import threading
import time
from collections import defaultdict, deque

import numpy
import zmq

from . import directlink, kvshm, localipc, security
from .errors import AbortError, DeadlineError, DistError
from .roles import COORDINATOR


class Msg(enum.IntEnum):
    # coordinator service
    REGISTER = 1
    BOOK = 2
    BARRIER = 3
    BARRIER_DONE = 4
    ALLREDUCE = 5
    ALLREDUCE_DONE = 6
    GATHER = 7
    GATHER_DONE = 8
    HEARTBEAT = 9
    ABORT = 10
    FAILED = 11
    DONE = 12
    QUERY = 13
    QUERY_REPLY = 14
    # KV store
    KV_INIT = 20
    KV_INIT_DONE = 21
    KV_INIT_ACK = 22
    KV_PUSH = 23
    KV_VALUE = 24
    KV_GET = 25
    KV_GET_REPLY = 26
    KV_SHUTDOWN = 27
    # worker to worker
    SF = 30            # sufficient factors of one layer (SFB)
    WEIGHTS = 31       # worker 0's parameters (and SFB solver state) to the other workers
    CURSOR = 32        # worker 0 -> worker r: r's data cursor from a snapshot being resumed


FLAG_JSON = 1          # the first array is a UTF-8 JSON object (control messages)
FLAG_SHARED = 2        # a KV push or answer whose arrays are in the server's shared memory
                       # (dist/kvshm.py): the message is its header alone

_FIXED = struct.Struct("<BBhqiiH")     # type, flags, sender, iteration, key, aux, number of arrays
_ARRAY = struct.Struct("<BB")          # dtype code, ndim (then ndim uint32 dims)
_DTYPES = [numpy.dtype(t) for t in ("float32", "float64", "float16", "int32", "int64", "uint8")]
_CODES = {dt: i for i, dt in enumerate(_DTYPES)}
_KNOWN_TYPES = frozenset(int(m) for m in Msg)
_BY_VALUE = {int(m): m for m in Msg}   # a dict lookup, not Msg(value) (the enum call is slow)
_NAMES = {m: m.name for m in Msg}
MAX_ARRAYS = 64                        # more arrays, or more dimensions, than any message has
MAX_NDIM = 8
ZERO_COPY_BYTES = 64 * 1024            # frames at least this big are sent with copy=False + tracker
FIXED_HEADER_BYTES = _FIXED.size
LOGGED_DROPS = 20                      # dropped messages logged one by one; then at 100, 1000, ...
_LOG_AT = frozenset(10 ** k for k in range(2, 13))
FUTURE_WINDOW = 1000                   # iterations ahead of the last taken a message may be


_SPEC_BYTES = {}                       # (dtype, shape) -> its bytes in a header


def _spec_bytes(dtype, shape):
    k = (dtype, shape)
    b = _SPEC_BYTES.get(k)
    if b is None:
        try:
            code = _CODES[dtype]
        except KeyError:
            raise TypeError(f"cannot send arrays of dtype {dtype}") from None
        b = _ARRAY.pack(code, len(shape))
        if shape:
            b += struct.pack(f"<{len(shape)}I", *shape)
        if len(_SPEC_BYTES) < 4096:
            _SPEC_BYTES[k] = b
    return b


def encode_header(mtype, sender, iteration, key, aux, arrays, flags=0):
    """The header of a message (the array descriptions of a (dtype, shape) are built once)."""
    head = _FIXED.pack(int(mtype), flags, sender, iteration, key, aux, len(arrays))
    if not arrays:
        return head
    return head + b"".join([_spec_bytes(a.dtype, a.shape) for a in arrays])


class BadMessage(ValueError):
    """A received message that cannot be what a member sends; it is dropped, logged and counted."""


_SPEC_CACHE = {}                       # (arrays, header tail) -> specs, for headers seen before
_SPEC_CACHE_SIZE = 4096                # a bound, so no sender can make it grow for ever


def decode_header(buf):
    """Header fields and the (dtype, shape) of each array; BadMessage for a header that is
    truncated, too long, of an unknown type or flag, or with an impossible array description.

    The array descriptions of a (type, key) are the same every iteration, so the parse of a header
    tail already seen valid is looked up instead of redone (the fixed part is checked each time)."""
    if len(buf) < _FIXED.size:
        raise BadMessage(f"truncated header ({len(buf)} bytes, at least {_FIXED.size} needed)")
    mtype, flags, sender, iteration, key, aux, n = _FIXED.unpack_from(buf, 0)
    if mtype not in _KNOWN_TYPES:
        raise BadMessage(f"unknown message type {mtype}")
    if flags & ~(FLAG_JSON | FLAG_SHARED):
        raise BadMessage(f"unknown flags 0x{flags:02x}")
    tail = (n, buf[_FIXED.size:])
    specs = _SPEC_CACHE.get(tail)
    if specs is None:
        specs = _decode_specs(buf, n)
        if len(_SPEC_CACHE) < _SPEC_CACHE_SIZE:
            _SPEC_CACHE[tail] = specs
    return mtype, flags, sender, iteration, key, aux, specs


def _decode_specs(buf, n):
    if n > MAX_ARRAYS:
        raise BadMessage(f"declares {n} arrays (at most {MAX_ARRAYS})")
    off = _FIXED.size
    specs = []
    for i in range(n):
        if off + _ARRAY.size > len(buf):
            raise BadMessage(f"truncated header (array {i} of {n} is cut off)")
        code, ndim = _ARRAY.unpack_from(buf, off)
        off += _ARRAY.size
        if code >= len(_DTYPES):
            raise BadMessage(f"array {i} has unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise BadMessage(f"array {i} declares {ndim} dimensions (at most {MAX_NDIM})")
        if off + 4 * ndim > len(buf):
            raise BadMessage(f"truncated header (the shape of array {i} is cut off)")
        shape = struct.unpack_from(f"<{ndim}I", buf, off) if ndim else ()
        off += 4 * ndim
        specs.append((_DTYPES[code], tuple(shape)))
    if off != len(buf):
        raise BadMessage(f"{len(buf) - off} bytes after the end of the header")
    return tuple(specs)


class Message:
    """A received message: header fields, arrays (views over frames this process owns), sizes."""

    __slots__ = ("type", "sender", "iteration", "key", "aux", "arrays", "obj", "header_bytes",
                 "payload_bytes", "received_at", "shared")

    def __init__(self, mtype, sender, iteration, key, aux, arrays, obj, header_bytes,
                 payload_bytes, shared=False):
        self.type = _BY_VALUE.get(mtype, mtype)
        self.shared = shared             # its arrays are in the server's shared memory
        self.sender, self.iteration, self.key, self.aux = sender, iteration, key, aux
        self.arrays, self.obj = arrays, obj
        self.header_bytes, self.payload_bytes = header_bytes, payload_bytes
        self.received_at = time.time()

    def __repr__(self):
        return (f"Message({getattr(self.type, 'name', self.type)}, from {self.sender}, "
                f"it {self.iteration}, key {self.key}, {len(self.arrays)} arrays)")


def _link_specs(head):
    """The (dtype, shape) of each array a direct link's header declares."""
    return decode_header(head)[6]


def _message(head, mtype, flags, sender, iteration, key, aux, arrays, payload):
    """The Message of decoded header fields and arrays (the JSON object taken out of them)."""
    obj = None
    if flags & FLAG_JSON:
        if not arrays or arrays[0].dtype != numpy.uint8 or arrays[0].ndim != 1:
            raise BadMessage(f"{Msg(mtype).name}: the JSON flag is set but the first array "
                             f"is not bytes")
        try:
            obj = json.loads(bytes(arrays.pop(0)).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise BadMessage(f"{Msg(mtype).name}: unreadable JSON ({e})") from None
    return Message(mtype, sender, iteration, key, aux, arrays, obj, len(head), payload,
                   bool(flags & FLAG_SHARED))


class Receipt:
    """What one send cost (payload and header bytes apart) and the trackers of zero-copy frames."""

    __slots__ = ("payload_bytes", "header_bytes", "trackers")

    def __init__(self, payload_bytes=0, header_bytes=0, trackers=()):
        self.payload_bytes, self.header_bytes, self.trackers = payload_bytes, header_bytes, trackers

    def wait(self, timeout=None):
        """Block until ZeroMQ no longer needs the sent buffers (so they may be overwritten)."""
        for t in self.trackers:
            t.wait(-1 if timeout is None else timeout)
        self.trackers = ()


# ------------------------------------------------------------------------------------------------
# rate cap
# ------------------------------------------------------------------------------------------------
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH = re.compile(r"^([0-9.]+(?:e[0-9]+)?)\s*([kKmMgGtT]?)(bit|bits|b|bps|bE|be|B|byte|bytes)?(?:/s|ps)?$")


def parse_bandwidth(text):
    """'1Gbit', '10GbE', '500Mbit/s', '1e9' (bits/s), '125MB' or '125MB/s' (bytes) -> bytes per second.

    A lower-case b (or 'bit') means bits, an upper-case B (or 'byte') bytes, as network people write."""
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        return float(text) / 8
    m = _BANDWIDTH.match(str(text).strip())
    if not m:
        raise ValueError(f"cannot read the bandwidth '{text}': give e.g. 1Gbit, 100Mbit, 10GbE or 125MB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    unit = m.group(3) or "bit"
    if value <= 0:
        raise ValueError(f"the bandwidth must be positive, got '{text}'")
    return value if unit in ("B", "byte", "bytes") else value / 8


class TokenBucket:
    """A send-rate cap for experiments (`--bandwidth`): senders take tokens (bytes) before sending."""

    def __init__(self, bytes_per_second, burst=None):
        self.rate = float(bytes_per_second)
        self.capacity = float(burst or max(self.rate / 100, 64 * 1024))   # 10 ms worth
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def consume(self, n):
        with self.lock:       # one sender at a time keeps the order of who waits fair and simple
            while True:
                now = time.monotonic()
                self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= min(n, self.capacity):
                    self.tokens -= n     # may go negative for a big frame: the debt is waited off
                    return
                time.sleep((min(n, self.capacity) - self.tokens) / self.rate)


# ------------------------------------------------------------------------------------------------
# mailboxes
# ------------------------------------------------------------------------------------------------
class Mailbox:
    """Messages filed by (type, key, iteration) for the threads that wait on them; some types
    (the ones a server or the coordinator serves in arrival order) go to one FIFO queue instead.

    One lock, but a condition per awaited key: a message wakes only the thread waiting for its
    key (or the FIFO reader), not every sync thread of the worker (a notify_all on one shared
    condition woke all of them for each of the iteration's messages)."""

    def __init__(self, namer):
        self._lock = threading.Lock()
        self._boxes = defaultdict(list)
        self._fifo = deque()
        self._fifo_types = frozenset()
        self._fifo_cond = threading.Condition(self._lock)
        self._waiting = {}            # key -> [condition, number of waiters]
        self._error = None
        self._namer = namer
        self.owner = None             # this process's name, for the stall inspector's lines
        self.stall_warning = 0.0      # seconds between stall lines (0: never); the session sets it

    def _wake_all(self):
        self._fifo_cond.notify_all()
        for cond, _ in self._waiting.values():
            cond.notify_all()

    def set_fifo(self, types):
        """Serve these types in arrival order (messages already filed move to the queue)."""
        with self._lock:
            self._fifo_types = frozenset(types)
            early = [m for k in list(self._boxes) if k[0] in self._fifo_types
                     for m in self._boxes.pop(k)]
            early.sort(key=lambda m: m.received_at)
            self._fifo.extend(early)
            self._wake_all()

    def put(self, msg):
        with self._lock:
            if msg.type in self._fifo_types:
                self._fifo.append(msg)
                self._fifo_cond.notify_all()
            else:
                k = (msg.type, msg.key, msg.iteration)
                self._boxes[k].append(msg)
                waiting = self._waiting.get(k)
                if waiting is not None:
                    waiting[0].notify_all()

    def fail(self, error):
        with self._lock:
            if self._error is None:
                self._error = error
            self._wake_all()

    @property
    def error(self):
        return self._error

    def take(self, mtype, key, iteration, count=1, timeout=30.0, what=None, senders=None,
             pump=None):
        """Wait for `count` messages of (type, key, iteration); returns them sorted by sender.

        pump(seconds), when given, is how this thread waits instead of sleeping on a condition:
        it reads and files what arrives on a direct link (dist/directlink.py) for at most that
        long, and returns False once the link is gone (the wait goes on as a plain one).

        On the deadline raises DeadlineError naming `what` and the senders that did not answer.
        Every `stall_warning` seconds of waiting (an attribute the session sets; 0: never) it logs
        one line naming what is awaited and from whom (the stall inspector)."""
        k = (mtype, key, iteration)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        stall = self.stall_warning or 0
        warn_at = start + stall

        def awaited(box):            # (what, from whom) for the deadline error and stall lines
            have = {m.sender for m in (box or [])}
            missing = [s for s in (senders or []) if s not in have]
            return (what or f"{Msg(mtype).name} key {key} iteration {iteration}",
                    ", ".join(self._namer(s) for s in missing) if missing
                    else f"{count - len(have)} sender(s)")

        with self._lock:
            cond = None
            try:
                while True:
                    if self._error is not None:
                        raise self._error
                    box = self._boxes.get(k)
                    if box is not None and len(box) >= count:
                        got = box[:count]
                        del box[:count]
                        if not box:
                            del self._boxes[k]
                        got.sort(key=lambda m: m.sender)
                        return got
                    now = time.monotonic()
                    left = None if deadline is None else deadline - now
                    if left is not None and left <= 0:
                        label, source = awaited(box)
                        raise DeadlineError(f"timed out after {timeout:g} s waiting for {label} "
                                            f"from {source} (raise --timeout if the peers are "
                                            f"just slow)")
                    if stall and now >= warn_at:
                        warn_at = now + stall
                        where = ("" if COORDINATOR in (senders or [])
                                 else f"iteration {iteration}: ")
                        got = f"; got {len(box or [])} of {count}" if count > 1 else ""
                        label, source = awaited(box)
                        logging.getLogger("poseidon").warning(
                            f"{self.owner or 'this process'}: {where}waiting "
                            f"{now - start:.0f} s for {label} from {source}{got}")
                    if pump is not None:
                        self._lock.release()
                        try:
                            if not pump(0.1 if left is None else min(left, 0.1)):
                                pump = None
                        finally:
                            self._lock.acquire()
                        continue
                    if cond is None:          # register as a waiter for k (put wakes only us)
                        waiting = self._waiting.get(k)
                        if waiting is None:
                            waiting = self._waiting[k] = [threading.Condition(self._lock), 0]
                        waiting[1] += 1
                        cond = waiting[0]
                    cond.wait(1.0 if left is None else min(left, 1.0))
            finally:
                if cond is not None:
                    waiting = self._waiting[k]
                    waiting[1] -= 1
                    if not waiting[1]:
                        del self._waiting[k]

    def next(self, timeout=None):
        """The next FIFO message, or None after `timeout` seconds (None: wait for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._error is not None:
                    raise self._error
                if self._fifo:
                    return self._fifo.popleft()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._fifo_cond.wait(1.0 if left is None else min(left, 1.0))


# ------------------------------------------------------------------------------------------------
# the transport
# ------------------------------------------------------------------------------------------------
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


class ZmqTransport(Transport):
    """ZeroMQ: a PULL inbox (ROUTER for the coordinator), a PUSH per peer, a DEALER to the
    coordinator; a receive thread; counters of payload and header bytes sent and received."""

    def __init__(self, rank, namer=None, timeout=30.0, bandwidth=None, router=False,
                 heartbeat=1.0, lost_after=10.0, name=None, keys=None, roles=None,
                 local_ipc=False, direct_links=None, shared_memory=False):
        from .checks import WireRules
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
        self._local_wanted = bool(local_ipc) and not router and localipc.supported()
        self.local = None                            # localipc.LocalInbox once bound
        self.local_info = None                       # what peers need to reach and verify it
        self.routes = {}                             # rank -> 'ipc' or 'tcp'
        self._direct_wanted = self._local_wanted and (direct_links is None or direct_links)
        self._listener = None                        # directlink.Listener once bound
        self._direct_paths = {}                      # rank -> its listening socket's path
        self._mine = threading.local()               # this thread's links and awaited answers
        self._links = []                             # every link this process opened
        self._answer_links = {}                      # (worker, key) -> (link, iteration of its push)
        self._shared_wanted = self._direct_wanted and shared_memory
        self.kv_memory = None                        # a server's kvshm.ServerMemory
        self._kv_infos = {}                          # server rank -> its advertised kv memory
        self._kv_segments = {}                       # server rank -> kvshm.Segment or None
        self._kv_lock = threading.Lock()             # sync threads look segments up at once
        self.rules = WireRules(rank, roles, self._namer)
        self._taken = {}                             # (type, key) -> last iteration taken
        self._last_drop = {}                         # sender -> why its last message was dropped
        self._router = router
        self._out = {}                               # rank -> (socket, lock)
        self._out_lock = threading.Lock()
        self.mailbox = Mailbox(self._namer)
        self.bucket = TokenBucket(bandwidth) if bandwidth else None
        self.address = None
        self.counters_lock = threading.Lock()
        self.sent_payload = self.sent_header = self.recv_payload = self.recv_header = 0
        self.sent_messages = self.recv_messages = self.dropped_messages = 0
        self.direct_sent = self.direct_received = 0  # messages that went on direct links
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
        (dist/localipc.py) with ZeroMQ's NULL mechanism, and only then made a CURVE server for
        TCP: ZeroMQ copies a socket's security options into each endpoint when it is bound, so
        the one inbox takes CURVE over TCP and NULL on the Unix socket only."""
        if self._local_wanted and self.local is None:
            try:
                self.local = localipc.LocalInbox()
                self._inbox.bind(self.local.endpoint)
                self.local_info = self.local.describe()
            except (OSError, zmq.ZMQError) as e:
                logging.getLogger("poseidon").warning(
                    f"{self.name}: no Unix-socket inbox ({e}); peers on this host use TCP")
                if self.local is not None:
                    self.local.close()
                self.local = self.local_info = None
        if self.local is not None and self._direct_wanted and self._listener is None:
            try:
                self._listener = directlink.Listener(self.local.direct_path, _link_specs,
                                                     self._take_in_link, self._bad_link, self.name)
                self.local_info["direct"] = localipc.socket_info(self.local.direct_path)
            except OSError as e:
                logging.getLogger("poseidon").warning(
                    f"{self.name}: no direct links ({e}); KV pushes on this host use ZeroMQ")
        roles = self.rules.roles
        if (self._listener is not None and self._shared_wanted and self.kv_memory is None and
                roles is not None and roles.is_server(self.rank)):
            self.kv_memory = kvshm.ServerMemory.make()
            if self.kv_memory is not None:
                self.local_info["kv_memory"] = self.kv_memory.describe()
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
            ipc = localipc.reachable(local) if local is not None else None
            sock = self.ctx.socket(zmq.DEALER if rank == COORDINATOR else zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout * 1000))
            sock.setsockopt(zmq.SNDHWM, 0)
            if rank == COORDINATOR:
                sock.setsockopt(zmq.IDENTITY, struct.pack("<i", self.rank))
            if self.keys is not None and ipc is None:
                security.secure_client(sock, self.keys)
            sock.connect(ipc or address)
            self._out[rank] = (sock, threading.Lock())
            self.routes[rank] = "ipc" if ipc else "tcp"
            direct = localipc.reachable_direct(local) if ipc and self._direct_wanted else None
            if direct is not None:
                self._direct_paths[rank] = direct
                if self._shared_wanted and isinstance(local.get("kv_memory"), dict):
                    self._kv_infos[rank] = local["kv_memory"]

    def kv_segment(self, server):
        """The shared memory of KV server rank `server` (dist/kvshm.py) mapped here, or None:
        its pushes then carry their arrays. Looked up once (after the start barrier, when every
        server has sized its memory for the book)."""
        with self._kv_lock:
            if server in self._kv_segments:
                return self._kv_segments[server]
            segment = None
            info, book, roles = self._kv_infos.get(server), self.rules.book, self.rules.roles
            if info is not None and book is not None and server in self._direct_paths:
                layout = kvshm.Layout(book, roles.index(server), roles.workers)
                segment = kvshm.open_segment(info, layout)
            self._kv_segments[server] = segment
            return segment

    def connected(self, rank):
        return rank in self._out

    def direct_links(self):
        """The ranks this process pushes to on direct links (dist/directlink.py)."""
        return sorted(self._direct_paths)

    def handle(self, mtype, fn):
        """Run fn(msg) on the receive thread for this message type instead of filing it."""
        self._handlers[mtype] = fn

    def attach_local(self, rank, peer):
        """From now on hand messages for `rank` to `peer`, its transport in this same process,
        without sockets. Why: worker 0 and the coordinator share a process, and the loss they
        reduce every iteration cost 0.4 ms of CPU an iteration through ZeroMQ (two I/O threads,
        CURVE, two receive threads; cifar10_quick with 1 worker and 1 server, per-thread
        schedstat). Attach before the first message to `rank`, so none overtakes another."""
        self._local_peers[rank] = peer

    def _take_in_local(self, head, arrays):
        """A message from a transport of this process (arrays its own copies): decoded, checked,
        counted and filed (or handled) on the sender's thread, as if it had been received."""
        if self._closing.is_set():       # as a closed socket: it is lost
            return
        try:
            msg = self._decode_link(head, arrays)
        except BadMessage as e:
            self._refuse(None, str(e))
            return
        self._file(msg)

    def watch(self, rank):
        """Fail every waiter if nothing arrives from `rank` for `lost_after` seconds."""
        self._watched[rank] = time.monotonic()

    def unwatch(self, rank):
        self._watched.pop(rank, None)

    def beat_to_coordinator(self, on=True):
        self._beat_to_coordinator = on

    def start(self):
        self._thread = threading.Thread(target=self._loop, name=f"recv-{self.rank}", daemon=True)
        self._thread.start()

    # ----- sending ----------------------------------------------------------------------------------
    def send(self, dest, mtype, iteration=0, key=0, aux=0, arrays=(), obj=None, shared=False):
        """Send arrays (numpy, contiguous) and/or a JSON-able obj; returns a Receipt.

        Frames of at least ZERO_COPY_BYTES go zero-copy: wait on the receipt before changing them.
        shared: a KV push or answer whose arrays are in the server's shared memory (no arrays)."""
        flags = FLAG_SHARED if shared else 0
        arrays = list(arrays)
        if obj is not None:
            arrays.insert(0, numpy.frombuffer(json.dumps(obj).encode("utf-8"), numpy.uint8))
            flags |= FLAG_JSON
        arrays = [numpy.ascontiguousarray(a) for a in arrays]
        header = encode_header(mtype, self.rank, int(iteration), int(key), int(aux), arrays, flags)
        payload = sum(a.nbytes for a in arrays)
        peer = self._local_peers.get(dest)
        if peer is not None:             # no network between them: no bandwidth cap either
            peer._take_in_local(header, [a.copy() for a in arrays])
            return self._count_sent(payload, header, ())
        if self.bucket is not None:
            self.bucket.consume(payload + len(header))
        link = self._link_for(dest, mtype, key, iteration, payload)
        if link is not None:
            try:
                written = self._send_on_link(link, dest, mtype, header, arrays, key, iteration)
            except directlink.LinkClosed:
                link.open = False        # ZeroMQ from now on: a peer that has really gone is
            else:                        # then found as before (heartbeats, the coordinator)
                with self.counters_lock:
                    self.direct_sent += 1
                return self._count_sent(payload, header, written)
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
                    if a.nbytes >= ZERO_COPY_BYTES:
                        t = sock.send(memoryview(a.reshape(-1)).cast("B"), more, copy=False,
                                      track=True)
                        trackers.append(t)
                    else:
                        sock.send(a.tobytes(), more, copy=True)
        except zmq.Again:
            raise DeadlineError(f"{self.name} could not send {Msg(mtype).name} to "
                                f"{self._namer(dest)} within {self.timeout:g} s: is it still "
                                f"running?") from None
        return self._count_sent(payload, header, trackers)

    def _count_sent(self, payload, header, trackers):
        with self.counters_lock:
            self.sent_payload += payload
            self.sent_header += len(header)
            self.sent_messages += 1
        return Receipt(payload, len(header), trackers)

    # ----- direct links (dist/directlink.py): a KV push and its answer, between processes of a host
    def _link_for(self, dest, mtype, key, iteration, payload):
        """The link msg goes on, or None for ZeroMQ: a push of at most directlink.MAX_BYTES goes
        on this thread's own link to a server of this host; an answer goes on the link its push
        came on, if that push was of the same iteration (the worker's thread is then reading
        that link for it)."""
        if mtype == Msg.KV_PUSH:
            path = self._direct_paths.get(dest)
            if path is None or payload > directlink.MAX_BYTES:
                return None
            links = self._thread_links()
            link = links.get(dest)
            if link is None or not link.open:
                if len(self._links) >= directlink.MAX_LINKS:
                    return None
                try:
                    link = links[dest] = directlink.Link.connect(path, dest, _link_specs)
                except OSError:
                    self._direct_paths.pop(dest, None)      # ZeroMQ from now on
                    return None
                with self._out_lock:
                    self._links.append(link)
            return link
        if mtype == Msg.KV_VALUE and self._answer_links:
            got = self._answer_links.get((dest, key))
            if got is not None and got[1] == iteration and got[0].open:
                return got[0]
        return None

    def _thread_links(self):
        mine = self._mine
        if not hasattr(mine, "links"):
            mine.links, mine.awaiting = {}, {}
        return mine.links

    def _send_on_link(self, link, dest, mtype, header, arrays, key, iteration):
        """A push is written now by this thread (which then reads its answer from the link);
        an answer is queued on the link it goes back on. Returns the trackers of the send;
        raises directlink.LinkClosed when the link has closed (the caller uses ZeroMQ)."""
        try:
            if mtype != Msg.KV_PUSH:
                return [link.post(header, arrays)]
            link.send(header, arrays, self.timeout,
                      lambda msgs: self._take_in_messages(msgs, link))
            self._mine.awaiting[key] = (link, iteration)
            return ()
        except TimeoutError:
            raise DeadlineError(f"{self.name} could not send {Msg(mtype).name} to "
                                f"{self._namer(dest)} within {self.timeout:g} s: is it still "
                                f"running?") from None

    def _take_in_messages(self, msgs, link):
        for head, arrays in msgs:
            self._take_in_link(head, arrays, link)

    def _pump_for(self, mtype, key, iteration, spin=0.0):
        """How this thread waits for (mtype, key, iteration): by reading its own link when the
        answer comes on it, else None (a plain wait). `spin`: seconds its first look may spin
        (directlink.SPIN_SECONDS)."""
        if mtype != Msg.KV_VALUE:
            return None
        awaiting = getattr(self._mine, "awaiting", None)
        if not awaiting:
            return None
        got = awaiting.get(key)
        if got is None or got[1] != iteration:
            return None
        del awaiting[key]
        link = got[0]

        def pump(seconds):
            nonlocal spin
            try:
                msgs = link.read_ready(seconds, spin)
                spin = 0.0
            except directlink.LinkClosed:   # a plain wait from now on: if the peer has gone,
                link.open = False            # heartbeats and the coordinator say so, naming
                return False                 # the process that failed first
            except Exception as e:       # a header that cannot be a member's
                self._bad_link(e)
                link.close()
                return False
            self._take_in_messages(msgs, link)
            return True
        return pump

    def _take_in_link(self, head, arrays, link):
        """A message read from a direct link: the same checks and filing as one from ZeroMQ; a
        push also names the link its answer goes back on."""
        try:
            msg = self._decode_link(head, arrays)
        except BadMessage as e:
            self._refuse(None, str(e))
            return
        if msg.type == Msg.KV_PUSH:
            self._answer_links[(msg.sender, msg.key)] = (link, msg.iteration)
        with self.counters_lock:
            self.direct_received += 1
        self._file(msg)

    def _bad_link(self, error):
        self._refuse(None, f"unreadable message on a direct link ({type(error).__name__}: "
                           f"{error}); the link is closed")

    # ----- receiving ----------------------------------------------------------------------------------
    def receive(self, mtype, key=0, iteration=0, count=1, timeout=None, what=None, senders=None,
                spin=0.0):
        """Wait (deadline: timeout, default --timeout) for `count` messages of (type, key, it).
        `spin`: seconds the wait may look at a direct link without sleeping (a thread with
        nothing else to do; directlink.SPIN_SECONDS).

        A deadline error also tells why the last message from an awaited sender was dropped
        (a shape or dtype that disagrees with this process's is reported naming both)."""
        try:
            got = self.mailbox.take(mtype, key, iteration, count,
                                    self.timeout if timeout is None else timeout, what, senders,
                                    self._pump_for(mtype, key, iteration, spin))
        except DeadlineError as e:
            with self.counters_lock:
                notes = [f"{self.name} dropped {self._namer(s)}'s last message: "
                         f"{self._last_drop[s]}" for s in (senders or []) if s in self._last_drop]
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
        """Make every present and future wait raise `error` (and run the on_abort hooks once)."""
        self.mailbox.fail(error)
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

    def _decode(self, frames):
        """A Message from the frames; BadMessage when the frames cannot be a member's message
        (header, frame count, declared sizes against the frames, JSON, sender identity)."""
        identity = None
        if self._router:
            if len(frames) < 2:
                raise BadMessage("no header frame")
            identity, frames = frames[0].bytes, frames[1:]   # the DEALER's identity
        head = frames[0].bytes
        mtype, flags, sender, iteration, key, aux, specs = decode_header(head)
        if len(frames) != 1 + len(specs):
            raise BadMessage(f"{Msg(mtype).name}: the header declares {len(specs)} arrays but "
                             f"{len(frames) - 1} frames follow")
        if identity is not None and identity != struct.pack("<i", sender):
            raise BadMessage(f"{Msg(mtype).name} says it is from {self._namer(sender)} but came "
                             f"over another rank's connection")
        arrays = []
        payload = 0
        for i, ((dtype, shape), frame) in enumerate(zip(specs, frames[1:])):
            buf = frame.buffer
            declared = dtype.itemsize
            for d in shape:
                declared *= d
            if declared != len(buf):
                raise BadMessage(f"{Msg(mtype).name}: array {i} declares {dtype.name}"
                                 f"{list(shape)} ({declared} bytes) but its frame has {len(buf)}")
            payload += len(buf)
            arrays.append(numpy.frombuffer(buf, dtype).reshape(shape))
        return _message(head, mtype, flags, sender, iteration, key, aux, arrays, payload)

    def _decode_link(self, head, arrays):
        """A Message from a direct link's (or a local peer's) header and the arrays read after it
        (their sizes are the declared ones by construction)."""
        mtype, flags, sender, iteration, key, aux, _ = decode_header(head)
        return _message(head, mtype, flags, sender, iteration, key, aux, arrays,
                        sum(a.nbytes for a in arrays))

    def drop(self, msg, reason):
        """Drop a message a handler (the KV server) found bad after the receive thread took it:
        it no longer counts as received (the counters by type count accepted messages)."""
        with self.counters_lock:
            self.recv_messages -= 1
            self.recv_payload -= msg.payload_bytes
            self.recv_header -= msg.header_bytes
            name = msg.type.name
            self.recv_types[name] = self.recv_types.get(name, 1) - 1
        self._refuse(msg, reason)

    def _refuse(self, msg, reason):
        """Count a dropped message, remember why for the deadline errors of waits on its sender,
        and log one line (the first LOGGED_DROPS of a process, then at 100, 1000, ...)."""
        sender = None if msg is None else msg.sender
        with self.counters_lock:
            self.dropped_messages += 1
            n = self.dropped_messages
            if sender is not None:
                self._last_drop[sender] = reason
        if n <= LOGGED_DROPS or n in _LOG_AT:
            who = "" if sender is None else f" from {self._namer(sender)}"
            more = (f" ({n} dropped so far; logging only at 100, 1000, ...)"
                    if n == LOGGED_DROPS else f" ({n} dropped so far)" if n > LOGGED_DROPS else "")
            print(f"{self.name}: dropped a message{who}: {reason}{more}", file=sys.stderr)

    def _admit(self, msg):
        """None if msg may be filed or handled, else why not (checks.py, then its iteration
        against what this process has already taken of (type, key))."""
        reason = self.rules.check(msg)
        if reason is not None:
            return reason
        if msg.iteration < 0:
            return f"{msg.type.name} for iteration {msg.iteration}"
        if msg.type in self._handlers or msg.type in self.mailbox._fifo_types:
            return None
        last = self._taken.get((msg.type, msg.key))
        if last is not None:
            if msg.iteration <= last:
                return (f"{msg.type.name} key {msg.key} for iteration {msg.iteration}, which "
                        f"this process has already taken (out of order or repeated)")
            if msg.iteration > last + FUTURE_WINDOW:
                return (f"{msg.type.name} key {msg.key} for iteration {msg.iteration}, "
                        f"{msg.iteration - last} ahead of the last one taken ({last})")
        return None

    def _loop(self):
        """Receive, check and file (or handle) messages; tick the heart at least every 0.1 s.

        A blocking receive with a 100 ms timeout rather than poll + non-blocking receives: a
        message costs one call, not a poll, a receive and the exception of the empty receive
        that ended each burst."""
        inbox = self._inbox
        inbox.setsockopt(zmq.RCVTIMEO, 100)
        next_tick = 0.0
        while not self._closing.is_set():
            try:
                frames = inbox.recv_multipart(copy=False)
            except zmq.Again:
                frames = None
            except zmq.ZMQError:
                return
            if frames is not None:
                self._take_in(frames)
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + 0.1
                self._tick()

    def _take_in(self, frames):
        """One received message: decode, admit, count, then hand to its handler or mailbox."""
        try:
            msg = self._decode(frames)
        except BadMessage as e:
            self._refuse(None, str(e))
            return
        except Exception as e:    # anything else unreadable: the same, said plainly
            self._refuse(None, f"unreadable ({type(e).__name__}: {e})")
            return
        self._file(msg)

    def _file(self, msg):
        """Admit, count, then hand msg to its handler or its mailbox."""
        reason = self._admit(msg)
        if reason is not None:
            self._refuse(msg, reason)
            return
        name = _NAMES[msg.type]
        with self.counters_lock:
            self.recv_payload += msg.payload_bytes
            self.recv_header += msg.header_bytes
            self.recv_messages += 1
            self.recv_types[name] = self.recv_types.get(name, 0) + 1
        if msg.sender in self._watched:
            self._watched[msg.sender] = time.monotonic()
        handler = self._handlers.get(msg.type)
        if handler is not None:
            try:
                handler(msg)
            except Exception as e:
                self.fail(e if isinstance(e, DistError) else
                          DistError(f"{self.name}: handling {msg!r} failed: {e}"))
        else:
            self.mailbox.put(msg)

    def _tick(self):
        now = time.monotonic()
        if self._beat_to_coordinator and now - self._last_beat >= self.heartbeat:
            self._last_beat = now
            try:
                self.send(COORDINATOR, Msg.HEARTBEAT)
            except DistError:
                pass
        if self.mailbox.error is None:
            for rank, seen in list(self._watched.items()):
                if now - seen > self.lost_after:
                    self.fail(AbortError(
                        f"{self.name}: lost contact with {self._namer(rank)}: nothing heard from it "
                        f"for {self.lost_after:g} s (it has probably died; see its output)"))
                    break

    # ----- closing ---------------------------------------------------------------------------------
    def counters(self):
        with self.counters_lock:
            return {"sent_payload": self.sent_payload, "sent_header": self.sent_header,
                    "recv_payload": self.recv_payload, "recv_header": self.recv_header,
                    "sent_messages": self.sent_messages, "recv_messages": self.recv_messages,
                    "dropped_messages": self.dropped_messages,
                    "direct_messages": {"sent": self.direct_sent,
                                        "received": self.direct_received},
                    "received_by_type": dict(self.recv_types),
                    "refused_connections": self.gatekeeper.refused if self.gatekeeper else 0,
                    "admitted_connections": self.gatekeeper.admitted if self.gatekeeper else 0,
                    "routes": {self._namer(r): how for r, how in sorted(self.routes.items())}}

    def close(self, linger=1.0):
        """Stop the receive thread and close the sockets; `linger` seconds to flush what is queued."""
        if self.local is not None:          # first: nothing below may keep the folder behind
            self.local.close()
        self._closing.set()
        if self._listener is not None:
            self._listener.close()
        with self._out_lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
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


# ------------------------------------------------------------------------------------------------
# addresses
# ------------------------------------------------------------------------------------------------
def free_port(host="127.0.0.1"):
    """A TCP port free right now on host (for the coordinator of a local job)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_address(address):
    """'tcp://HOST:PORT' -> (HOST, PORT)."""
    if not address.startswith("tcp://") or ":" not in address[6:]:
        raise DistError(f"--coordinator takes tcp://HOST:PORT, got '{address}'")
    host, port = address[6:].rsplit(":", 1)
    try:
        return host, int(port)
    except ValueError:
        raise DistError(f"--coordinator takes tcp://HOST:PORT, got '{address}'") from None


def interface_address(interface):
    """The IPv4 address of a network interface name (e.g. eth0), or the argument itself when it is
    already an address or a host name."""
    if not interface:
        return None
    try:
        socket.inet_aton(interface)
        return interface
    except OSError:
        pass
    try:
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915,      # SIOCGIFADDR
                                 struct.pack("256s", interface[:15].encode()))
            return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        pass
    try:
        return socket.gethostbyname(interface)
    except OSError:
        raise DistError(f"--interface '{interface}' is neither a network interface of this host "
                        f"nor an address or host name") from None


def coordinator_bind_address(host):
    """The address worker 0 binds the coordinator on: the one --coordinator names (not every
    interface), which must be an address of this machine."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        raise DistError(f"cannot resolve the coordinator host '{host}'") from None


def route_address(toward_host):
    """This host's address on the route toward `toward_host` (what peers can reach us at)."""
    try:
        target = socket.gethostbyname(toward_host)
    except OSError:
        raise DistError(f"cannot resolve the coordinator host '{toward_host}'") from None
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
