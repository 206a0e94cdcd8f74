"""Ring pieces from a member that holds the job's keys but does not follow the ring.

- A flood of valid-length pieces for iterations the receiver has not reached: those more than
  a few iterations ahead of the iteration the worker is at are refused at the door (one logged
  line per sender, every one counted), and what does wait is held within the mailbox's byte limit;
  pieces filed before the worker took any are let go once it takes its first, and a piece that
  comes in slices is refused at its first slice, before its whole is allocated.
- Two pieces for one slot, both claiming the left neighbour: the first is kept, the second is
  dropped as a second piece for that slot, the line saying where each came from (a Unix socket's
  process, or a TCP peer's address), not that the neighbour repeated itself.
- A piece holding NaN/Inf stops the job at once with one line naming the layer, the piece and
  the worker it came from, before it is added to anything or passed on.

Run: python -m pytest tests/dist/test_ring_pieces.py -q -s
"""
import os
import time
from types import SimpleNamespace

import numpy
import pytest

from poseidon.dist.coord.checks import WireRules
import zmq

from poseidon.dist.coord.book import InformationBook
from poseidon.dist.coord.records import description_from_wire
from poseidon.dist.errors import DistError
from poseidon.dist.job.roles import Roles
from poseidon.dist.schemes import allreduce
from poseidon.dist.schemes.ring import ring_key, ring_plan
from poseidon.dist.transport import Msg, ZmqTransport
from poseidon.dist.transport import mailbox as mailbox_module

from .strangers import _forged
from .test_ring_neighbours import Hub, scheme_at

ROLES = Roles(2, 1)
LAYER = 0
WINDOW = 4                 # iterations ahead of the worker's a piece may be (mailbox.STEP_WINDOW)


def ring_book(M, N, workers=2):
    """A book of one layer (M x N weight, M bias) synced by the ring, float64."""
    params = [{"id": 0, "name": "fc[0]", "layer": LAYER, "owner": [LAYER, 0], "shape": [M, N],
               "count": M * N, "lr_mult": 1.0, "decay_mult": 1.0, "shared": False,
               "synced": True},
              {"id": 1, "name": "fc[1]", "layer": LAYER, "owner": [LAYER, 1], "shape": [M],
               "count": M, "lr_mult": 1.0, "decay_mult": 1.0, "shared": False, "synced": True}]
    rec = {"index": LAYER, "name": "fc", "type": "InnerProduct", "M": M, "N": N, "K": 4,
           "sfb": True, "params": [0, 1], "shapes": [[M, N], [M]]}
    desc = description_from_wire({"net": "t", "dtype": "float64", "iter_size": 1,
                                  "layers": [rec], "params": params})
    return InformationBook.build(desc, workers, 1, {"sync": "allreduce",
                                                    "kv_pair_bytes": 1 << 20})


