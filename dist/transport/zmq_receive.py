"""The receive side of the ZeroMQ transport: what happens to a message after it arrives.

Why this shape: each process has ONE incoming socket (a PULL "inbox"; the coordinator's is a ROUTER)
owned by one receive thread. That thread decodes each message, checks it (the header, the frames
against what the header declares, the sender's identity, checks.WireRules, its iteration against
what this process has already taken), counts it, and hands it to a handler or files it in the
mailbox. A message that cannot be what a member sends is dropped with one logged line, and the
reason is kept so that a deadline error on a wait for its sender can say why nothing came. Messages
from a direct link or from a transport of this same process go through the same checks and filing
(`_decode_link`, `_file`), so a path that skips the socket skips none of the rules.

The receive thread also beats the heart: it sends a heartbeat to the coordinator and watches that
it hears from the ranks it was told to watch; an ABORT from the coordinator, or a watched rank that
falls silent, fails every waiter at once.

`ZmqReceiveSide` is a part of ZmqTransport (its base class), apart only to keep each file to one
concern; it uses the transport's sockets, counters and mailbox and has no life of its own.
"""
import struct
import sys
import time

import numpy
import zmq

from ..errors import AbortError, DistError
from ..job.roles import COORDINATOR
from .mailbox import REPEATED, STEP_TYPES, STEP_WINDOW, Refusal
from .wire import FLAG_JSON, BadMessage, Msg, decode_header, make_message

LOGGED_DROPS = 20                      # dropped messages logged one by one; then at 100, 1000, ...
_LOG_AT = frozenset(10 ** k for k in range(2, 13))
FUTURE_WINDOW = 1000                   # iterations ahead of the last taken a message may be
_NAMES = {m: m.name for m in Msg}


def _origin(frame):
    """Where a received frame came from, as its connection says it: 'from process 812 of user
    1000 over a Unix socket' (the peer's credentials) or 'from 10.0.0.3 over TCP'; None when
    unknown (a direct link, a transport of this process)."""
    if frame is None:
        return None
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
    if not address:
        return None
    parts = address.split(":")
    if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):   # ipc: host:uid:gid:pid
        return f"from process {parts[3]} of user {parts[1]} over a Unix socket"
    return f"from {address} over TCP"


