"""Bounded waits and bounded state: what a stopped worker, a repeating member or a same-user
process can do to a job's processes, and what they must not.

- A KV server under --straggler-timeout with one worker SIGSTOPped (a real process job): it keeps
  answering the other workers (their iterations go on while the straggler is stopped), and after
  SIGCONT the job finishes. A server that waited for the stopped worker to take its last answer
  would stop its receive thread with it: no answers, no heartbeats.
- 300 copies of one 1 MB KV_VALUE, and of one KV_PUSH to a server's queue: one is filed, 299
  are dropped and counted (the copies were filed, 300 MB of them).
- The mailbox's bytes: per sender and in all, a message that does not fit is refused; a ring
  piece makes room by letting go of its sender's pieces of later iterations.
  (tests/dist/test_ring_pieces.py floods a worker with ring pieces for iterations it has not
  reached.)

Run: python -m pytest tests/dist/test_bounded.py -q -s
"""
import os
import re
import signal
import subprocess
import time

import numpy
import pytest

from poseidon.dist.job.roles import Roles
from poseidon.dist.transport import Msg

from .helpers import fc_net, make_lmdb, transport_pair
from .test_processes import alive, cli, env, write_solver
from .test_signals_dist import Output


def _lines(path):
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _wait_lines(path, n, limit):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if _lines(path) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} has {_lines(path)} lines after {limit} s, expected {n}")