class Worker1:
    """Worker 1 of a two-worker ring with `book`, and the way into it of worker 0 (over a Unix
    socket, as on one host) and of another member holding the job's keys (over TCP, a PUSH that
    claims to be worker 0)."""

    def __init__(self, book, slice_bytes=None):
        self.book = book
        self.t = ZmqTransport(1, namer=ROLES.name, rules=WireRules(1, ROLES, ROLES.name),
                              timeout=10.0, local_ipc=True)
        sliced = {} if slice_bytes is None else {"slice_bytes": slice_bytes}
        self.honest = ZmqTransport(0, namer=ROLES.name, rules=WireRules(0, ROLES, ROLES.name),
                                   timeout=10.0,
                                   local_ipc=True, **sliced)
        for t in (self.t, self.honest):
            t.bind("127.0.0.1")
            t.set_book(book)
            t.start()
        self.honest.connect(1, self.t.address, self.t.local_info)
        self.ctx = zmq.Context()
        self.member = self.ctx.socket(zmq.PUSH)
        self.member.setsockopt(zmq.LINGER, 0)
        self.member.connect(self.t.address)
        plan = ring_plan(sum(int(numpy.prod(s)) for s in book.layers[0].shapes), 2,
                         allreduce.PIECE_FLOATS)
        self.slots = plan.slots
        self.length = plan.expected_length(0, 1)

    def piece(self, value=0.0):
        return numpy.full(self.length, value)

    def forge(self, slot, iteration, value=1.0):
        """A valid-length piece for `slot` from the member, claiming worker 0."""
        self.member.send_multipart(_forged(Msg.RING, 0, [self.piece(value)], iteration=iteration,
                                           key=ring_key(LAYER, slot)))

    def settle(self, n, limit=30.0):
        """Wait until worker 1 has taken in (filed or dropped) n messages in all."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            c = self.t.counters()
            if c["recv_messages"] + c["dropped_messages"] >= n:
                return c
            time.sleep(0.01)
        raise AssertionError(f"worker 1 took in {self.t.counters()} of {n} messages")

    def take(self, slot, iteration):
        return self.t.receive(Msg.RING, ring_key(LAYER, slot), iteration, senders=[0],
                              timeout=5.0)[0]

    def close(self):
        self.member.close(0)
        self.ctx.term()
        for t in (self.honest, self.t):
            t.close(0)


def held_bytes(mailbox):
    boxes = sum(m.payload_bytes for box in mailbox._boxes.values() for m in box)
    return boxes + sum(m.payload_bytes for m in mailbox._fifo)


def peak_resident():
    """VmHWM of this process, bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def ahead_lines(log, who="worker 0"):
    return [line for line in log.splitlines()
            if f"dropped a message from {who}" in line and "ahead" in line]


# ----- a flood of pieces for iterations not reached -----------------------------------------------
def test_three_hundred_future_pieces_are_refused_and_memory_stays_bounded(capfd):
    """Worker 1 is at iteration 3; a member sends 300 valid-length pieces (1.92 MB each) for
    iterations 4 to 153, in batches it lets worker 1 read. Only those within the window are
    filed; the peak resident size grows by far less than the 576 MB the flood carries."""
    w = Worker1(ring_book(480, 1000))          # 480,480 floats: one piece of 240,240 a chunk
    try:
        assert w.length * 8 > 1.9e6 and w.slots == 2
        w.honest.send(1, Msg.RING, iteration=3, key=ring_key(LAYER, 0), arrays=[w.piece()])
        assert w.take(0, 3).sender == 0
        capfd.readouterr()
        before = peak_resident()
        sent = 1
        for i in range(150):
            for slot in range(w.slots):
                w.forge(slot, 4 + i)
                sent += 1
            if i % 5 == 4:                     # at most 10 pieces in flight
                w.settle(sent)
        c = w.settle(sent)
        grew = peak_resident() - before
        box = w.t.mailbox
        filed = WINDOW * w.slots
        assert c["dropped_messages"] == 300 - filed, (
            f"{c['dropped_messages']} refused, {held_bytes(box) / 1e6:.0f} MB filed, peak "
            f"resident size +{grew / 1e6:.0f} MB")
        assert c["recv_messages"] == 1 + filed, c
        assert held_bytes(box) == filed * w.length * 8
        assert box.held_bytes() == held_bytes(box) <= box.peer_limit
        lines = ahead_lines(capfd.readouterr().err)
        assert len(lines) == 1, lines                  # logged once for the sender
        assert grew < 64 << 20, f"peak resident size grew by {grew / 1e6:.0f} MB"
        # the pieces within the window are the ones worker 1 takes when it gets there
        assert w.take(1, 3 + WINDOW).iteration == 3 + WINDOW
        assert mailbox_module.STEP_WINDOW == WINDOW
    finally:
        w.close()
    print(f"\n300 future pieces of 1.92 MB: {filed} filed (the window of {WINDOW} iterations), "
          f"{300 - filed} refused, 1 line logged; peak resident size +{grew / 1e6:.1f} MB\n"
          f"{lines[0]}")


