"""Hostile control messages: a buggy member (it holds the job's keys) sends 10,000 mutated control
messages to the coordinator, a worker and the server of a live job while it trains.

Each frame starts from a control message as a member sends it (a barrier, an allreduce, a gather,
a query, a registration, a failure, an abort, a collective's answer, a cost report, the schemes
published from the reports) and is made invalid by one mutation: a field of another JSON type, a
missing field, a huge number, a negative index or iteration, a wrong length (a string too long, an
array of the wrong number or shape, a declared size that is not the frame's, a cost report
lacking a link), truncated JSON, an unknown message type (or one the receiver never takes), a
wrong sender. (A valid control message cannot be told from the truth, so the fuzzer never makes
one: a valid FAILED or ABORT would rightly stop the job; so would a bad cost report for a call the
workers wait on, so its calls are never current.) The coordinator's frames go over the members'
own connections to it, so they pass the connection's identity check and reach the field checks.

Expected: 0 crashes and 0 aborts, every frame dropped and counted, the trained parameters bitwise
equal to an undisturbed run (float64); the count per mutation kind is printed and each was tried.

Run: python -m pytest tests/dist/test_hostile_control.py -q -s
"""
import json
import struct

import numpy
import pytest
import zmq

from poseidon.dist.job import security
from poseidon.dist.job.roles import COORDINATOR
from poseidon.dist.transport import Msg, encode_header

from .gated import FuzzRun, member_sockets, run_gated
from .helpers import fc_net, make_lmdb, solver_param
from .test_security import initial_weights

P1, P2 = 2, 1
SERVER = P1
ITERS, CHUNKS = 8, 4
FRAMES = 10_000
FAR = 10 ** 6            # calls this far ahead are never current
KINDS = ("field type", "missing field", "huge number", "negative index", "wrong length",
         "truncated JSON", "unknown type", "wrong sender")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("hostile_control") / "train_lmdb", n=64)


def _templates():
    """(target, message type, sender, JSON object, arrays, aux) as a member sends them; 'coordinator'
    targets are sent over worker 1's or the server's own connection (the sender is that rank)."""
    vec = [numpy.zeros(1)]
    register = {"rank": 1, "address": "tcp://127.0.0.1:1", "host": "h", "role": "worker",
                "options": {}, "description": {}, "solver": "", "pid": 1}
    costs = {"links": {str(r): {"alpha": 1e-4, "beta": 1e9, "encrypted": False}
                       for r in (0, SERVER)}, "flops": 1e10, "encrypt_cost": 0.0}
    return [
        ("coordinator", Msg.BARRIER, 1, {"name": "start", "group": "workers"}, [], 0),
        ("coordinator", Msg.ALLREDUCE, 1, {"name": "loss"}, vec, 0),
        ("coordinator", Msg.GATHER, 1, {"name": "timeline", "item": {"rank": 1}}, [], 0),
        ("coordinator", Msg.QUERY, 1, {"what": "layer", "index": 0}, [], 0),
        ("coordinator", Msg.QUERY, SERVER, {"what": "pairs", "server": 0}, [], 0),
        ("coordinator", Msg.FAILED, SERVER, {"reason": "a fuzzed failure"}, [], 0),
        ("coordinator", Msg.REGISTER, 1, register, [], 0),
        ("coordinator", Msg.COSTS, 1, {"report": costs, "from": 0}, [], 0),
        (0, Msg.ABORT, COORDINATOR, {"reason": "a fuzzed abort"}, [], 0),
        (0, Msg.ALLREDUCE_DONE, COORDINATOR, {"action": "snapshot"}, vec, 0),
        (0, Msg.GATHER_DONE, COORDINATOR, {"items": [1, 2]}, [], 0),
        (0, Msg.QUERY_REPLY, COORDINATOR, {"error": "no such layer"}, [], 0),
        ("server", Msg.ABORT, COORDINATOR, {"reason": "a fuzzed abort"}, [], 0),
        ("server", Msg.QUERY_REPLY, COORDINATOR, {"error": "no such query"}, [], 0),
        (0, Msg.SCHEMES, COORDINATOR, {"from": 4, "choices": {"0": "ps", "1": "sfb"}}, [], 0),
    ]


