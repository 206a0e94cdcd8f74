"""The wire format of the job's messages: types, the binary header, and what a received message is.

Why it is shaped this way: every message is one small binary header (struct: type, flags, sender
rank, iteration, key, aux, and for each array its dtype code and shape) followed by one frame per
array, sent zero-copy. Parameters and factors are never pickled or turned into protobuf lists (the
released Poseidon did that), and the header bytes are counted apart from the payload bytes, so the
measured payload can be checked against what the cost model says a scheme must move.

The codec is apart from any transport: ZeroMQ frames, a direct link's byte stream and a hand-over
between two transports of one process all carry the same header, and a header that cannot be a
member's is refused the same way (BadMessage) whichever way it came.
"""
import enum
import json
import math
import struct
import time

import numpy
import zmq

from ..errors import DeadlineError


class Msg(enum.IntEnum):
    """Every message type of a job (a received type outside these is refused)."""

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
    ROUTES = 33        # worker 0 -> the other workers: the convolution routes every replica runs
    RING = 34          # one piece of a layer's gradient on the all-reduce ring, to the next worker
    # the measured cost model (dist/cost/model.py)
    PROBE = 60         # worker -> any other rank: a cost probe, answered at once
    PROBE_ECHO = 61    # the answer to a PROBE
    COSTS = 62         # worker -> coordinator: its probe, or a refresh window's sync times
    SCHEMES = 63       # coordinator -> workers: every layer's scheme from an iteration on


FLAG_JSON = 1          # the first array is a UTF-8 JSON object (control messages)
FLAG_SHARED = 2        # a KV push or answer whose arrays are in the server's shared memory
                       # (dist/transport/onehost/kvshm.py): the message is its header alone
FLAG_SLICE = 4         # one slice of a larger message (see encode_slice): one uint8 frame, and
                       # after its description where it goes in the whole and the whole's own
                       # descriptions (the receiver sizes the whole from them, checked first)

_FIXED = struct.Struct("<BBhqiiH")     # type, flags, sender, iteration, key, aux, number of arrays
_ARRAY = struct.Struct("<BB")          # dtype code, ndim (then ndim uint32 dims)
_DTYPES = [numpy.dtype(t) for t in ("float32", "float64", "float16", "int32", "int64", "uint8")]
_CODES = {dt: i for i, dt in enumerate(_DTYPES)}
_KNOWN_TYPES = frozenset(int(m) for m in Msg)
_BY_VALUE = {int(m): m for m in Msg}   # a dict lookup, not Msg(value) (the enum call is slow)
_SLICE = struct.Struct("<IHQH")        # slice size, array index, byte offset in that array,
                                       # arrays of the whole message (then their descriptions)
MAX_ARRAYS = 64                        # more arrays, or more dimensions, than any message has
MAX_NDIM = 8
MIN_SLICE_BYTES = 4096                 # fewer bytes a slice makes a message of too many slices
FIXED_HEADER_BYTES = _FIXED.size
# The most a header takes: the fixed part, a slice's frame and place, and MAX_ARRAYS descriptions
# of MAX_NDIM dimensions. A frame of more than the slice size plus this is no member's.
MAX_HEADER_BYTES = _FIXED.size + 2 * _SLICE.size + (MAX_ARRAYS + 1) * (_ARRAY.size + 4 * MAX_NDIM)


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


def encode_slice(whole_header, slice_bytes, array, offset, length):
    """The header of one slice of a message whose header is `whole_header`: the slice's `length`
    bytes are those at `offset` of the whole's array `array`, every slice but an array's last
    `slice_bytes` long (so the slices of a message are a partition its receiver can check)."""
    mtype, flags, sender, iteration, key, aux, n = _FIXED.unpack_from(whole_header, 0)
    return (_FIXED.pack(mtype, flags | FLAG_SLICE, sender, iteration, key, aux, 1) +
            _spec_bytes(_DTYPES[5], (length,)) + _SLICE.pack(slice_bytes, array, offset, n) +
            whole_header[_FIXED.size:])


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
    if flags & ~(FLAG_JSON | FLAG_SHARED | FLAG_SLICE):
        raise BadMessage(f"unknown flags 0x{flags:02x}")
    if flags & FLAG_SLICE:             # not cached: each slice's header is another
        return mtype, flags, sender, iteration, key, aux, decode_slice(buf)[0]
    tail = (n, buf[_FIXED.size:])
    specs = _SPEC_CACHE.get(tail)
    if specs is None:
        specs = _decode_specs(buf, n)[0]
        if len(_SPEC_CACHE) < _SPEC_CACHE_SIZE:
            _SPEC_CACHE[tail] = specs
    return mtype, flags, sender, iteration, key, aux, specs


def decode_slice(buf):
    """(the slice's own spec, (slice size, array index, offset, the whole's specs)) of a slice's
    header; BadMessage for one that is not a slice of a possible message."""
    n = _FIXED.unpack_from(buf, 0)[6]
    if n != 1:
        raise BadMessage(f"a slice declares {n} arrays (one: its bytes)")
    own, off = _decode_specs(buf, 1, _FIXED.size, end=False)
    if own[0][0] != _DTYPES[5] or len(own[0][1]) != 1:
        raise BadMessage("a slice's array is not bytes")
    if off + _SLICE.size > len(buf):
        raise BadMessage("truncated header (a slice's place is cut off)")
    size, array, offset, whole_n = _SLICE.unpack_from(buf, off)
    whole, _ = _decode_specs(buf, whole_n, off + _SLICE.size)
    length = own[0][1][0]
    if not MIN_SLICE_BYTES <= size or array >= whole_n or length == 0:
        raise BadMessage(f"a slice of {length} bytes, {size} per slice, of array {array} "
                         f"of {whole_n}")
    nbytes = whole[array][0].itemsize * math.prod(whole[array][1])
    if offset % size or offset + length > nbytes or length != min(size, nbytes - offset):
        raise BadMessage(f"a slice of {length} bytes at byte {offset} of array {array} "
                         f"({nbytes} bytes, {size} per slice) is not one of its slices")
    return own, (size, array, offset, whole)


