"""Direct links (dist/transport/onehost/directlink.py): a worker's KV push and its answer between
processes of one host, on a Unix socket the waiting thread reads itself (`--ipc auto`).

- A link carries whole messages: every dtype the transport sends, empty and large arrays; a
  stream cut anywhere reads back as the same messages (the staged reads).
- A wait may spin: it takes what arrives meanwhile, and else sleeps in select as before; the last
  sync's wait spins only on one host with a core for every process.
- Two ends that each write a message larger than the socket's buffer at once finish, because a
  blocked writer reads what the other end wrote (the deadlock a naive design has).
- Between two transports: a push goes on the pushing thread's own link, its answer comes back on
  it and is read by the thread that waits, with the same checks and counters as ZeroMQ; an
  answer for another iteration than the push on record goes by ZeroMQ and still arrives; with
  `direct_links=False` (`--ipc zmq`) nothing goes on a link.
- A link whose peer has gone reports it; the wait falls back to the mailbox and its deadline.
- The listening socket is advertised beside the inbox and verified the same way.

Run: python -m pytest tests/dist/test_directlink.py -q
"""
import os
import socket
import struct
import threading
import time

import numpy
import pytest

from poseidon.dist.errors import DeadlineError
from poseidon.dist.job.roles import Roles
from poseidon.dist.transport import Msg, ZmqTransport, encode_header
from poseidon.dist.transport.onehost import directlink, localipc
from poseidon.dist.transport.wire import header_specs

pytestmark = pytest.mark.skipif(not localipc.supported(),
                                reason="direct links live beside the Unix-socket inboxes (Linux)")


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return directlink.Link(a, 1, header_specs), directlink.Link(b, 0, header_specs)


def _send(link, arrays, mtype=Msg.KV_PUSH, key=7, iteration=3, on_messages=None):
    header = encode_header(mtype, 0, iteration, key, 0, arrays)
    link.send(header, arrays, 5.0, on_messages or (lambda msgs: None))
    return header


_early = {}                     # link -> messages read but not yet asked for


def _read_one(link, timeout=10.0):
    deadline = time.monotonic() + timeout
    early = _early.setdefault(link, [])
    while not early:
        assert time.monotonic() < deadline, "nothing arrived"
        early.extend(link.read_ready(0.1))
    return early.pop(0)


def test_a_link_carries_whole_messages_of_every_dtype():
    left, right = _pair()
    arrays = [numpy.arange(12, dtype=d).reshape(3, 4) for d in
              ("float32", "float64", "float16", "int32", "int64", "uint8")]
    arrays += [numpy.zeros((0,), numpy.float32), numpy.float64(2.5).reshape(())]
    header = _send(left, arrays)
    got_header, got = _read_one(right)
    assert got_header == header
    assert len(got) == len(arrays)
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        numpy.testing.assert_array_equal(a, b)
    left.close()
    with pytest.raises(directlink.LinkClosed):
        _read_one(right)
    right.close()


def test_a_stream_cut_anywhere_is_read_back_as_the_same_messages():
    """The reader stages what one recv gives and reads large arrays straight into place: bytes
    arriving in arbitrary pieces (a piece ending inside a length, a header or an array, several
    messages in one piece, arrays below, at and above the staging size) give back every message
    whole and in order, and a piece that leaves the socket empty ends the read without another
    call."""
    rng = numpy.random.default_rng(5)
    stage = directlink.STAGE_BYTES // 4
    sizes = [0, 1, 3, stage - 1, stage, stage + 1, 3 * stage + 7, 10]
    messages = []
    for i, n in enumerate(sizes * 3):
        arrays = [rng.standard_normal(n).astype(numpy.float32)]
        if i % 3 == 1:
            arrays.append(numpy.arange(i, dtype=numpy.int64))
        if i % 4 == 2:
            arrays = []                      # a header alone (a shared-memory push)
        messages.append((encode_header(Msg.KV_PUSH, 0, i, 7, 0, arrays), arrays))
    stream = b"".join(struct.pack("<I", len(h)) + h + b"".join(a.tobytes() for a in arrays)
                      for h, arrays in messages)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader = directlink._Reader(header_specs)
    b.setblocking(False)
    got, pos = [], 0
    while pos < len(stream):
        step = int(rng.choice([1, 3, 17, 4096, directlink.STAGE_BYTES + 5, 50000]))
        a.sendall(stream[pos:pos + step])
        pos += step
        got.extend(reader.read(b))
    assert reader.read(b) == []
    assert len(got) == len(messages)
    for (header, arrays), (got_header, got_arrays) in zip(messages, got):
        assert got_header == header
        assert len(got_arrays) == len(arrays)
        for x, y in zip(arrays, got_arrays):
            assert x.dtype == y.dtype
            numpy.testing.assert_array_equal(x, y)
    a.close()
    b.close()