@pytest.mark.slow
def test_a_stopped_worker_does_not_stop_the_server(tmp_path):
    """Answers to the stopped worker queue up (its socket is not read): the server's next update of
    the same pair must not wait for them. Big enough answers (a 3072 x 48 layer) to fill a socket's
    buffer in one iteration."""
    data = make_lmdb(tmp_path / "train", n=32, shape=(3, 32, 32))
    path = write_solver(tmp_path / "job", fc_net(data, 4), 40)
    stats = tmp_path / "stats.jsonl"
    proc = subprocess.Popen(cli("--solver", path, "--workers", 3, "--servers", 1,
                                "--no-progress", "--straggler-timeout", 0.3, "--timeout", 20,
                                "--heartbeat-timeout", 30, "--stats", stats),
                            env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    out = Output(proc)
    pids = []
    try:
        pids = [int(p) for p in re.findall(r"pid (\d+)", out.wait_for(r"^poseidon: worker 0 pid"))]
        worker0, server = tmp_path / "stats.worker-0.jsonl", tmp_path / "stats.server-0.jsonl"
        _wait_lines(worker0, 3, 60)
        os.kill(pids[2], signal.SIGSTOP)
        try:
            time.sleep(0.5)                       # what was in flight settles
            before, served = _lines(worker0), _lines(server)
            time.sleep(3.0)
            during, served_during = _lines(worker0) - before, _lines(server) - served
        finally:
            os.kill(pids[2], signal.SIGCONT)
        assert during >= 3 and served_during >= 3, (
            f"while worker 2 was stopped worker 0 did {during} iterations and the server "
            f"answered {served_during}:\n" + "".join(out.lines[-30:]))
        proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    text = out.text()
    assert proc.returncode == 0, text[-3000:]
    assert "poseidon: all processes finished" in text
    print(f"\nworker 2 stopped for 3 s: worker 0 went on {during} iterations, the server "
          f"answered {served_during}; after SIGCONT the job finished")


@pytest.fixture
def pair():
    yield from transport_pair(Roles(1, 1), (0, 1), timeout=10.0)


def _settle(t, n, limit=30.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        c = t.counters()
        if c["recv_messages"] + c["dropped_messages"] >= n:
            return c
        time.sleep(0.02)
    raise AssertionError(f"{t.name} took in {t.counters()} of {n} messages")


def _filed_bytes(mailbox):
    boxes = sum(m.payload_bytes for box in mailbox._boxes.values() for m in box)
    return boxes + sum(m.payload_bytes for m in mailbox._fifo)


def test_copies_of_a_message_are_dropped_not_filed(pair):
    worker, server = pair
    value = numpy.ones(1 << 18, numpy.float32)                        # 1 MB
    server.set_fifo([Msg.KV_PUSH])
    for _ in range(300):
        server.send(0, Msg.KV_VALUE, iteration=3, key=7, arrays=[value])
        worker.send(1, Msg.KV_PUSH, iteration=3, key=7, arrays=[value])
    for t in (worker, server):
        c = _settle(t, 300)
        assert c["recv_messages"] == 1 and c["dropped_messages"] == 299, c
        assert _filed_bytes(t.mailbox) == value.nbytes
    got = worker.receive(Msg.KV_VALUE, key=7, iteration=3)[0]
    numpy.testing.assert_array_equal(got.arrays[0], value)
    assert server.next(timeout=1).key == 7 and server.next(timeout=0) is None
    server.send(0, Msg.KV_VALUE, iteration=4, key=7, arrays=[value])    # the next one: filed
    assert worker.receive(Msg.KV_VALUE, key=7, iteration=4)[0].sender == 1
    print("\n300 copies of a 1 MB KV_VALUE and of a KV_PUSH: 1 filed, 299 dropped each")


def test_the_mailbox_is_bounded(monkeypatch):
    from poseidon.dist.transport import Message, Mailbox
    from poseidon.dist.transport import mailbox as module
    monkeypatch.setattr(module, "MAX_FILED", 5)
    box = Mailbox(str)
    msgs = [Message(Msg.SF, 0, it, 1, 0, [], None, 0, 0) for it in range(6)]
    assert [box.put(m) for m in msgs[:5]] == [None] * 5
    assert "5 messages already wait" in box.put(msgs[5])
    assert box.take(Msg.SF, 1, 0, timeout=1)[0].iteration == 0
    assert box.put(msgs[5]) is None                      # taking one made room


def test_the_mailbox_is_bounded_in_bytes(monkeypatch):
    """Per sender and in all: a message that does not fit is refused, saying which limit; taking
    makes room, in a box and in the FIFO queue. A ring piece that does not fit lets go of its
    sender's pieces of later iterations, farthest first, when that is enough."""
    from poseidon.dist.transport import Message, Mailbox
    from poseidon.dist.transport import mailbox as module
    monkeypatch.setattr(module, "PEER_BYTES", 1000)
    monkeypatch.setattr(module, "HELD_BYTES", 2500)
    box = Mailbox(lambda r: f"worker {r}")
    gone = []
    box.on_evict = lambda msgs, why: gone.extend((m.iteration, why) for m in msgs)

    def msg(mtype, sender, it, n, key=1):
        return Message(mtype, sender, it, key, 0, [], None, 0, n)
    assert box.put(msg(Msg.SF, 0, 1, 600)) is None
    why = box.put(msg(Msg.SF, 0, 2, 600))
    assert "worker 0 waiting to be taken already hold 0.0 MB" in why and why.kind == "sender bytes"
    assert box.put(msg(Msg.SF, 1, 1, 900)) is None and box.put(msg(Msg.SF, 2, 1, 900)) is None
    why = box.put(msg(Msg.SF, 3, 1, 200))
    assert "at most 0.0 MB in all" in why and why.kind == "all bytes", why
    assert box.held_bytes() == 2400 and box.held_bytes(0) == 600
    assert box.take(Msg.SF, 1, 1, count=3, timeout=1)[0].sender == 0
    assert box.held_bytes() == 0
    box.set_fifo([Msg.KV_PUSH])
    assert box.put(msg(Msg.KV_PUSH, 0, 1, 1000)) is None
    assert box.put(msg(Msg.KV_PUSH, 0, 2, 1)).kind == "sender bytes"
    assert box.next(timeout=1).iteration == 1 and box.held_bytes() == 0
    for it in (5, 6):                                     # messages of no payload come and go
        assert box.put(msg(Msg.KV_PUSH, 0, it, 0)) is None
    assert [box.next(timeout=1).iteration for _ in range(2)] == [5, 6]
    # ring pieces of later iterations make room for an earlier one of their sender
    for it in (10, 11, 12, 13):
        assert box.put(msg(Msg.RING, 0, it, 250)) is None
    assert box.put(msg(Msg.RING, 0, 14, 250)).kind == "sender bytes"     # the farthest: refused
    assert box.put(msg(Msg.RING, 0, 3, 400)) is None                     # 13 and 12 go
    assert gone == [(13, "room"), (12, "room")] and box.held_bytes(0) == 900
    assert box.take(Msg.RING, 1, 3, timeout=1)[0].iteration == 3


def test_a_receipt_waits_at_most_its_deadline_and_names_the_receiver():
    """A zero-copy frame a receiver never reads (stopped, gone): the wait ends at the deadline."""
    import zmq
    from poseidon.dist.errors import DeadlineError
    from poseidon.dist.transport import Receipt

    class NeverTaken:
        done = False

        def wait(self, timeout):
            time.sleep(min(timeout, 0.05))
            raise zmq.NotDone()

    receipt = Receipt(10, 5, [NeverTaken()], timeout=0.1, what="worker 0's SF to worker 1")
    assert not receipt.done()
    start = time.monotonic()
    with pytest.raises(DeadlineError, match="worker 0's SF to worker 1 was not taken within 0.1 s"):
        receipt.wait()
    assert time.monotonic() - start < 5


def test_a_receipt_wait_ends_when_the_transport_stops():
    """A peer that dies holding a zero-copy frame never reads it: once the transport is stopped
    (its heartbeat loss), the wait raises the stop's error instead of lasting to --timeout."""
    import zmq
    from poseidon.dist.errors import AbortError
    from poseidon.dist.transport import Receipt

    class NeverTaken:
        done = False

        def wait(self, timeout):
            time.sleep(min(timeout, 0.05))
            raise zmq.NotDone()

    stop_at = time.monotonic() + 0.3
    lost = AbortError("worker 1: lost contact with the coordinator")
    receipt = Receipt(10, 5, [NeverTaken()], timeout=60.0, what="worker 1's SF to worker 0",
                      stopped=lambda: lost if time.monotonic() >= stop_at else None)
    start = time.monotonic()
    with pytest.raises(AbortError, match="lost contact"):
        receipt.wait()
    assert time.monotonic() - start < 2