class ZmqReceiveSide:
    """Decode, check, count and file (or handle) what arrives; the receive thread's loop."""

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
        return make_message(head, mtype, flags, sender, iteration, key, aux, arrays, payload)

    def _check_whole(self, msg, flags, specs):
        """Why the whole message a first slice describes is refused before it is allocated (the
        rules of dist/coord/checks.py on its descriptions), or None."""
        arrays = specs[1:] if flags & FLAG_JSON else specs
        return (self.rules.check_specs(msg.type, msg.sender, msg.key, arrays)
                or self._too_far(msg))

    def _decode_link(self, head, arrays):
        """A Message from a direct link's (or a local peer's) header and the arrays read after it
        (their sizes are the declared ones by construction)."""
        mtype, flags, sender, iteration, key, aux, _ = decode_header(head)
        return make_message(head, mtype, flags, sender, iteration, key, aux, arrays,
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
        and log one line (the first LOGGED_DROPS of a process, then at 100, 1000, ...; a Refusal
        once per sender and kind: a flood of them is one line)."""
        sender = None if msg is None else msg.sender
        with self.counters_lock:
            self.dropped_messages += 1
            n = self.dropped_messages
            if sender is not None:
                self._last_drop[sender] = reason
        kind = getattr(reason, "kind", None)
        if kind is not None and sender is not None:
            if self.mailbox.first_refusal(sender, kind):
                print(f"{self.name}: dropped a message from {self._namer(sender)}: {reason} "
                      f"(said once per sender; the rest are counted: {n} dropped so far)",
                      file=sys.stderr)
            return
        if n <= LOGGED_DROPS or n in _LOG_AT:
            who = "" if sender is None else f" from {self._namer(sender)}"
            more = (f" ({n} dropped so far; logging only at 100, 1000, ...)"
                    if n == LOGGED_DROPS else f" ({n} dropped so far)" if n > LOGGED_DROPS else "")
            print(f"{self.name}: dropped a message{who}: {reason}{more}", file=sys.stderr)

    def _admit(self, msg, frame=None):
        """None if msg may be filed or handled, else why not (checks.py, then its iteration
        against this process's: a ring piece or factors more than STEP_WINDOW ahead of the
        iteration it is at, anything already taken of (type, key), or far ahead of that)."""
        reason = self.rules.check(msg)
        if reason is not None:
            return reason
        if msg.iteration < 0:
            return f"{msg.type.name} for iteration {msg.iteration}"
        reason = self._too_far(msg)
        if reason is not None:
            return reason
        if msg.type in self._handlers or msg.type in self.mailbox._fifo_types:
            return None
        last = self._taken.get((msg.type, msg.key))
        if last is not None:
            if msg.iteration <= last:
                if msg.type == Msg.RING:
                    return self._second_piece(msg, frame, last)
                return (f"{msg.type.name} key {msg.key} for iteration {msg.iteration}, which "
                        f"this process has already taken (out of order or repeated)")
            if msg.iteration > last + FUTURE_WINDOW:
                return (f"{msg.type.name} key {msg.key} for iteration {msg.iteration}, "
                        f"{msg.iteration - last} ahead of the last one taken ({last})")
        return None

    def _too_far(self, msg):
        """Why a ring piece or factors (or the first slice of them) are refused for their
        iteration: more than STEP_WINDOW ahead of the iteration this process is at; or None."""
        if msg.type not in STEP_TYPES:
            return None
        step = self.mailbox.step
        if step is None or msg.iteration <= step + STEP_WINDOW:
            return None
        return Refusal(f"{self._what(msg)} for iteration {msg.iteration}, more than {STEP_WINDOW} "
                       f"iterations ahead of the iteration this process is at ({step})", "ahead")

    def _second_piece(self, msg, frame, taken=None):
        """Why a ring piece for a slot whose piece this worker already has is dropped: the first
        is kept (no check can tell two pieces of one slot apart), and the line says where each
        came from, since both claim the left neighbour and it sends each piece once."""
        claimed = self._namer(msg.sender)
        first = self.mailbox.origin_of(msg.key, msg.iteration)
        here = _origin(frame) or "by a path that does not say from where"
        what = (f"a second piece for {self.rules.ring_label(msg.key)} for iteration "
                f"{msg.iteration}" if taken is None or msg.iteration == taken else
                f"a piece for {self.rules.ring_label(msg.key)} for iteration {msg.iteration}, "
                f"older than the one this worker took last ({taken})")
        kept = f"the first, {first}, was kept" if first else "the first was kept"
        return (f"{what}, claiming to be from {claimed}, came {here}; {kept} ({claimed} sends "
                f"each piece once: one of the two came from another member holding the job's "
                f"keys)")

    def _what(self, msg):
        """'RING piece for slot 3 of layer 'ip1'', 'SF of layer 2' or 'KV_VALUE key 7'."""
        if msg.type == Msg.RING:
            return f"RING piece for {self.rules.ring_label(msg.key)}"
        if msg.type == Msg.SF:
            return f"SF of layer {msg.key}"
        return f"{msg.type.name} key {msg.key}"

    def _let_go(self, msgs, why):
        """Ring pieces and factors the mailbox let go of: filed before this process's iteration
        was known and beyond its window now (why 'window'), or of later iterations than one that
        needed their room (why 'room'); dropped and counted as if refused at the door."""
        step = self.mailbox.step
        for m in msgs:
            what = f"{self._what(m)} for iteration {m.iteration}"
            if why == "window":
                text = (f"{what}, filed before this process took its first, is more than "
                        f"{STEP_WINDOW} iterations ahead of the one it is at ({step})")
            else:
                text = (f"{what} gave its room to one of an earlier iteration from the same "
                        f"sender (the mailbox's bytes are bounded)")
            self.drop(m, Refusal(text, "ahead" if why == "window" else "room"))

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
        self._file(msg, frames[-1])

    def _file(self, msg, frame=None):
        """Admit, count, then hand msg to its handler or its mailbox (a slice: once its message
        is whole, dist/transport/slices.py). `frame`: a frame it came in, which says from where
        (a ring piece's is kept, for the line of a second piece for its slot)."""
        mailbox = self.mailbox
        book = self.rules.book
        if book is not None and book is not mailbox.sized_for:
            mailbox.size_for(book)             # the byte limits follow the model's size
        if mailbox.on_evict is None:
            mailbox.on_evict = self._let_go
        if msg.slice is not None:
            whole, reason = self._assembler.add(msg)
            if reason is not None:
                self._refuse(msg, reason)
                return
            with self.counters_lock:
                self.slices_received += 1
            if whole is None:
                return
            msg = whole
        reason = self._admit(msg, frame)
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
            ring = msg.type == Msg.RING
            origin = _origin(frame) if ring else None
            reason = mailbox.put(msg)
            if reason is None:
                if ring:
                    mailbox.note_origin(msg, origin)
            else:
                if ring and reason == REPEATED:
                    reason = self._second_piece(msg, frame)
                self.drop(msg, reason)

    def _tick(self):
        now = time.monotonic()
        if self._beat_to_coordinator and now - self._last_beat >= self.heartbeat:
            self._last_beat = now
            try:
                self.send(COORDINATOR, Msg.HEARTBEAT)
            except DistError:
                pass
        if self.mailbox.error is None:
            silent = self.silent_ranks(now)
            if silent:
                self.fail(AbortError(
                    f"{self.name}: lost contact with {self._namer(silent[0])}: nothing heard from "
                    f"it for {self.lost_after:g} s (it has probably died; see its output)"))

