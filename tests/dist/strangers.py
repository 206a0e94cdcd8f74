"""Clients without a job's secret key that connect to its ports and send well-formed messages.

Used by tests/dist/test_security.py (a job of threads on loopback) and, from another network
namespace, by tests/hosts/intruder.py.
"""
import json
import socket
import struct
import time

import numpy
import zmq
import zmq.utils.monitor  # noqa: F401  (recv_monitor_message)

from poseidon.dist.job import security
from poseidon.dist.transport import Msg, encode_header


def _forged(mtype, sender, arrays=(), obj=None, iteration=0, key=0):
    """A well-formed message as a member would send it (header + frames)."""
    arrays = [numpy.ascontiguousarray(a) for a in arrays]
    flags = 0
    if obj is not None:
        arrays.insert(0, numpy.frombuffer(json.dumps(obj).encode(), numpy.uint8))
        flags = 1
    return [encode_header(mtype, sender, iteration, key, 0, arrays, flags)] + \
        [a.tobytes() for a in arrays]


class Stranger:
    """Clients that connect to every port of a job without its secret key and keep sending."""

    def __init__(self, job_public):
        self.ctx = zmq.Context()
        self.sockets = []
        self.job_public = job_public
        self.monitors = []
        self.attempted = 0
        self.raw_closed = 0
        self.raw_received = 0           # bytes the job wrote to the raw clients (its greeting)

    def connect(self, address, coordinator):
        other = security.make_keys()
        for curve in (False, True):
            sock = self.ctx.socket(zmq.DEALER if coordinator else zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100)
            if coordinator:
                sock.setsockopt(zmq.IDENTITY, b"\x00\x00\x00\x00")     # claims to be rank 0
            if curve:        # knows the job's public key, presents its own pair
                sock.curve_serverkey = self.job_public
                sock.curve_publickey = other.public
                sock.curve_secretkey = other.secret
            self.monitors.append((address, curve, sock.get_monitor_socket()))
            sock.connect(address)
            self.sockets.append(sock)

    def send_all(self, rounds=5):
        vec = numpy.ones(16)
        msgs = [_forged(Msg.REGISTER, 0, obj={"rank": 0, "address": "tcp://127.0.0.1:1",
                                              "host": "x", "pid": 1, "options": {}}),
                _forged(Msg.KV_PUSH, 0, [vec], iteration=0, key=0),
                _forged(Msg.ABORT, -1, obj={"reason": "a stranger says stop"}),
                _forged(Msg.HEARTBEAT, 0),
                _forged(Msg.SF, 1, [numpy.ones((4, 5)), numpy.ones((4, 6))], key=1)]
        for _ in range(rounds):
            for sock in self.sockets:
                for m in msgs:
                    self.attempted += 1
                    try:
                        sock.send_multipart(m, zmq.NOBLOCK)
                    except zmq.Again:       # no handshake, no pipe: ZeroMQ cannot even queue it
                        pass

    def raw(self, address):
        """A plain TCP client speaking ZMTP 3.0 with the NULL mechanism: greeting, READY as a
        PUSH, then a well-formed ABORT and KV_PUSH, all written to the socket; the server must
        close the connection."""
        host, port = address[6:].rsplit(":", 1)
        greeting = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") +
                    b"\x00" + b"\x00" * 31)
        prop = b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
        ready = b"\x05READY" + prop
        wire = greeting + b"\x04" + bytes([len(ready)]) + ready
        for m in (_forged(Msg.ABORT, -1, obj={"reason": "a stranger says stop"}),
                  _forged(Msg.KV_PUSH, 0, [numpy.ones(16)])):
            for i, frame in enumerate(m):
                more = 1 if i < len(m) - 1 else 0
                wire += bytes([more | 2]) + struct.pack(">Q", len(frame)) + frame
        with socket.create_connection((host, int(port)), timeout=10) as s:
            try:
                s.sendall(wire)
                self.attempted += 2
                while True:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    self.raw_received += len(chunk)
            except (ConnectionResetError, BrokenPipeError):
                pass
            self.raw_closed += 1

    def messages_received(self, limit=1000):
        """Messages the job delivered to a stranger's sockets (a DEALER could receive some)."""
        count = 0
        for sock in self.sockets:
            for _ in range(limit if sock.socket_type == zmq.DEALER else 0):
                if not sock.poll(0):
                    break
                sock.recv_multipart()
                count += 1
        return count

    def refused_everywhere(self, timeout=20.0):
        """Wait until every connection saw its handshake fail (the server closed it)."""
        failed = {id(m): False for _, _, m in self.monitors}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(failed.values()):
            for _, _, mon in self.monitors:
                while mon.poll(0):
                    ev = zmq.utils.monitor.recv_monitor_message(mon)
                    if ev["event"] in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                                       zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                       zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_DISCONNECTED):
                        failed[id(mon)] = True
            time.sleep(0.05)
        return [f"{a} ({'curve, other keys' if c else 'plain'})" for a, c, m in self.monitors
                if not failed[id(m)]]

    def close(self):
        for _, _, mon in self.monitors:
            mon.close(0)
        for sock in self.sockets:
            sock.close(0)
        self.ctx.term()
