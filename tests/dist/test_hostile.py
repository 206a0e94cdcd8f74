"""Hostile and broken messages: a buggy member (it holds the job's keys) sends >= 10,000 random and
mutated frames to a live server and live workers during training.

Every frame is invalid in at least one way a process must catch: random bytes, truncated or
bit-flipped real headers, wrong iteration, unknown key, wrong shape, wrong dtype, wrong message
type for the receiver, wrong frame count, declared sizes that do not match the frames (oversized),
a sender outside the job, bad JSON. (A well-formed message with the current iteration, a real key
and the right shape cannot be told from the truth by any check, so the fuzzer never makes one.)
Wrong shapes and dtypes are also sent with the iterations the job is at, so the server's
"disagreement" bookkeeping sees them and must let the real push clear them.

Expected: 0 crashes, every frame dropped and counted (the receivers' dropped counters add up to the
frames sent), and the trained parameters bitwise equal to an undisturbed run (float64).

A second test sends valid ring pieces (the right sender, key and length) for iterations the job
never reaches: refused at the door for being too far ahead, the result bitwise unchanged.

Run: python -m pytest tests/dist/test_hostile.py -q -s
"""
import struct
import threading
import time

import numpy
import pytest

from poseidon.dist.coord.checks import WireRules
import zmq

from poseidon.dist.job import security
from poseidon.dist.coord.book import InformationBook
from poseidon.dist.transport import Msg, encode_header

from .gated import FuzzRun, member_sockets, run_gated
from .helpers import conv_net, make_lmdb, solver_param
from .test_security import initial_weights

P1, P2 = 2, 1
ITERS, CHUNKS = 12, 6
FRAMES = 10_000
FAR = 10 ** 6            # iterations this far away are never current


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("hostile") / "train_lmdb", n=64)