def test_pieces_before_the_first_take_are_bounded_then_let_go(capfd, monkeypatch):
    """Before worker 1 has taken anything it does not know its iteration: the flood is held
    within the byte limit of its sender (the floor lowered here to keep the test small), and
    once worker 1 takes its first piece those beyond the window are let go."""
    monkeypatch.setattr(mailbox_module, "PEER_BYTES", 4 << 20)
    w = Worker1(ring_book(200, 500))           # 100,200 floats: pieces of 50,100 (401 KB)
    try:
        piece = w.length * 8
        for i in range(150):
            for slot in range(w.slots):
                w.forge(slot, 1000 + i)
        c = w.settle(300)
        box = w.t.mailbox
        assert c["dropped_messages"] > 250, (
            f"{c['dropped_messages']} refused, {held_bytes(box) / 1e6:.0f} MB filed")
        limit = box.peer_limit
        assert limit == max(4 << 20, mailbox_module.PEER_MODELS * 100_200 * 8), limit
        assert box.held_bytes() == held_bytes(box) <= limit
        held = limit // piece
        assert c["recv_messages"] == held and c["dropped_messages"] == 300 - held, c
        log = capfd.readouterr().err
        assert sum("at most" in line and "worker 0" in line for line in log.splitlines()) == 1, log
        # worker 1 reaches iteration 3: everything filed for 1000 and later goes
        w.honest.send(1, Msg.RING, iteration=3, key=ring_key(LAYER, 0), arrays=[w.piece()])
        assert w.take(0, 3).sender == 0
        assert box.held_bytes() == held_bytes(box) == 0
        c = w.t.counters()
        assert c["recv_messages"] == 1 and c["dropped_messages"] == 300, c
    finally:
        w.close()
    print(f"\n300 pieces before the first take: {held} held ({limit / 1e6:.1f} MB "
          f"limit), let go when worker 1 took iteration 3")


