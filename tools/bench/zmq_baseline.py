"""Part d's baseline (tools/bench/dist_parts.transport): the same bytes as the KV job moves, sent by
raw ZeroMQ to an echo thread and back, set up as the project's own sockets are, so that the KV
job's rate has a like-for-like figure beside it."""
import time

import numpy

from .env import stats


def _echo(sock, rounds):
    """The far end: every message sent straight back, `rounds` times."""
    for _ in range(rounds):
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def raw_zmq(total_bytes, frame_bytes, runs, curve=False, ipc=False):
    """Round trips of total_bytes as frames of frame_bytes over a PAIR socket on TCP loopback (or,
    with `ipc`, a Unix socket in a private folder: dist/transport/onehost/localipc.LocalInbox, as
    the job binds) to an echo thread (pyzmq releases the GIL while it moves frames, and frames go
    zero-copy); bytes/s counts both directions, as a push + pull does.

    Each end has its own context with one I/O thread (io_threads=1, as every ZmqTransport), so
    encryption and decryption run on two I/O threads as in the KV job's two processes. With
    `curve` the sockets are set up as the project's are (dist/job/security.py): fresh job keys from
    zmq.curve_keypair, the echo end a CURVE server (secure_server) with the project's ZAP handler
    (Gatekeeper) on its context, the sending end a CURVE client (secure_client). ZAP runs once,
    at the handshake, so it costs the round trips nothing; it is there so the set-up is the job's."""
    import threading
    import zmq
    from poseidon.dist.job import security
    from poseidon.dist.transport import free_port
    from poseidon.dist.transport.onehost import localipc
    inbox = localipc.LocalInbox() if ipc else None
    address = inbox.endpoint if ipc else f"tcp://127.0.0.1:{free_port()}"
    n = max(1, total_bytes // frame_bytes)
    payload = [numpy.ones(frame_bytes // 4, numpy.float32) for _ in range(n)]
    keys = security.make_keys() if curve else None
    client_ctx, echo_ctx = zmq.Context(io_threads=1), zmq.Context(io_threads=1)
    gatekeeper = security.Gatekeeper(echo_ctx, keys) if curve else None
    echo_sock = echo_ctx.socket(zmq.PAIR)
    sock = client_ctx.socket(zmq.PAIR)
    if curve:
        security.secure_server(echo_sock, keys)
        security.secure_client(sock, keys)
    echo_sock.bind(address)
    echo = threading.Thread(target=_echo, args=(echo_sock, runs + 1), daemon=True)
    echo.start()
    sock.connect(address)
    rates = []
    try:
        for r in range(runs + 1):
            t = time.perf_counter()
            sock.send_multipart(payload, copy=False)
            sock.recv_multipart(copy=False)
            dt = time.perf_counter() - t
            if r:
                rates.append(2 * n * frame_bytes / dt)
        if curve and gatekeeper.admitted != 1:
            raise RuntimeError(f"the ZAP handler admitted {gatekeeper.admitted} clients, not 1")
    finally:
        sock.close(linger=0)
        echo.join(30)
        echo_sock.close(linger=0)
        if gatekeeper is not None:
            gatekeeper.stop()
        client_ctx.term()
        echo_ctx.term()
        if inbox is not None:
            inbox.close()
    return stats(rates)