class Fuzzer:
    """Makes invalid messages from templates of the real traffic (the book's keys and shapes)."""

    def __init__(self, book, seed=0):
        self.rs = numpy.random.RandomState(seed)
        self.book = book
        self.dtype = numpy.dtype(book.data["dtype"])
        self.pairs = book.pairs
        self.bundles = book.bundles
        self.sfb = [rec for rec in book.layers if rec.scheme == "sfb"]
        self.kinds = {}

    # ----- templates: real messages but at an iteration that is never current -------------------
    def template(self, target):
        rs = self.rs
        if target == "server":
            bundle = self.bundles[rs.randint(len(self.bundles))]
            return (Msg.KV_PUSH, int(rs.randint(P1)), bundle.id, self.zeros(bundle))
        if self.sfb and rs.rand() < 0.5:
            rec = self.sfb[rs.randint(len(self.sfb))]
            sender = 1 - target          # the other worker
            return (Msg.SF, sender, rec.index,
                    [numpy.zeros((rec.K, rec.M), self.dtype),
                     numpy.zeros((rec.K, rec.N), self.dtype),
                     numpy.zeros(rec.M, self.dtype)])
        bundle = self.bundles[rs.randint(len(self.bundles))]
        return (Msg.KV_VALUE, P1 + bundle.server, bundle.id, self.zeros(bundle))

    def zeros(self, bundle):
        """The arrays of one KV message: one per pair of the bundle."""
        return [numpy.zeros(self.pairs[k].length, self.dtype) for k in bundle.pairs]

    def frames(self, mtype, sender, iteration, key, arrays, flags=0):
        return [encode_header(mtype, sender, iteration, key, 0, arrays, flags)] + \
            [a.tobytes() for a in arrays]

    # ----- mutations: each makes the message invalid ----------------------------------------------
    def make(self, target):
        rs = self.rs
        mtype, sender, key, arrays = self.template(target)
        far = int(rs.choice([-1, -(10 ** 9), FAR + rs.randint(1000), 2 ** 62]))
        plausible = int(rs.randint(0, ITERS + 2))
        kind = rs.randint(13)
        name = ""
        if kind == 0:
            name = "random bytes"
            out = [rs.bytes(rs.randint(0, 300)) for _ in range(rs.randint(1, 4))]
        elif kind == 1:
            name = "truncated header"
            head = self.frames(mtype, sender, far, key, arrays)[0]
            out = [head[:rs.randint(0, len(head))]] + [a.tobytes() for a in arrays]
        elif kind == 2:
            name = "flipped header bits"
            f = self.frames(mtype, sender, far, key, arrays)
            head = bytearray(f[0])
            for _ in range(rs.randint(1, 4)):      # not the type byte: "wrong type" does that
                head[rs.randint(1, len(head))] ^= 1 << rs.randint(8)
            if 0 <= struct.unpack_from("<q", head, 4)[0] < FAR:
                # flips that turned the far iteration into a near one (2**62 -> 8) can make a
                # valid message, which a member holding the keys may send: keep it far
                struct.pack_into("<q", head, 4, far)
            out = [bytes(head)] + f[1:]
        elif kind == 3:
            name = "wrong iteration"
            out = self.frames(mtype, sender, far, key, arrays)
        elif kind == 4:
            name = "unknown key"
            out = self.frames(mtype, sender, plausible, int(rs.choice([-7, 10 ** 5, 2 ** 30])),
                              arrays)
        elif kind == 5:
            name = "wrong shape"
            a = arrays[0]
            bad = numpy.zeros(a.size + 1 + rs.randint(5), a.dtype) if rs.rand() < 0.5 else \
                numpy.zeros((2,) + a.shape, a.dtype)
            out = self.frames(mtype, sender, plausible, key, [bad] + arrays[1:])
        elif kind == 6:
            name = "wrong dtype"
            other = numpy.float32 if self.dtype == numpy.float64 else numpy.float64
            out = self.frames(mtype, sender, plausible, key,
                              [a.astype(other) for a in arrays])
        elif kind == 7:
            name = "wrong type"
            wrong = ([Msg.SF, Msg.KV_VALUE, Msg.BOOK, Msg.WEIGHTS, Msg.KV_GET_REPLY, Msg.ABORT,
                      Msg.KV_SHUTDOWN, Msg.HEARTBEAT] if target == "server" else
                     [Msg.KV_PUSH, Msg.KV_INIT, Msg.REGISTER, Msg.BOOK, Msg.ABORT,
                      Msg.KV_SHUTDOWN, Msg.HEARTBEAT, Msg.CURSOR])
            t = wrong[rs.randint(len(wrong))] if rs.rand() < 0.8 else int(rs.choice([0, 99, 255]))
            out = self.frames(mtype, sender, far, key, arrays)
            out[0] = bytes([int(t)]) + out[0][1:]
        elif kind == 8:
            name = "wrong frame count"
            out = self.frames(mtype, sender, plausible, key, arrays)
            out = out[:-1] if rs.rand() < 0.5 else out + [b"extra"]
        elif kind == 9:
            name = "oversized declared size"
            out = self.frames(mtype, sender, plausible, key, arrays)
            head = bytearray(out[0])
            # the first array's first dimension: after the 22-byte fixed part and its 2-byte spec
            struct.pack_into("<I", head, 24, int(rs.choice([2 ** 31, 2 ** 32 - 1, 10 ** 9])))
            out[0] = bytes(head)
        elif kind == 10:
            name = "not a member"
            out = self.frames(mtype, int(rs.choice([77, -5, 32767, -1])), plausible, key, arrays)
        elif kind == 11:
            name = "bad JSON"
            body = rs.choice([b"[1, 2]", b"{\"reason\": ", b"\xff\xfe", b"42"])
            out = self.frames(Msg.ABORT if target != "server" else Msg.KV_GET, sender, far, key,
                              [numpy.frombuffer(body, numpy.uint8)], flags=1)
        else:
            name = "too many arrays"
            head = bytearray(self.frames(mtype, sender, plausible, key, arrays)[0])
            struct.pack_into("<H", head, 20, int(rs.choice([65, 1000, 65535])))
            out = [bytes(head)] + [a.tobytes() for a in arrays]
        self.kinds[name] = self.kinds.get(name, 0) + 1
        return out