def test_a_sliced_piece_far_ahead_is_refused_at_its_first_slice():
    """A piece larger than the slice size comes in slices; one for an iteration far ahead is
    refused at each slice, before its whole is allocated, not once put together."""
    w = Worker1(ring_book(200, 500), slice_bytes=64 << 10)      # pieces of 401 KB: 7 slices
    try:
        w.honest.send(1, Msg.RING, iteration=3, key=ring_key(LAYER, 0), arrays=[w.piece()])
        assert w.take(0, 3).sender == 0
        slices = -(-w.length * 8 // (64 << 10))
        w.honest.send(1, Msg.RING, iteration=50, key=ring_key(LAYER, 1), arrays=[w.piece()])
        c = w.settle(1 + slices)
        assert c["dropped_messages"] == slices and len(w.t._assembler) == 0, c
        assert w.t.mailbox.refused == {"ahead": slices}
    finally:
        w.close()


# ----- two pieces for one slot --------------------------------------------------------------------
def test_a_second_piece_for_a_slot_is_named_as_such_with_where_each_came_from(capfd):
    """The member's piece comes first and is the one kept (no check can tell it from worker 0's);
    worker 0's own piece, arriving after it, is dropped as a second piece for the slot, and the
    line says which connection each came over: the kept one from 127.0.0.1 over TCP, the second
    from this process over a Unix socket. It does not say worker 0 repeated itself."""
    w = Worker1(ring_book(20, 30))
    try:
        if w.t.local_info is None:
            pytest.skip("no Unix-socket inbox on this system")
        # taken before worker 0's arrives
        w.forge(0, 5, value=7.0)
        w.settle(1)
        assert w.take(0, 5).arrays[0][0] == 7.0
        w.honest.send(1, Msg.RING, iteration=5, key=ring_key(LAYER, 0), arrays=[w.piece()])
        w.settle(2)
        # still waiting when worker 0's arrives
        w.forge(1, 5, value=7.0)
        w.settle(3)
        w.honest.send(1, Msg.RING, iteration=5, key=ring_key(LAYER, 1), arrays=[w.piece()])
        c = w.settle(4)
        assert w.take(1, 5).arrays[0][0] == 7.0
        assert c["dropped_messages"] == 2, c
        log = capfd.readouterr().err
    finally:
        w.close()
    lines = [line for line in log.splitlines() if "dropped a message" in line]
    assert len(lines) == 2, log
    pid = os.getpid()
    for line, slot in zip(lines, (0, 1)):
        assert "already taken" not in line and "a copy of a message" not in line, line
        assert f"a second piece for slot {slot} of layer 'fc'" in line, line
        assert "iteration 5" in line and "claiming to be from worker 0" in line, line
        assert f"process {pid}" in line and "Unix socket" in line, line
        assert "127.0.0.1 over TCP" in line, line
    print("\n" + "\n".join(lines))


# ----- a piece holding NaN ------------------------------------------------------------------------
def test_a_piece_holding_nan_stops_the_receiver_naming_layer_piece_and_sender():
    """Worker 0's first piece to worker 1 (over a stand-in transport) holds a NaN: worker 1 stops
    on it with one line, before it adds it to its own gradient or passes anything on."""
    hub = Hub()
    schemes = [scheme_at(r, 2, hub.transport(r), seed=3) for r in range(2)]
    send = schemes[0].ctx.transport.send

    def poisoned(dest, mtype, iteration=0, key=0, arrays=(), **kw):
        bad = numpy.array(arrays[0])
        bad[1] = numpy.nan
        return send(dest, mtype, iteration=iteration, key=key, arrays=[bad], **kw)
    schemes[0].ctx.transport.send = poisoned
    stats = SimpleNamespace(sent=lambda receipt: None, received=lambda msg: None)
    schemes[0].send(4, stats)
    schemes[1].send(4, stats)
    sent_before = len(hub.log)
    with pytest.raises(DistError) as err:
        schemes[1].receive(4, stats)
    text = str(err.value)
    assert "\n" not in text
    assert "layer 'fc'" in text and "piece 0 of chunk 1" in text, text
    assert "from worker 0" in text and "NaN/Inf" in text and "iteration 4" in text, text
    assert len(hub.log) == sent_before, "worker 1 passed something on after the bad piece"
    assert not schemes[1].ctx.rule.grads, "worker 1 applied a gradient"
    print(f"\nworker 1: {text}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from .helpers import make_lmdb
    return make_lmdb(tmp_path_factory.mktemp("ring_pieces") / "train")


@pytest.mark.slow
def test_a_job_stops_on_a_nan_piece_naming_it_not_the_loss(data, monkeypatch):
    """A job of two workers whose worker 0 sends a piece of layer ip2 holding NaN at iteration
    1 (its own gradient was finite when it was checked): the job stops at iteration 1 with a line
    naming ip2, the piece and worker 0, not at the next iteration on a NaN loss."""
    from .helpers import fc_net, run_threads, solver_param
    real = allreduce.AllReduceScheme._pass_on

    def pass_on(self, it, phase, step, j, piece, stats):
        if self.ctx.rank == 0 and self.syncer.name == "ip2" and it == 1:
            piece = numpy.array(piece)
            piece[0] = numpy.nan
        real(self, it, phase, step, j, piece, stats)
    monkeypatch.setattr(allreduce.AllReduceScheme, "_pass_on", pass_on)
    with pytest.raises(DistError) as err:
        run_threads(solver_param(fc_net(data, 4), max_iter=4), 2, 1, sync="allreduce",
                    timeout=20)
    text = str(err.value)
    print(f"\n{text}")
    assert "\n" not in text
    assert "loss" not in text, text
    assert "layer 'ip2'" in text and "from worker 0" in text and "NaN/Inf" in text, text
    assert "iteration 1" in text, text
