"""A live coordinator given control messages a buggy member could send: each is dropped, logged and
counted, the job goes on, and the collectives that never complete are bounded.

Run: python -m pytest tests/dist/test_control.py -q -s
"""
import threading
import time

import numpy
import pytest

from poseidon.dist.collectives import MOST_OPEN
from poseidon.dist.coordinator import _key
from poseidon.dist.roles import COORDINATOR
from poseidon.dist.transport import Message, Msg

from .test_coordinator import OPTIONS, close, register_all, start_job
from .test_cost_book import _description


@pytest.fixture
def job():
    """A coordinator with three workers and a server, registered; yields (coordinator, clients)."""
    roles, coord, clients = start_job(3, 1)
    try:
        desc = _description([("InnerProduct", 64, 32, 4, True), ("Convolution", 8, 27, 4, False)])
        register_all(roles, clients, desc, OPTIONS)
        assert coord.book is not None
        yield coord, clients
    finally:
        close(coord, clients)


def dropped(coord):
    return coord.transport.counters()["dropped_messages"]


def still_serves(coord, clients):
    """The job goes on: a query is answered and an allreduce of every worker completes."""
    assert coord.aborted_reason is None, coord.aborted_reason
    assert clients[1].query("best_scheme", index=0) == coord.book.best_scheme(0)
    results = {}

    def reduce(rank):
        results[rank] = clients[rank].allreduce("after", [float(rank)], op="sum")
    threads = [threading.Thread(target=reduce, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert [results[r][0] for r in range(3)] == [3.0, 3.0, 3.0]
    assert coord.aborted_reason is None


def test_a_gather_without_its_json_object_is_dropped_and_the_job_goes_on(job, capfd):
    coord, clients = job
    before = dropped(coord)
    clients[1].transport.send(COORDINATOR, Msg.GATHER, iteration=0, key=_key("timeline"), aux=0)
    still_serves(coord, clients)
    assert dropped(coord) == before + 1
    assert "dropped a message from worker 1: GATHER carries no JSON object" in capfd.readouterr().err


@pytest.mark.parametrize("obj, why", [
    ({"what": "layer", "index": [1]}, "the field 'index' is a list, not an integer"),
    ({"what": "costs", "index": -3}, "the field 'index' is -3, outside 0.."),
    ({"what": "best_scheme"}, "the field 'index' is missing"),
    ({"what": "pairs", "param": "0"}, "the field 'param' is a string, not an integer"),
    ({"what": "request_action", "action": "explode"}, "is 'explode', not one of"),
    ({"index": 1}, "QUERY lacks the field 'what'"),
])
def test_a_query_with_a_field_of_the_wrong_type_is_dropped_and_the_job_goes_on(job, capfd, obj,
                                                                             why):
    coord, clients = job
    before = dropped(coord)
    clients[2].transport.send(COORDINATOR, Msg.QUERY, iteration=1000, key=_key("query"), obj=obj)
    still_serves(coord, clients)
    assert dropped(coord) == before + 1
    assert why in capfd.readouterr().err


def test_a_query_for_a_layer_the_book_lacks_is_answered_with_an_error(job):
    coord, clients = job
    with pytest.raises(Exception, match="query 'layer': 99 is not in the book"):
        clients[0].query("layer", index=99)
    still_serves(coord, clients)


def test_bogus_collectives_are_bounded_and_given_up(job):
    """A member sends allreduces, gathers and barriers that never complete (keys no other worker
    uses): the coordinator keeps at most MOST_OPEN of them, gives up the rest with a log line,
    and after the job's timeout gives up every one; real collectives go on meanwhile."""
    coord, clients = job
    lines = []
    coord.collectives.log = lines.append
    t = clients[1].transport
    vector = numpy.zeros(64)
    n = MOST_OPEN * 3
    for i in range(n):
        kind = i % 3
        if kind == 0:
            t.send(COORDINATOR, Msg.ALLREDUCE, iteration=i % 7, key=1_000_000 + i, arrays=[vector],
                   obj={"name": f"bogus-{i}"})
        elif kind == 1:
            t.send(COORDINATOR, Msg.GATHER, iteration=0, key=1_000_000 + i, aux=0,
                   obj={"name": f"bogus-{i}", "item": "x" * 100})
        else:
            t.send(COORDINATOR, Msg.BARRIER, iteration=0, key=1_000_000 + i,
                   obj={"name": f"bogus-{i}", "group": "all"})
    still_serves(coord, clients)          # arrives after every bogus message: they are all in
    assert len(coord.collectives.open) <= MOST_OPEN
    assert coord.collectives.given_up >= n - MOST_OPEN
    assert lines[0].startswith(f"the coordinator: gave up 1 unfinished collective(s) (more than "
                               f"{MOST_OPEN} unfinished at once): allreduce 'bogus-0' (call 0)")
    assert len(lines) < 30                       # not one a message: 20, then at 100, 1000, ...
    coord.collectives.expire(time.monotonic() + coord.collectives.expire_after + 1)
    assert len(coord.collectives.open) == 0
    still_serves(coord, clients)


def test_calls_already_completed_far_ahead_or_repeated_are_dropped(job, capfd):
    coord, clients = job
    still_serves(coord, clients)                     # 'after' call 0 completed
    t = clients[1].transport
    before = dropped(coord)
    key = _key("after")
    for it in (0, 1 + 10 ** 6):                      # already completed; far ahead
        t.send(COORDINATOR, Msg.ALLREDUCE, iteration=it, key=key, arrays=[numpy.zeros(1)],
               obj={"name": "after"})
    t.send(COORDINATOR, Msg.BARRIER, iteration=0, key=_key("b"),          # twice the same call
           obj={"name": "b", "group": "workers"})
    t.send(COORDINATOR, Msg.BARRIER, iteration=0, key=_key("b"),
           obj={"name": "b", "group": "workers"})
    clients[3].transport.send(COORDINATOR, Msg.BARRIER, iteration=0, key=_key("c"),  # a server
                              obj={"name": "c", "group": "workers"})
    t.send(COORDINATOR, Msg.REGISTER, obj={"rank": 1, "address": "tcp://127.0.0.1:1",
                                           "host": "h", "role": "worker", "options": {},
                                           "description": {}, "solver": ""})
    still_serves(coord, clients)
    assert dropped(coord) == before + 5
    err = capfd.readouterr().err
    for why in ("allreduce 'after' call 0, already completed",
                "more than 1000 ahead of the last completed",
                "barrier 'c' from a rank that is not one of its members",
                "REGISTER is not taken once every rank has registered"):
        assert why in err, (why, err)
    # the second BARRIER 'b' is dropped by whichever sees it first: the transport's mailbox (a
    # copy of a message still waiting) or the coordinator (the same call again from one sender)
    assert ("barrier 'b' call 0 again from the same sender" in err
            or "a copy of a message that is still waiting" in err), err


def test_the_schema_refuses_each_field_type_and_range(job):
    """The wire rules of the coordinator, message by message (no socket)."""
    coord, _ = job
    rules = coord.transport.rules

    def why(mtype, sender, obj, aux=0, arrays=()):
        return rules.check(Message(mtype, sender, 0, 5, aux, list(arrays), obj, 30, 0))

    def register(sender, **fields):
        return why(Msg.REGISTER, sender, dict({"rank": sender, "address": "a", "host": "h",
                                               "role": "server", "options": {}}, **fields))
    vec = [numpy.zeros(3)]
    assert why(Msg.ALLREDUCE, 0, {"name": "loss"}, arrays=vec) is None
    assert "operation 7" in why(Msg.ALLREDUCE, 0, {"name": "loss"}, aux=7, arrays=vec)
    assert "'name' is an integer, not a string" in why(Msg.ALLREDUCE, 0, {"name": 3}, arrays=vec)
    assert "'name' is 300 characters long" in why(Msg.ALLREDUCE, 0, {"name": "n" * 300},
                                                  arrays=vec)
    assert "GATHER to rank 3, which is not a worker" in why(Msg.GATHER, 1, {"name": "g",
                                                                            "item": 1}, aux=3)
    assert "lacks the field 'item'" in why(Msg.GATHER, 1, {"name": "g"})
    assert "'group' is 'everyone', not one of" in why(Msg.BARRIER, 3, {"name": "b",
                                                                       "group": "everyone"})
    assert "'reason' is an object, not a string" in why(Msg.FAILED, 2, {"reason": {}})
    assert "carries a JSON object, which it never has" in why(Msg.DONE, 2, {"x": 1})
    assert register(3) is None
    assert "'pid' is a boolean, not an integer" in register(3, pid=True)
    assert "'rank' is 40000, outside 0..32767" in register(3, rank=40000)
    assert "REGISTER for rank 2 sent by server 0" in register(3, rank=2)
    assert "says it is a worker" in register(3, role="worker")
    assert "'description' is missing" in why(Msg.REGISTER, 1, {
        "rank": 1, "address": "a", "host": "h", "role": "worker", "options": {}, "solver": ""})
