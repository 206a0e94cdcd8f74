"""The start-up probe of the measured cost model: what each of a worker's links costs.

Why over the job's own transport: the model predicts the syncs, which go through this transport
(its sockets, its one-host paths, CURVE, its slicing), so the probe's messages take the same road.
Each worker, in turn towards every other rank, makes PROBE_ROUND_TRIPS small round trips (the
fastest, halved, is the latency α) and sends one PROBE_BYTES message answered by a small one (the
bandwidth β from what it took beyond a small round trip). Every rank answers a PROBE on its
receive thread, so a rank busy probing still answers the others. A probe waits at most
PROBE_TIMEOUT seconds for an answer; the whole probe is a few round trips per rank.

On an encrypted link (TCP with CURVE) the measured β includes the encryption; the model keeps the
two apart (β of the wire, and CURVE's seconds per byte measured once here on a pair of CURVE
sockets on loopback), so that the encryption is charged where it applies.
"""
import time

import numpy
import zmq

from ..transport import Msg

PROBE_ROUND_TRIPS = 3
PROBE_BYTES = 2 << 20
PROBE_TIMEOUT = 10.0
GEMM_SIDE = 256                 # the flop rate: the best of a few GEMMs of this size
SMALL = numpy.zeros(8, numpy.uint8)


def answer_probes(transport):
    """Answer every PROBE with a small PROBE_ECHO of the same iteration (on the receive thread)."""
    def echo(msg):
        transport.send(msg.sender, Msg.PROBE_ECHO, iteration=msg.iteration, key=transport.rank)
    transport.handle(Msg.PROBE, echo)


class Prober:
    """One worker's probes; `counter` numbers them (each rank's echoes come in increasing order,
    as the transport asks of a message type, across a run's probes)."""

    def __init__(self, transport, roles):
        self.transport, self.roles = transport, roles
        self.counter = 0

    def _round_trip(self, target, payload):
        t = self.transport
        n = self.counter
        self.counter += 1
        t0 = time.perf_counter()
        t.send(target, Msg.PROBE, iteration=n, key=t.rank, arrays=[payload])
        t.receive(Msg.PROBE_ECHO, target, n, timeout=PROBE_TIMEOUT, senders=[target],
                  what=f"the answer to a cost probe from {self.roles.name(target)}")
        return time.perf_counter() - t0

    def link(self, target, encrypt_cost):
        """{alpha, beta, encrypted} of the link to `target`."""
        small = min(self._round_trip(target, SMALL) for _ in range(PROBE_ROUND_TRIPS))
        big = self._round_trip(target, numpy.zeros(PROBE_BYTES, numpy.uint8))
        encrypted = self.transport.keys is not None and self.transport.routes.get(target) != "ipc"
        transfer = max(big - small, PROBE_BYTES / 1e12)    # no link is faster than 1 TB/s
        # CURVE's share, measured apart on this process's own sockets, is taken out of the
        # transfer, but never more than half of it: the two measurements are noisy apart (a busy
        # core), and a wire left with nothing would read as a link of infinite bandwidth
        share = min(PROBE_BYTES * encrypt_cost, transfer / 2) if encrypted else 0.0
        return {"alpha": small / 2, "beta": PROBE_BYTES / (transfer - share),
                "encrypted": encrypted}

    def report(self, dtype, xp=numpy):
        """This worker's view: its links to every other rank, its flop rate, CURVE's cost."""
        encrypt = curve_seconds_per_byte(self.transport.keys)
        links = {str(r): self.link(r, encrypt) for r in range(self.roles.size)
                 if r != self.transport.rank}
        return {"links": links, "flops": flop_rate(dtype, xp), "encrypt_cost": encrypt}


def flop_rate(dtype, xp=numpy, side=GEMM_SIDE, tries=5):
    """Flop/s of this process's GEMM in the job's dtype, on the net's array module (the device
    the SFB rebuild runs on; the best of a few, the first of which also warms it up)."""
    a = xp.ones((side, side), dtype)
    best = None
    for _ in range(tries + 1):
        t0 = time.perf_counter()
        a @ a
        if xp is not numpy:
            xp.cuda.get_current_stream().synchronize()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return 2.0 * side ** 3 / max(best, 1e-9)


def _transfer_seconds(ctx, keys, nbytes):
    """The fastest of two sends of nbytes over a pair of loopback TCP sockets (CURVE with keys)."""
    server, client = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for s in (server, client):
            s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            server.curve_server = True
            server.curve_secretkey, server.curve_publickey = keys.secret, keys.public
            client.curve_serverkey = keys.public
            client.curve_publickey, client.curve_secretkey = keys.public, keys.secret
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
        payload = numpy.zeros(nbytes, numpy.uint8)
        client.send(b"hello")
        if not server.poll(int(PROBE_TIMEOUT * 1000)):
            return None
        server.recv()
        best = None
        for _ in range(2):
            t0 = time.perf_counter()
            client.send(payload, copy=False)
            server.recv(copy=False)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        return best
    finally:
        server.close(0)
        client.close(0)


def curve_seconds_per_byte(keys, nbytes=PROBE_BYTES):
    """What CURVE adds to a byte sent (encrypting and decrypting it): a transfer between two CURVE
    sockets of this process less the same transfer in the clear. 0 for a job without keys."""
    if keys is None:
        return 0.0
    ctx = zmq.Context(io_threads=1)
    try:
        secure = _transfer_seconds(ctx, keys, nbytes)
        clear = _transfer_seconds(ctx, None, nbytes)
    finally:
        ctx.term()
    if secure is None or clear is None:
        return 0.0
    return max(secure - clear, 0.0) / nbytes
