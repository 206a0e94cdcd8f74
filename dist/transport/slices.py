"""Messages larger than one slice: cut when sent, put together when received, within bounds.

Why: every frame a process takes in must be small enough that ZeroMQ may refuse a larger one
before it allocates anything (ZMQ_MAXMSGSIZE, set on every socket from the slice size): a stranger
that sends a frame header claiming 512 MB is then disconnected by libzmq instead of growing the
process by 512 MB before any handshake. A member's large messages (worker 0's WEIGHTS of a 151 MB
parameter, sufficient factors, a big net's BOOK, the coordinator's GATHER items) therefore travel
as slices of at most `--slice-bytes`: the same type, key and iteration, each slice saying which
bytes of which array of the whole it holds, and the whole's array descriptions.

The receiver sizes the whole from those descriptions only after they pass the checks a whole
message would (dist/coord/checks.py: the sender's role, the book's shapes where the book fixes them) and
the caps here, never from the bytes that arrive; it preallocates the arrays and copies each slice
into place. The slices of a message are a partition (each is `slice size` long but an array's
last), so a repeated or overlapping slice is refused, and the whole is complete when every byte
has come. Messages being put together are bounded per sender and in all.
"""
import math
import threading

import numpy

from .wire import FLAG_JSON, FLAG_SHARED, encode_slice, make_message, BadMessage

DEFAULT_SLICE_BYTES = 2 << 20          # the KV pair size's default: a pair is one slice
FRAME_HEADROOM = 64 << 10              # ZMQ_MAXMSGSIZE is the slice size plus this (headers)
MAX_JSON_BYTES = 64 << 20              # a control message's JSON object (timelines, a big book)
MAX_UNCHECKED_BYTES = 1 << 30          # a whole message whose size no book fixes
MAX_PARTIAL_PER_SENDER = 64            # messages of one sender being put together at once
MAX_PARTIAL = 256                      # ... of all senders


def inbox_limit(slice_bytes):
    """ZMQ_MAXMSGSIZE of a socket whose peers slice at `slice_bytes` (the coordinator slices at
    the default whatever a job's flag says, dist/transport/zmq_transport.py)."""
    return max(slice_bytes, DEFAULT_SLICE_BYTES) + FRAME_HEADROOM


def _nbytes(spec):
    dtype, shape = spec
    return dtype.itemsize * math.prod(shape)


def cut(header, arrays, slice_bytes):
    """The (header, uint8 view) of each slice of the message `header` describes."""
    out = []
    for i, a in enumerate(arrays):
        flat = a.reshape(-1).view(numpy.uint8)
        for offset in range(0, a.nbytes, slice_bytes):
            part = flat[offset:offset + slice_bytes]
            out.append((encode_slice(header, slice_bytes, i, offset, part.size), part))
    return out


def whole_reason(flags, specs):
    """Why a whole message of these descriptions cannot be a member's, whatever the book says;
    None when it may be."""
    if flags & FLAG_SHARED:
        return "a message in shared memory cannot come in slices"
    total = sum(_nbytes(s) for s in specs)
    if flags & FLAG_JSON and (not specs or _nbytes(specs[0]) > MAX_JSON_BYTES):
        return f"a JSON object of more than {MAX_JSON_BYTES} bytes"
    if total > MAX_UNCHECKED_BYTES:
        return f"a message of {total} bytes (at most {MAX_UNCHECKED_BYTES})"
    return None


class _Partial:
    __slots__ = ("arrays", "views", "left", "seen", "size", "header_bytes")

    def __init__(self, specs, size):
        self.arrays = [numpy.empty(shape, dtype) for dtype, shape in specs]
        self.views = [a.reshape(-1).view(numpy.uint8) for a in self.arrays]
        self.left = sum(a.nbytes for a in self.arrays)
        self.seen = set()
        self.size = size
        self.header_bytes = 0


class Assembler:
    """The messages being put together, by (sender, type, key, iteration).

    `check(msg, flags, specs)`: why a whole of these descriptions from msg's sender is refused
    (roles, the book), or None; asked once per message, before anything is allocated."""

    def __init__(self, check):
        self._check = check
        self._partial = {}
        self._per_sender = {}
        self._lock = threading.Lock()      # slices come from the receive thread and link readers

    def __len__(self):
        return len(self._partial)

    def add(self, msg):
        """(the whole message, None) once msg completes it, (None, None) while slices are
        missing, (None, why) for a slice that is dropped."""
        flags, size, array, offset, specs = msg.slice
        k = (msg.sender, msg.type, msg.key, msg.iteration)
        with self._lock:
            part = self._partial.get(k)
            if part is None:
                reason = whole_reason(flags, specs) or self._check(msg, flags, specs)
                if reason is None:
                    reason = self._room(msg.sender)
                if reason is not None:
                    return None, reason
                part = self._partial[k] = _Partial(specs, size)
                self._per_sender[msg.sender] = self._per_sender.get(msg.sender, 0) + 1
            if size != part.size or len(specs) != len(part.arrays) or any(
                    a.dtype != d or a.shape != s for a, (d, s) in zip(part.arrays, specs)):
                return None, "a slice that disagrees with the earlier slices of its message"
            if (array, offset) in part.seen:
                return None, f"a repeated slice (array {array}, byte {offset})"
            data = msg.arrays[0]
            part.views[array][offset:offset + data.size] = data
            part.seen.add((array, offset))
            part.left -= data.size
            part.header_bytes += msg.header_bytes
            if part.left:
                return None, None
            del self._partial[k]
            self._per_sender[msg.sender] -= 1
        payload = sum(a.nbytes for a in part.arrays)
        try:
            return make_message(part.header_bytes, msg.type, flags, msg.sender, msg.iteration,
                                msg.key, msg.aux, part.arrays, payload), None
        except BadMessage as e:
            return None, str(e)

    def _room(self, sender):
        if self._per_sender.get(sender, 0) >= MAX_PARTIAL_PER_SENDER:
            return (f"{MAX_PARTIAL_PER_SENDER} messages of this sender are already being put "
                    f"together")
        if len(self._partial) >= MAX_PARTIAL:
            return f"{MAX_PARTIAL} messages are already being put together"
        return None