def test_ten_thousand_bad_frames_change_nothing(data, tmp_path):
    param = solver_param(conv_net(data, 8), max_iter=ITERS)
    weights = initial_weights(param, tmp_path / "init.caffemodel")
    keys = security.make_keys()
    want, quiet = run_gated(param, P1, P2, CHUNKS, keys=keys, weights=weights)
    book = InformationBook.from_wire(quiet[0].book.to_wire())
    assert any(r.scheme == "sfb" for r in book.layers) and book.pairs, "need PS and SFB"

    targets = {}
    fuzzer = Fuzzer(book)
    order = ["server", 1, 0]
    live = {}

    def connect():
        live["ctx"] = zmq.Context()
        live["socks"] = member_sockets(live["ctx"], keys, live["sessions"],
                                       {"server": P1, 0: 0, 1: 1})

    def send(i):
        target = order[i % 3]
        live["socks"][target].send_multipart(fuzzer.make(target))

    def close():
        test_ten_thousand_bad_frames_change_nothing.kinds = fuzzer.kinds
        for s in live["socks"].values():
            s.close(linger=5000)
        live["ctx"].term()

    run = FuzzRun(FRAMES, CHUNKS, send,
                  lambda: sum(s.transport.counters()["dropped_messages"]
                              for s in targets.values()))
    started = threading.Event()

    def start(sessions):
        started.set()
        live["sessions"] = sessions
        targets.update({rank: sessions[rank] for rank in (P1, 0, 1)})

    got, sessions, elapsed = run.train(param, P1, P2, start, connect, close, keys=keys,
                                       weights=weights)
    assert started.is_set()
    counts = {r: s.transport.counters() for r, s in sessions.items()}
    total_dropped = sum(c["dropped_messages"] for c in counts.values())
    assert total_dropped == FRAMES, {r: c["dropped_messages"] for r, c in counts.items()}
    for r, c in counts.items():          # what the job itself exchanged is untouched
        q = quiet[r].transport.counters()["received_by_type"]
        for name in ("KV_PUSH", "KV_VALUE", "SF", "ABORT", "WEIGHTS"):
            assert c["received_by_type"].get(name, 0) == q.get(name, 0), (r, name)
    for a, b in zip(got, want):
        numpy.testing.assert_array_equal(a, b)
    kinds = test_ten_thousand_bad_frames_change_nothing.kinds
    print(f"\n{FRAMES} invalid frames from a member with the job's keys to server 0, worker 0 "
          f"and worker 1 during {ITERS} iterations: 0 crashes, {total_dropped} dropped and "
          f"counted (server {counts[P1]['dropped_messages']}, worker 0 "
          f"{counts[0]['dropped_messages']}, worker 1 {counts[1]['dropped_messages']}), "
          f"parameters bitwise equal to the undisturbed run; {elapsed:.1f} s\nkinds: "
          + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))


# ----- valid ring pieces for iterations not reached -----------------------------------------------
def test_ring_pieces_far_ahead_are_refused_during_training(data, tmp_path, capfd):
    """A member with the job's keys sends worker 1 300 ring pieces of valid length for every slot
    of its ring layers, claiming its left neighbour, for iterations the job never reaches: all
    300 refused at the door and counted, one line logged for them, nothing of them left waiting,
    and the parameters bitwise equal to an undisturbed run."""
    from poseidon.dist.schemes.allreduce import plan_of
    from poseidon.dist.schemes.ring import ring_key
    param = solver_param(conv_net(data, 8), max_iter=ITERS)
    weights = initial_weights(param, tmp_path / "init.caffemodel")
    keys = security.make_keys()
    job = dict(keys=keys, weights=weights, sync="allreduce")
    want, quiet = run_gated(param, P1, P2, CHUNKS, **job)
    book = InformationBook.from_wire(quiet[0].book.to_wire())
    ring = [rec for rec in book.layers if rec.scheme == "allreduce"]
    assert ring, "need layers on the ring"
    dtype = numpy.dtype(book.data["dtype"])
    pieces = [(ring_key(rec.index, slot), plan_of(rec, P1).expected_length(slot, 1))
              for rec in ring for slot in range(plan_of(rec, P1).slots)]
    flood, seen = 300, {}

    def gate(chunk, sessions):
        import threading
        if threading.current_thread().name != "role-0" or chunk != 2:
            return
        t = sessions[1].transport
        ctx = zmq.Context()
        sock = member_sockets(ctx, keys, sessions, {"w1": 1})["w1"]
        def taken_in():          # pieces filed or dropped
            c = t.counters()
            return c["received_by_type"].get("RING", 0) + c["dropped_messages"]
        before, dropped = taken_in(), t.counters()["dropped_messages"]
        for i in range(flood):
            key, length = pieces[i % len(pieces)]
            arrays = [numpy.ones(length, dtype)]
            sock.send_multipart([encode_header(Msg.RING, 0, ITERS + 10 + i, key, 0, arrays)]
                                + [a.tobytes() for a in arrays])
        deadline = time.monotonic() + 60
        while taken_in() - before < flood and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["dropped"] = t.counters()["dropped_messages"] - dropped
        seen["held"] = t.mailbox.held_bytes(0)
        sock.close(linger=0)
        ctx.term()
    got, sessions = run_gated(param, P1, P2, CHUNKS, gate=gate, **job)
    assert seen["dropped"] == flood, seen
    assert all(m.iteration < ITERS for box in sessions[1].transport.mailbox._boxes.values()
               for m in box)
    log = capfd.readouterr().err
    lines = [line for line in log.splitlines() if "ahead of the iteration" in line]
    assert len(lines) == 1 and "dropped a message from worker 0" in lines[0], lines
    for a, b in zip(got, want):
        numpy.testing.assert_array_equal(a, b)
    print(f"\n{flood} valid ring pieces for iterations {ITERS + 10} to {ITERS + 9 + flood} into "
          f"worker 1 during training: all refused and counted, parameters bitwise equal\n"
          f"{lines[0]}")