def _decode_specs(buf, n, off=_FIXED.size, end=True):
    if n > MAX_ARRAYS:
        raise BadMessage(f"declares {n} arrays (at most {MAX_ARRAYS})")
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
    if not end:
        return tuple(specs), off
    if off != len(buf):
        raise BadMessage(f"{len(buf) - off} bytes after the end of the header")
    return tuple(specs), off


class Message:
    """A received message: header fields, arrays (views over frames this process owns), sizes."""

    __slots__ = ("type", "sender", "iteration", "key", "aux", "arrays", "obj", "header_bytes",
                 "payload_bytes", "received_at", "shared", "slice")

    def __init__(self, mtype, sender, iteration, key, aux, arrays, obj, header_bytes,
                 payload_bytes, shared=False, slice_of=None):
        self.type = _BY_VALUE.get(mtype, mtype)
        self.slice = slice_of            # a slice's (flags, size, array, offset, whole's specs)
        self.shared = shared             # its arrays are in the server's shared memory
        self.sender, self.iteration, self.key, self.aux = sender, iteration, key, aux
        self.arrays, self.obj = arrays, obj
        self.header_bytes, self.payload_bytes = header_bytes, payload_bytes
        self.received_at = time.time()

    def __repr__(self):
        return (f"Message({getattr(self.type, 'name', self.type)}, from {self.sender}, "
                f"it {self.iteration}, key {self.key}, {len(self.arrays)} arrays)")


def header_specs(head):
    """The (dtype, shape) of each array a header declares (what a byte-stream reader, such as a
    direct link's, must read after it)."""
    return decode_header(head)[6]


def make_message(head, mtype, flags, sender, iteration, key, aux, arrays, payload):
    """The Message of decoded header fields and arrays (the JSON object taken out of them; a
    slice's is in its whole, dist/transport/slices.py). `head`: the header, or its length."""
    header_bytes = head if isinstance(head, int) else len(head)
    if flags & FLAG_SLICE:
        _, (size, array, offset, whole) = decode_slice(head)
        return Message(mtype, sender, iteration, key, aux, arrays, None, header_bytes, payload,
                       False, (flags & ~FLAG_SLICE, size, array, offset, whole))
    obj = None
    if flags & FLAG_JSON:
        if not arrays or arrays[0].dtype != numpy.uint8 or arrays[0].ndim != 1:
            raise BadMessage(f"{Msg(mtype).name}: the JSON flag is set but the first array "
                             f"is not bytes")
        try:
            obj = json.loads(bytes(arrays.pop(0)).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise BadMessage(f"{Msg(mtype).name}: unreadable JSON ({e})") from None
    return Message(mtype, sender, iteration, key, aux, arrays, obj, header_bytes, payload,
                   bool(flags & FLAG_SHARED))


STOP_POLL_S = 0.1     # how often a wait for a receipt asks whether the transport has stopped


class Receipt:
    """What one send cost (payload and header bytes apart) and the trackers of zero-copy frames.

    Why a deadline: a zero-copy frame is done only once the receiver has read it, and a receiver
    that is stopped (SIGSTOP) or gone never reads; a wait without one would stop the waiting
    thread for ever (a KV server's receive thread then stops beating and serving). `wait` gives
    up after the transport's --timeout, naming the receiver, and at once when the transport is
    stopped (a lost peer never reads what was sent to it); `done` asks without waiting."""

    __slots__ = ("payload_bytes", "header_bytes", "trackers", "timeout", "what", "stopped")

    def __init__(self, payload_bytes=0, header_bytes=0, trackers=(), timeout=None, what=None,
                 stopped=None):
        self.payload_bytes, self.header_bytes, self.trackers = payload_bytes, header_bytes, trackers
        self.timeout = timeout           # seconds a wait lasts at most (None: the caller's)
        self.what = what                 # "rank 0's KV_VALUE to rank 2", for the deadline error
        self.stopped = stopped           # fn() -> the transport's abort error, or None

    def done(self):
        """Whether every sent buffer is free again (without waiting)."""
        if all(t.done for t in self.trackers):
            self.trackers = ()
            return True
        return False

    def wait(self, timeout=None):
        """Block until the sent buffers may be overwritten, at most `timeout` seconds (default:
        the receipt's own, the transport's --timeout); DeadlineError naming the receiver after."""
        limit = self.timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        for t in self.trackers:
            while not t.done:
                error = self.stopped() if self.stopped is not None else None
                if error is not None:
                    raise error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise DeadlineError(f"{self.what or 'a message'} was not taken within "
                                        f"{limit:g} s: is the receiver still running?")
                try:
                    t.wait(STOP_POLL_S if left is None else min(STOP_POLL_S, left))
                except (TimeoutError, zmq.NotDone):
                    pass
            t.wait(0)                    # done: returns, or raises a sender thread's error
        self.trackers = ()