def _frames(mtype, sender, iteration, obj, arrays, aux=0, body=None):
    """Header and frames; `body` replaces the JSON text (bytes) when given."""
    arrays = [numpy.ascontiguousarray(a) for a in arrays]
    flags = 0
    if obj is not None or body is not None:
        text = body if body is not None else json.dumps(obj).encode()
        arrays.insert(0, numpy.frombuffer(text, numpy.uint8))
        flags = 1
    return [encode_header(int(mtype), sender, iteration, 7, aux, arrays, flags)] + \
        [a.tobytes() for a in arrays]


class ControlFuzzer:
    """Invalid control messages, one mutation each; counts the kinds made."""

    def __init__(self, seed=0):
        self.rs = numpy.random.RandomState(seed)
        self.templates = _templates()
        self.kinds = dict.fromkeys(KINDS, 0)

    def make(self, i):
        """(target, frames) of the i-th invalid message."""
        rs = self.rs
        target, mtype, sender, obj, arrays, aux = self.templates[i % len(self.templates)]
        obj = json.loads(json.dumps(obj))
        kind = KINDS[(i // len(self.templates)) % len(KINDS)]
        it = FAR + int(rs.randint(1000))             # never a current call
        fields = sorted(obj)
        if kind == "field type":                     # every field is checked for its type
            f = fields[rs.randint(len(fields))]
            others = [[1], {"a": 1}, None, 2.5, True, "text", 12]
            obj[f] = [v for v in others if type(v) is not type(obj[f])][rs.randint(6)]
            out = _frames(mtype, sender, it, obj, arrays, aux)
        elif kind == "missing field":
            if mtype == Msg.ALLREDUCE_DONE:          # its one field is optional: lose the vector
                out = _frames(mtype, sender, it, obj, [], aux)
            else:
                del obj[fields[rs.randint(len(fields))]]
                out = _frames(mtype, sender, it, obj, arrays, aux)
        elif kind == "huge number":
            if isinstance(obj.get("index", obj.get("rank")), int):
                obj["index" if "index" in obj else "rank"] = int(rs.choice([2 ** 40, 10 ** 18]))
                out = _frames(mtype, sender, it, obj, arrays, aux)
            elif mtype in (Msg.GATHER, Msg.ALLREDUCE):     # a root or operation no one has
                out = _frames(mtype, sender, it, obj, arrays, 2 ** 31 - 1)
            else:                                           # a declared size past the frame
                out = _frames(mtype, sender, it, obj, arrays, aux)
                head = bytearray(out[0])
                struct.pack_into("<I", head, 24, int(rs.choice([2 ** 31, 2 ** 32 - 1])))
                out[0] = bytes(head)
        elif kind == "negative index":
            if "index" in obj or "server" in obj:
                obj["index" if "index" in obj else "server"] = -int(rs.randint(1, 10 ** 6))
                out = _frames(mtype, sender, it, obj, arrays, aux)
            elif mtype == Msg.GATHER:
                out = _frames(mtype, sender, it, obj, arrays, -1)
            else:
                out = _frames(mtype, sender, int(rs.choice([-1, -(10 ** 9)])), obj, arrays, aux)
        elif kind == "wrong length":
            choice = rs.randint(3)
            if choice == 0 and arrays:               # the vector: two of them, or a matrix
                bad = [arrays[0], arrays[0]] if rs.rand() < 0.5 else [numpy.zeros((2, 3))]
                out = _frames(mtype, sender, it, obj, bad, aux)
            elif choice == 1 and "items" in obj:
                obj["items"] = obj["items"] * 3
                out = _frames(mtype, sender, it, obj, arrays, aux)
            elif "report" in obj:                    # a report lacking the link to one rank
                del obj["report"]["links"][str(int(rs.choice([0, SERVER])))]
                out = _frames(mtype, sender, it, obj, arrays, aux)
            elif "choices" in obj:                   # a scheme's name past its limit
                obj["choices"]["0"] = "x" * 2_000
                out = _frames(mtype, sender, it, obj, arrays, aux)
            else:                                    # a string past its limit
                f = [f for f in fields if isinstance(obj[f], str) and f != "solver"]
                f = f[rs.randint(len(f))] if f else None
                if f is None:
                    obj = dict(obj, items=[0])
                else:
                    obj[f] = "x" * (70_000 if f in ("reason", "error") else 2_000)
                out = _frames(mtype, sender, it, obj, arrays, aux)
        elif kind == "truncated JSON":
            text = json.dumps(obj).encode()
            out = _frames(mtype, sender, it, None, arrays, aux,
                          body=text[:rs.randint(0, len(text))])
        elif kind == "unknown type":
            out = _frames(mtype, sender, it, obj, arrays, aux)
            t = int(rs.choice([0, 15, 99, 255])) if rs.rand() < 0.5 else \
                int(rs.choice([Msg.KV_PUSH, Msg.SF, Msg.BOOK, Msg.WEIGHTS, Msg.KV_SHUTDOWN]))
            out[0] = bytes([t]) + out[0][1:]
        else:                                        # wrong sender
            if target == "coordinator":              # another rank's, a stranger's, or the other role
                wrong = [SERVER if sender == 1 else 1, 77, COORDINATOR]
                if mtype in (Msg.ALLREDUCE, Msg.GATHER):
                    target = "coordinator-via-server"        # a server may not send these
                    wrong.append(SERVER)
            else:
                wrong = [1, SERVER, 77, -5]
            out = _frames(mtype, int(wrong[rs.randint(len(wrong))]), it, obj, arrays, aux)
        self.kinds[kind] += 1
        return target, out


def test_ten_thousand_bad_control_messages_change_nothing(data, tmp_path):
    param = solver_param(fc_net(data, 8), max_iter=ITERS)
    weights = initial_weights(param, tmp_path / "init.caffemodel")
    keys = security.make_keys()
    want, _ = run_gated(param, P1, P2, CHUNKS, keys=keys, weights=weights)

    fuzzer = ControlFuzzer()
    receivers = {}
    live = {}

    def connect():
        sessions = live["sessions"]
        live["ctx"] = zmq.Context()
        live["pushes"] = member_sockets(live["ctx"], keys, sessions, {0: 0, "server": SERVER})
        # to the coordinator over the members' own connections (identity = their rank)
        live["dealers"] = {"coordinator": sessions[1].transport._out[COORDINATOR],
                           "coordinator-via-server": sessions[SERVER].transport._out[COORDINATOR]}

    def send(i):
        target, frames = fuzzer.make(i)
        if target in live["dealers"]:
            if target == "coordinator" and fuzzer.templates[i % len(fuzzer.templates)][2] == SERVER:
                target = "coordinator-via-server"
            sock, lock = live["dealers"][target]
            with lock:
                sock.send_multipart(frames)
        else:
            live["pushes"][target].send_multipart(frames)

    def close():
        for s in live["pushes"].values():
            s.close(linger=5000)
        live["ctx"].term()

    run = FuzzRun(FRAMES, CHUNKS, send,
                  lambda: sum(t.counters()["dropped_messages"] for t in receivers.values()))

    def start(sessions):
        live["sessions"] = sessions
        receivers.update({"coordinator": sessions[0].coordinator.transport,
                          0: sessions[0].transport, "server": sessions[SERVER].transport})

    got, sessions, elapsed = run.train(param, P1, P2, start, connect, close, keys=keys,
                                       weights=weights)
    coordinator = sessions[0].coordinator
    assert coordinator.aborted_reason is None and coordinator.error is None
    counts = {name: t.counters()["dropped_messages"] for name, t in receivers.items()}
    assert sum(counts.values()) == FRAMES, counts
    for a, b in zip(got, want):
        numpy.testing.assert_array_equal(a, b)
    print(f"\n{FRAMES} invalid control messages from a member with the job's keys during {ITERS} "
          f"iterations: 0 crashes, 0 aborts, all dropped and counted (coordinator "
          f"{counts['coordinator']}, worker 0 {counts[0]}, server {counts['server']}), "
          f"parameters bitwise equal to the undisturbed run; {elapsed:.1f} s\nkinds: "
          + ", ".join(f"{k} {v}" for k, v in fuzzer.kinds.items()))
    assert all(fuzzer.kinds[k] > 0 for k in KINDS), fuzzer.kinds