def test_a_spinning_read_takes_what_arrives_meanwhile_and_else_sleeps_as_before():
    left, right = _pair()
    arrays = [numpy.arange(5, dtype=numpy.float32)]
    writer = threading.Timer(0.05, lambda: _send(left, arrays))
    writer.start()
    t = time.monotonic()
    got = right.read_ready(5.0, spin=2.0)
    assert time.monotonic() - t < 1.0 and len(got) == 1
    numpy.testing.assert_array_equal(got[0][1][0], arrays[0])
    t = time.monotonic()
    assert right.read_ready(0.05, spin=0.02) == []       # nothing: spin, then select's timeout
    assert 0.04 <= time.monotonic() - t < 1.0
    writer.join()
    left.close()
    right.close()


@pytest.mark.parametrize("workers,servers,cores,one_host,spins", [
    (1, 1, 2, True, True),        # part c: a core each
    (2, 1, 2, True, False),       # more processes than cores: a spinning wait would take one
    (1, 1, 8, False, False),      # across hosts the wait is for the network: no spinning
    (2, 2, 4, True, True),
])
def test_the_last_syncs_wait_spins_only_where_every_process_has_a_core(monkeypatch, workers,
                                                                      servers, cores, one_host,
                                                                      spins):
    from types import SimpleNamespace

    from poseidon.dist.worker import hooks as worker
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    book = SimpleNamespace(data={"one_host": one_host})
    got = worker.spin_seconds(book, Roles(workers, servers))
    assert got == (directlink.SPIN_SECONDS if spins else 0.0)


def test_two_ends_writing_more_than_the_buffer_at_once_both_finish(monkeypatch):
    monkeypatch.setattr(directlink, "MAX_MESSAGE_BYTES", 1 << 26)   # more than a socket holds
    left, right = _pair()
    big = [numpy.arange(3_000_000, dtype=numpy.float32)]           # 12 MB each way
    got = {}

    def other_end():
        # the "server": reads one message, then answers with another big one while the first
        # end is still writing its second message
        got["first"] = _read_one(right)[1]
        answer = big[0][::-1].copy()
        header = encode_header(Msg.KV_VALUE, 2, 3, 7, 0, [answer])
        got["written"] = right.post(header, [answer])     # never waits
        got["second"] = _read_one(right)[1]
        got["written"].wait(10)

    thread = threading.Thread(target=other_end)
    thread.start()
    inbox = []
    _send(left, big)
    _send(left, big, on_messages=lambda msgs: inbox.extend(a for _, a in msgs))
    if not inbox:                       # the answer fitted while the second push was written
        inbox.append(_read_one(left)[1])
    thread.join(30)
    assert not thread.is_alive()
    assert got["written"].done
    numpy.testing.assert_array_equal(inbox[0][0], big[0][::-1])
    numpy.testing.assert_array_equal(got["first"][0], big[0])
    numpy.testing.assert_array_equal(got["second"][0], big[0])
    left.close()
    right.close()


def test_a_writer_whose_reader_never_reads_gets_a_deadline():
    left, right = _pair()
    header = encode_header(Msg.KV_PUSH, 0, 0, 0, 0, [numpy.zeros(4_000_000, numpy.float32)])
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        left.send(header, [numpy.zeros(4_000_000, numpy.float32)], 0.3, lambda msgs: None)
    assert time.monotonic() - t < 5
    left.close()
    right.close()


