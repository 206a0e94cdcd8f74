"""The ZeroMQ transport: header encoding, payload vs header counters, zero-copy sends, deadlines
that name what was awaited, abort, the rate cap.

Run: python -m pytest tests/dist/test_transport.py -q
"""
import time

import numpy
import pytest

from poseidon.dist.coord.checks import WireRules

from poseidon.dist.errors import AbortError, DeadlineError
from poseidon.dist.job.roles import Roles
from poseidon.dist.transport import (FIXED_HEADER_BYTES, Msg, TokenBucket, ZmqTransport, decode_header,
                            encode_header, parse_bandwidth)

from .helpers import transport_pair


@pytest.fixture
def pair():
    yield from transport_pair(Roles(2, 1), (0, 2), timeout=2.0)


def test_header_round_trip():
    arrays = [numpy.zeros((3, 4), numpy.float32), numpy.zeros(7, numpy.float64),
              numpy.zeros((), numpy.int64)]
    head = encode_header(Msg.SF, 5, 123456789012, 42, -3, arrays)
    assert len(head) == FIXED_HEADER_BYTES + 3 * 2 + 4 * 3
    mtype, flags, sender, it, key, aux, specs = decode_header(head)
    assert (mtype, sender, it, key, aux) == (Msg.SF, 5, 123456789012, 42, -3)
    assert list(specs) == [(numpy.dtype("float32"), (3, 4)), (numpy.dtype("float64"), (7,)),
                     (numpy.dtype("int64"), ())]


def test_payload_and_header_bytes_counted_apart(pair):
    a, b = pair
    big = numpy.arange(100_000, dtype=numpy.float32)          # zero-copy frame
    small = numpy.arange(10, dtype=numpy.float64)
    receipt = a.send(2, Msg.KV_PUSH, iteration=3, key=7, arrays=[big, small])
    assert receipt.payload_bytes == big.nbytes + small.nbytes
    assert receipt.header_bytes == FIXED_HEADER_BYTES + 2 * (2 + 4)
    assert len(receipt.trackers) == 1                          # only the big frame is tracked
    receipt.wait()
    msg = b.receive(Msg.KV_PUSH, 7, 3)[0]
    assert msg.sender == 0 and msg.payload_bytes == receipt.payload_bytes
    assert msg.header_bytes == receipt.header_bytes
    numpy.testing.assert_array_equal(msg.arrays[0], big)
    numpy.testing.assert_array_equal(msg.arrays[1], small)
    c_a, c_b = a.counters(), b.counters()
    assert c_a["sent_payload"] == c_b["recv_payload"] == big.nbytes + small.nbytes
    assert c_a["sent_header"] == c_b["recv_header"] == receipt.header_bytes


def test_json_control_message(pair):
    a, b = pair
    a.send(2, Msg.QUERY, key=1, obj={"what": "cluster", "x": [1, 2]})
    msg = b.receive(Msg.QUERY, 1, 0)[0]
    assert msg.obj == {"what": "cluster", "x": [1, 2]}


def test_mailbox_keys_and_sender_order(pair):
    a, b = pair
    b.send(0, Msg.SF, iteration=2, key=5, arrays=[numpy.ones(3)])
    b.send(0, Msg.SF, iteration=1, key=5, arrays=[numpy.zeros(3)])
    first = a.receive(Msg.SF, 5, 1)[0]
    assert first.iteration == 1 and first.arrays[0].sum() == 0
    assert a.receive(Msg.SF, 5, 2)[0].arrays[0].sum() == 3


def test_deadline_names_what_and_whom(pair):
    a, _ = pair
    t0 = time.monotonic()
    with pytest.raises(DeadlineError) as err:
        a.receive(Msg.KV_VALUE, 9, 4, timeout=0.3, senders=[2],
                  what="the new values of KV pair 9 (layer 'fc7', iteration 4)")
    assert time.monotonic() - t0 < 2
    text = str(err.value)
    assert "KV pair 9" in text and "layer 'fc7'" in text and "server 0 (rank 2)" in text


def test_abort_wakes_waiters_with_the_reason(pair):
    a, b = pair
    b.send(0, Msg.ABORT, obj={"reason": "worker 1 was lost"})
    with pytest.raises(AbortError, match="worker 1 was lost"):
        a.receive(Msg.SF, 1, 1, timeout=5)


def test_lost_peer_detected_by_silence():
    roles = Roles(1, 1)
    a = ZmqTransport(0, namer=roles.name, timeout=2.0, lost_after=0.3)
    a.bind("127.0.0.1")
    a.start()
    a.watch(1)
    try:
        with pytest.raises(AbortError, match=r"lost contact with server 0 \(rank 1\)"):
            a.receive(Msg.SF, 1, 1, timeout=5)
    finally:
        a.close(0)


def test_token_bucket_caps_the_rate():
    bucket = TokenBucket(1_000_000)           # 1 MB/s
    t0 = time.monotonic()
    for _ in range(5):
        bucket.consume(100_000)
    elapsed = time.monotonic() - t0
    assert 0.3 < elapsed < 1.5                # 500 kB minus the 64 kB burst at 1 MB/s


def test_parse_bandwidth():
    assert parse_bandwidth("1Gbit") == 125e6
    assert parse_bandwidth("10GbE") == 1.25e9
    assert parse_bandwidth("100Mbit/s") == 12.5e6
    assert parse_bandwidth("125MB") == 125e6
    with pytest.raises(ValueError):
        parse_bandwidth("fast")


def test_a_transport_of_this_process_gets_its_messages_handed_over_without_sockets(capfd):
    roles = Roles(2, 1)
    a = ZmqTransport(0, namer=roles.name, timeout=2.0, rules=WireRules(0, roles, roles.name))
    b = ZmqTransport(2, namer=roles.name, timeout=2.0, rules=WireRules(2, roles, roles.name))
    for t in (a, b):
        t.bind("127.0.0.1")
        t.start()
    try:
        a.attach_local(2, b)               # never connected: only the hand-over can deliver
        b.attach_local(0, a)
        values = numpy.arange(10, dtype=numpy.float32)
        a.send(2, Msg.KV_PUSH, iteration=0, key=3, arrays=[values])
        values[:] = -1                     # the receiver has its own copy
        msg = b.receive(Msg.KV_PUSH, 3, 0)[0]
        assert msg.sender == 0
        numpy.testing.assert_array_equal(msg.arrays[0], numpy.arange(10))
        beats = []
        a.handle(Msg.HEARTBEAT, beats.append)
        b.send(0, Msg.HEARTBEAT)
        assert len(beats) == 1             # handled at once, as the receive thread would
        assert a.counters()["sent_payload"] == b.counters()["recv_payload"] == msg.payload_bytes
        b.send(0, Msg.KV_PUSH, arrays=[numpy.ones(3)])    # checked as if received: refused
        assert a.counters()["dropped_messages"] == 1
        assert "dropped a message from server 0" in capfd.readouterr().err
        b.close(0)
        a.send(2, Msg.KV_PUSH, key=4, arrays=[values])   # lost, as on a closed socket
    finally:
        a.close(0)
        b.close(0)