# ----- real disagreements are reported naming both ranks ------------------------------------------
def _small_book(workers=2, servers=1, dtype="float64"):
    from .test_cost_book import _description
    desc = _description([("Convolution", 4, 6, 2, False), ("InnerProduct", 50, 70, 3, True)])
    desc["dtype"] = dtype
    return InformationBook.build(desc, workers, servers,
                                 {"sync": "hybrid", "kv_pair_bytes": 1 << 20, "dtype": dtype})


def test_a_worker_that_really_pushes_the_wrong_dtype_is_named_with_the_other(capfd):
    """Worker 1 pushes float32 where the pair (and worker 0) is float64 and sends nothing valid:
    the server drops it, keeps serving, and after half of --timeout stops naming both."""
    from poseidon.dist.errors import DistError
    from poseidon.dist.kv.store import KVServer
    from poseidon.dist.job.roles import Roles
    from poseidon.dist.transport import Message, ZmqTransport
    from poseidon.engine.solvers.rules import make_rule
    from .helpers import fc_net
    roles = Roles(2, 1)
    book = _small_book()
    t = ZmqTransport(2, namer=roles.name, timeout=0.4, rules=WireRules(2, roles, roles.name))
    try:
        server = KVServer(t, book, roles, make_rule(solver_param(fc_net("x", 1))))
        bundle = book.bundles_on_server(0)[0]
        sizes = [book.pairs[k].length for k in bundle.pairs]
        for k, n in zip(bundle.pairs, sizes):
            server.on_init(Message(Msg.KV_INIT, 0, 0, k, 0, [numpy.zeros(n)], None, 30, 8))
        server.on_push(Message(Msg.KV_PUSH, 0, 0, bundle.id, 0,
                               [numpy.ones(n) for n in sizes], None, 30, 8))
        server.on_push(Message(Msg.KV_PUSH, 1, 0, bundle.id, 0,
                               [numpy.ones(n, numpy.float32) for n in sizes], None, 30, 8))
        assert t.counters()["dropped_messages"] == 1
        server._check_disagreements()                     # not yet: it may be a stray message
        time.sleep(0.3)
        with pytest.raises(DistError) as err:
            server._check_disagreements()
    finally:
        t.close(0)
    text = str(err.value)
    assert text.startswith("worker 1 and worker 0 disagree about KV pair"), text
    assert "worker 0 pushed float64" in text, text
    assert "float32" in text and "\n" not in text
    log = capfd.readouterr().err
    assert "dropped a message from worker 1" in log
    print(f"\nserver: {text}")


def test_a_peer_whose_factors_really_disagree_is_named_in_the_deadline_error():
    """Worker 1's sufficient factors have the wrong width: worker 0 drops them at the door, and
    its wait for them ends in a deadline error that says why, naming both workers."""
    from poseidon.dist.errors import DeadlineError
    from poseidon.dist.job.roles import Roles
    from poseidon.dist.transport import ZmqTransport
    roles = Roles(2, 1)
    book = _small_book()
    rec = [r for r in book.layers if r.scheme == "sfb"][0]
    a = ZmqTransport(0, namer=roles.name, timeout=2.0, rules=WireRules(0, roles, roles.name))
    b = ZmqTransport(1, namer=roles.name, timeout=2.0, rules=WireRules(1, roles, roles.name))
    try:
        for t in (a, b):
            t.bind("127.0.0.1")
            t.set_book(book)
            t.start()
        b.connect(0, a.address)
        K, M, N = rec.K, rec.M, rec.N
        b.send(0, Msg.SF, iteration=3, key=rec.index,
               arrays=[numpy.ones((K, M)), numpy.ones((K, N + 1)), numpy.ones(M)])
        with pytest.raises(DeadlineError) as err:
            a.receive(Msg.SF, rec.index, 3, senders=[1], timeout=1.0,
                      what=f"the sufficient factors of layer '{rec.name}' for iteration 3")
        # a good message afterwards is taken
        b.send(0, Msg.SF, iteration=4, key=rec.index,
               arrays=[numpy.ones((K, M)), numpy.ones((K, N)), numpy.ones(M)])
        assert a.receive(Msg.SF, rec.index, 4, senders=[1])[0].sender == 1
    finally:
        a.close(0)
        b.close(0)
    text = str(err.value)
    assert "from worker 1" in text and "worker 0 expects" in text, text
    assert f"float64[{K}, {N + 1}]" in text, text
    print(f"\nworker 0: {text}")