@pytest.fixture
def local_pair():
    """Worker 0 and server 0 (rank 2) of a 2-worker job, each with a Unix-socket inbox and a
    direct-link listener; the server answers every push of key 5 (like the KV store) on its
    receive path, with the values doubled."""
    made = []

    def make(direct=True):
        roles = Roles(2, 1)
        worker = ZmqTransport(0, namer=roles.name, timeout=5.0, local_ipc=True,
                              direct_links=direct)
        server = ZmqTransport(2, namer=roles.name, timeout=5.0, local_ipc=True,
                              direct_links=direct)
        for t in (worker, server):
            t.bind("127.0.0.1")
            t.start()
        worker.connect(2, server.address, server.local_info)
        server.connect(0, worker.address, worker.local_info)

        def answer(msg):
            server.send(msg.sender, Msg.KV_VALUE, iteration=msg.iteration, key=msg.key,
                        arrays=[msg.arrays[0] * 2])
        server.handle(Msg.KV_PUSH, answer)
        made.extend([worker, server])
        return worker, server
    yield make
    for t in made:
        t.close(0)


def test_a_push_and_its_answer_go_on_the_pushing_threads_own_link(local_pair):
    worker, server = local_pair()
    assert "direct" in worker.local_info and "direct" in server.local_info
    assert localipc.reachable_direct(server.local_info) == server.local_info["direct"]["path"]
    values = numpy.arange(100_000, dtype=numpy.float32)
    results = {}

    def sync(key):
        for it in range(5):
            worker.send(2, Msg.KV_PUSH, iteration=it, key=key, arrays=[values + key])
            results[(key, it)] = worker.receive(Msg.KV_VALUE, key, it, senders=[2])[0]

    threads = [threading.Thread(target=sync, args=(k,)) for k in (5, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for (key, it), msg in results.items():
        assert msg.sender == 2 and msg.iteration == it
        numpy.testing.assert_array_equal(msg.arrays[0], (values + key) * 2)
    assert len(results) == 10
    w, s = worker.counters(), server.counters()
    assert w["direct_messages"] == {"sent": 10, "received": 10}
    assert s["direct_messages"] == {"sent": 10, "received": 10}
    assert s["received_by_type"] == {"KV_PUSH": 10}
    assert w["received_by_type"] == {"KV_VALUE": 10}
    assert w["sent_payload"] == s["recv_payload"] == 10 * values.nbytes
    assert len(worker._links) == 2                       # one link per pushing thread


def test_an_answer_for_another_iteration_goes_by_zeromq_and_still_arrives(local_pair):
    worker, server = local_pair()
    server.handle(Msg.KV_PUSH, lambda msg: None)         # answers by hand below
    worker.send(2, Msg.KV_PUSH, iteration=4, key=5, arrays=[numpy.ones(3)])
    deadline = time.monotonic() + 5
    while server.counters()["direct_messages"]["received"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.send(0, Msg.KV_VALUE, iteration=3, key=5, arrays=[numpy.ones(3)])   # not iteration 4
    assert server.counters()["direct_messages"]["sent"] == 0
    assert worker.receive(Msg.KV_VALUE, 5, 3)[0].iteration == 3
    server.send(0, Msg.KV_VALUE, iteration=4, key=5, arrays=[numpy.full(3, 7.0)])
    assert server.counters()["direct_messages"]["sent"] == 1
    numpy.testing.assert_array_equal(worker.receive(Msg.KV_VALUE, 5, 4)[0].arrays[0], 7.0)


def test_with_direct_links_off_everything_goes_by_zeromq(local_pair):
    worker, server = local_pair(direct=False)
    assert "direct" not in server.local_info
    worker.send(2, Msg.KV_PUSH, iteration=0, key=5, arrays=[numpy.ones(3)])
    numpy.testing.assert_array_equal(worker.receive(Msg.KV_VALUE, 5, 0)[0].arrays[0], 2.0)
    assert worker.counters()["direct_messages"] == {"sent": 0, "received": 0}
    assert worker.routes == {2: "ipc"}


def test_a_closed_link_leaves_the_wait_to_the_mailbox_and_its_deadline(local_pair):
    """A link that closes under a wait does not blame its peer (a server also closes its links
    when it stops because another process failed): the wait goes on as a plain one, where the
    heartbeats and the coordinator's abort name the process that failed first."""
    worker, server = local_pair()
    server.handle(Msg.KV_PUSH, lambda msg: None)          # never answers
    worker.send(2, Msg.KV_PUSH, iteration=0, key=5, arrays=[numpy.ones(3)])
    server._listener.close()                              # the server's end of every link goes
    t = time.monotonic()
    with pytest.raises(DeadlineError, match="KV_VALUE key 5 iteration 0"):
        worker.receive(Msg.KV_VALUE, 5, 0, timeout=0.5)
    assert time.monotonic() - t < 3
    assert not worker._links[0].open


def test_after_a_link_closes_pushes_and_answers_go_by_zeromq(local_pair):
    worker, server = local_pair()
    worker.send(2, Msg.KV_PUSH, iteration=0, key=5, arrays=[numpy.ones(3)])
    numpy.testing.assert_array_equal(worker.receive(Msg.KV_VALUE, 5, 0)[0].arrays[0], 2.0)
    server._listener.close()                              # no more links to this server
    time.sleep(0.2)                                       # (its thread closes their sockets)
    for it in (1, 2):        # the first write finds the link closed, the second cannot reopen it
        worker.send(2, Msg.KV_PUSH, iteration=it, key=5, arrays=[numpy.full(3, 3.0)])
        numpy.testing.assert_array_equal(worker.receive(Msg.KV_VALUE, 5, it)[0].arrays[0], 6.0)
    assert worker.counters()["direct_messages"]["sent"] == 1
    assert server.counters()["received_by_type"] == {"KV_PUSH": 3}
    assert not worker._links[0].open and 2 not in worker.direct_links()


def test_the_listener_goes_away_with_the_inbox_folder(local_pair):
    worker, server = local_pair()
    path = server.local_info["direct"]["path"]
    assert os.path.exists(path)
    server.close(0)
    assert not os.path.exists(path)
    assert localipc.reachable_direct(server.local_info) is None


def test_past_the_link_limit_pushes_go_by_zeromq(local_pair, monkeypatch):
    monkeypatch.setattr(directlink, "MAX_LINKS", 1)
    worker, server = local_pair()
    got = {}

    def sync(key):
        worker.send(2, Msg.KV_PUSH, iteration=0, key=key, arrays=[numpy.full(4, float(key))])
        got[key] = worker.receive(Msg.KV_VALUE, key, 0, senders=[2])[0].arrays[0]

    for key in (5, 6):                   # two threads: the second may not open a link
        t = threading.Thread(target=sync, args=(key,))
        t.start()
        t.join(10)
    numpy.testing.assert_array_equal(got[5], 10.0)
    numpy.testing.assert_array_equal(got[6], 12.0)
    assert len(worker._links) == 1
    assert worker.counters()["direct_messages"] == {"sent": 1, "received": 1}


@pytest.mark.parametrize("garbage", ["long header", "huge arrays", "unknown type"])
def test_bytes_no_member_writes_close_that_link_and_the_server_serves_on(local_pair, garbage,
                                                                          capfd):
    worker, server = local_pair()
    if garbage == "long header":
        data = struct.pack("<I", 1 << 30)
    elif garbage == "huge arrays":
        header = encode_header(Msg.KV_PUSH, 0, 0, 5, 0, [numpy.zeros(3)])
        header = header[:-4] + struct.pack("<I", 1 << 30)          # float64[2^30]: 8 GB
        data = struct.pack("<I", len(header)) + header
    else:
        header = bytearray(encode_header(Msg.KV_PUSH, 0, 0, 5, 0, []))
        header[0] = 99
        data = struct.pack("<I", len(header)) + bytes(header)
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(server.local_info["direct"]["path"])
    stranger.sendall(data)
    assert stranger.recv(1) == b""                      # the server closed that link
    stranger.close()
    assert server.counters()["dropped_messages"] == 1
    assert "on a direct link" in capfd.readouterr().err
    worker.send(2, Msg.KV_PUSH, iteration=0, key=5, arrays=[numpy.ones(3)])
    numpy.testing.assert_array_equal(worker.receive(Msg.KV_VALUE, 5, 0)[0].arrays[0], 2.0)
