"""A live coordinator given control messages a buggy member could send: each is dropped, logged and
counted, the job goes on, and the collectives that never complete are bounded. The exception is a
cost report (COSTS) for a call the workers wait on: one that cannot be used, or one that never
comes, stops the job at once with a line naming its sender, instead of leaving every worker to
wait out its timeout.

Run: python -m pytest tests/dist/test_control.py -q -s
"""
import json
import threading
import time

import numpy
import pytest

from poseidon.dist.coord import control
from poseidon.dist.coord.checks import WireRules
from poseidon.dist.coord.collectives import MOST_OPEN
from poseidon.dist.coord.coordinator import COSTS_KEY, _key
from poseidon.dist.errors import AbortError, DistError
from poseidon.dist.job.roles import COORDINATOR, Roles
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


# ----- the measured cost model's messages: COSTS (worker -> coordinator), SCHEMES (back) ---------
def probe_report(rank, size=4, **link):
    """A probe report as worker `rank` of a job of `size` ranks sends it (dist/cost/probe.py)."""
    return {"links": {str(r): dict({"alpha": 1e-4, "beta": 1e9, "encrypted": False}, **link)
                      for r in range(size) if r != rank},
            "flops": 1e10, "encrypt_cost": 0.0}


def with_field(report, path, value):
    """A copy of report with the field at `path` (a tuple of keys) set to value (removed when
    value is DELETE)."""
    report = json.loads(json.dumps(report))
    *parents, last = path
    at = report
    for k in parents:
        at = at[k]
    if value is DELETE:
        del at[last]
    else:
        at[last] = value
    return report


DELETE = object()
NAN, INF = float("nan"), float("inf")
GOOD = probe_report(1)
OBSERVED = {"observed": {"0": 0.004, "1": 0.0}}


def costs_message(sender, obj):
    return Message(Msg.COSTS, sender, 0, COSTS_KEY, 0, [], obj, 30, 0)


@pytest.mark.parametrize("obj, why", [
    ({"report": with_field(GOOD, ("links", "2", "beta"), 0), "from": 0},
     "the field 'report.links.2.beta' is 0, not a positive number"),
    ({"report": with_field(GOOD, ("links", "2", "beta"), NAN), "from": 0},
     "the field 'report.links.2.beta' is nan, not a finite number"),
    ({"report": with_field(GOOD, ("links", "0", "beta"), INF), "from": 0},
     "the field 'report.links.0.beta' is inf, not a finite number"),
    ({"report": with_field(GOOD, ("links", "3", "beta"), "fast"), "from": 0},
     "the field 'report.links.3.beta' is a string, not a number"),
    ({"report": with_field(GOOD, ("links", "3", "beta"), True), "from": 0},
     "the field 'report.links.3.beta' is a boolean, not a number"),
    ({"report": with_field(GOOD, ("links", "2", "alpha"), -1e-3), "from": 0},
     "the field 'report.links.2.alpha' is -0.001, below 0"),
    ({"report": with_field(GOOD, ("links", "2", "alpha"), DELETE), "from": 0},
     "the field 'report.links.2.alpha' is missing"),
    ({"report": with_field(GOOD, ("links", "2", "encrypted"), "yes"), "from": 0},
     "the field 'report.links.2.encrypted' is a string, not a boolean"),
    ({"report": with_field(GOOD, ("links", "2"), "fast"), "from": 0},
     "the field 'report.links.2' is a string, not an object"),
    ({"report": with_field(GOOD, ("links",), [1, 2]), "from": 0},
     "the field 'report.links' is a list, not an object"),
    ({"report": with_field(GOOD, ("links", "x"), GOOD["links"]["2"]), "from": 0},
     "the field 'report.links' has the key 'x', not a whole number"),
    ({"report": with_field(GOOD, ("links", "02"), GOOD["links"]["2"]), "from": 0},
     "the field 'report.links' has the key '02', not a whole number"),
    ({"report": with_field(GOOD, ("links", "9"), GOOD["links"]["2"]), "from": 0},
     "the field 'report.links' has the key '9', not a rank of this job (0..3)"),
    ({"report": with_field(GOOD, ("links", "1"), GOOD["links"]["2"]), "from": 0},
     "the field 'report.links' has the key '1', the reporting worker itself"),
    ({"report": with_field(GOOD, ("links", "3"), DELETE), "from": 0},
     "the field 'report.links' lacks server 0 (rank 3)"),
    ({"report": with_field(GOOD, ("flops",), 0), "from": 0},
     "the field 'report.flops' is 0, not a positive number"),
    ({"report": with_field(GOOD, ("flops",), DELETE), "from": 0},
     "the field 'report.flops' is missing"),
    ({"report": with_field(GOOD, ("encrypt_cost",), -1), "from": 0},
     "the field 'report.encrypt_cost' is -1, below 0"),
    ({"report": {"flops": 1e10}, "from": 0},
     "the field 'report' has neither 'links' (a probe) nor 'observed' (sync times)"),
    ({"report": dict(GOOD, observed={}), "from": 0},
     "the field 'report' has both 'links' and 'observed'"),
    ({"report": with_field(OBSERVED, ("observed", "0"), "slow"), "from": 12},
     "the field 'report.observed.0' is a string, not a number"),
    ({"report": with_field(OBSERVED, ("observed", "1"), NAN), "from": 12},
     "the field 'report.observed.1' is nan, not a finite number"),
    ({"report": with_field(OBSERVED, ("observed", "1"), -0.5), "from": 12},
     "the field 'report.observed.1' is -0.5, below 0"),
    ({"report": with_field(OBSERVED, ("observed", "ip1"), 0.1), "from": 12},
     "the field 'report.observed' has the key 'ip1', not a whole number"),
    ({"report": with_field(OBSERVED, ("observed",), [0.1]), "from": 12},
     "the field 'report.observed' is a list, not an object"),
    ({"report": GOOD, "from": "0"}, "the field 'from' is a string, not an integer"),
    ({"report": GOOD, "from": -4}, "the field 'from' is -4, outside 0.."),
    ({"report": GOOD}, "COSTS lacks the field 'from'"),
    ({"report": [GOOD], "from": 0}, "the field 'report' is a list, not an object"),
    ({"from": 0}, "COSTS lacks the field 'report'"),
    (None, "COSTS carries no JSON object"),
])
def test_a_cost_report_is_checked_field_by_field(obj, why):
    roles = Roles(3, 1)
    assert control.costs_reason(costs_message(1, {"report": GOOD, "from": 0}), roles) is None
    observed = costs_message(2, {"report": OBSERVED, "from": 12})
    assert control.costs_reason(observed, roles) is None
    assert control.costs_reason(observed, roles, layers={0, 1}) is None
    got = control.costs_reason(costs_message(1, obj), roles)
    assert got is not None and why in got, got


def test_sync_times_of_a_layer_the_book_lacks_are_refused():
    roles = Roles(3, 1)
    report = with_field(OBSERVED, ("observed", "7"), 0.1)
    assert "the field 'report.observed' has the key '7', not a layer of the book" in \
        control.costs_reason(costs_message(1, {"report": report, "from": 12}), roles,
                             layers={0, 1})


def test_the_schemes_the_coordinator_publishes_are_checked_by_type():
    """SCHEMES, as a worker's wire rules see it: choices are required, each a scheme's name for a
    layer index; the predictions are numbers (or null) by scheme by layer."""
    roles = Roles(3, 1)
    rules = WireRules(0, roles)

    def why(obj):
        return rules.check(Message(Msg.SCHEMES, COORDINATOR, 0, COSTS_KEY, 0, [], obj, 30, 0))
    good = {"from": 4, "choices": {"0": "ps", "1": "sfb"},
            "predicted": {"0": {"ps": 0.001, "sfb": None}, "1": {"sfb": 0.002}},
            "table": {"flops": 1e10}}
    assert why(good) is None
    assert why({"from": 0, "choices": {}}) is None
    for obj, says in [
            ({"from": 4}, "SCHEMES lacks the field 'choices'"),
            ({"choices": {"0": "ps"}}, "SCHEMES lacks the field 'from'"),
            (None, "SCHEMES lacks the field 'choices'"),
            (dict(good, choices=["ps"]), "the field 'choices' is a list, not an object"),
            (dict(good, choices={"0": 5}), "the field 'choices.0' is an integer, not a string"),
            (dict(good, choices={"0": None}), "the field 'choices.0' is null, not a string"),
            (dict(good, choices={"x": "ps"}), "the field 'choices' has the key 'x', not a whole "
                                              "number"),
            (dict(good, choices={"-1": "ps"}), "the field 'choices' has the key '-1', not a "
                                               "whole number"),
            (dict(good, choices={"0": "p" * 100}), "the field 'choices.0' is 100 characters long"),
            (dict(good, **{"from": "4"}), "the field 'from' is a string, not an integer"),
            (dict(good, **{"from": -1}), "the field 'from' is -1, outside 0.."),
            (dict(good, predicted=[1]), "the field 'predicted' is a list, not an object"),
            (dict(good, predicted={"0": "fast"}), "the field 'predicted.0' is a string, not an "
                                                  "object"),
            (dict(good, predicted={"0": {"ps": "slow"}}), "the field 'predicted.0.ps' is a "
                                                          "string, not a number"),
            (dict(good, predicted={"0": {"ps": NAN}}), "the field 'predicted.0.ps' is nan, not a "
                                                       "finite number"),
            (dict(good, predicted={"0": {"ps": -2}}), "the field 'predicted.0.ps' is -2, below 0"),
            (dict(good, table="a table"), "the field 'table' is a string, not an object")]:
        got = why(obj)
        assert got is not None and says in got, (obj, says, got)


# ----- a bad cost report stops the job at once, naming its sender -------------------------------
@pytest.fixture
def measured_job():
    """As `job`, with the measured cost model (the coordinator plans from COSTS reports)."""
    roles, coord, clients = start_job(3, 1)
    try:
        desc = _description([("InnerProduct", 64, 32, 4, True), ("Convolution", 8, 27, 4, False)])
        register_all(roles, clients, desc, dict(OPTIONS, cost_model="measured"))
        assert coord.book is not None and coord.book.measured
        yield coord, clients
    finally:
        close(coord, clients)


def report_round(clients, reports, wait=20.0):
    """Each worker in `reports` ({rank: (report, from)}, sent in that order, a moment apart so
    that they arrive in it) reports; every worker that reported waits for the published schemes.
    {rank: the SCHEMES object or the error}, and the seconds the slowest wait took."""
    calls = {}
    for rank, (report, start) in reports.items():
        calls[rank] = clients[rank].report_costs(report, start)
        time.sleep(0.2)
    got = {}

    def wait_for(rank):
        try:
            got[rank] = clients[rank].published(calls[rank], timeout=wait)
        except DistError as e:
            got[rank] = e
    t0 = time.monotonic()
    threads = [threading.Thread(target=wait_for, args=(r,)) for r in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait + 10)
    return got, time.monotonic() - t0


def test_good_reports_are_published_to_every_worker(measured_job):
    coord, clients = measured_job
    got, _ = report_round(clients, {r: (probe_report(r), 0) for r in range(3)})
    assert all(isinstance(got[r], dict) for r in range(3)), got
    assert got[0] == got[1] == got[2] and got[0]["from"] == 0 and got[0]["choices"]
    got, _ = report_round(clients, {r: ({"observed": {"0": 0.01, "1": 0.02}}, 9)
                                    for r in range(3)})
    assert got[0] == got[1] == got[2] and got[0]["from"] == 9
    assert coord.aborted_reason is None


@pytest.mark.parametrize("field, value, says", [
    ("beta", 0, "the field 'report.links.3.beta' is 0, not a positive number"),
    ("beta", NAN, "the field 'report.links.3.beta' is nan, not a finite number"),
    ("alpha", -1.0, "the field 'report.links.3.alpha' is -1, below 0"),
    ("alpha", "slow", "the field 'report.links.3.alpha' is a string, not a number"),
])
def test_a_bad_report_from_worker_1_stops_the_job_at_once_naming_it(measured_job, capfd, field,
                                                                     value, says):
    coord, clients = measured_job
    bad = with_field(probe_report(1), ("links", "3", field), value)
    got, seconds = report_round(clients, {0: (probe_report(0), 0), 2: (probe_report(2), 0),
                                          1: (bad, 0)})
    assert seconds < 5, seconds                         # not the 20 s the workers would wait
    for rank in range(3):
        assert isinstance(got[rank], AbortError), got[rank]
        assert "worker 1 sent a cost report the coordinator cannot use" in str(got[rank])
        assert says in str(got[rank])
    assert coord.aborted_reason.startswith("worker 1 sent a cost report")
    err = capfd.readouterr().err
    assert f"the coordinator: dropped a message from worker 1: COSTS: {says}" in err, err


def test_reports_of_one_round_that_disagree_on_from_stop_the_job(measured_job):
    """Worker 1 says its choices start at 4, the others at 0: published under either, a switch
    would land on some worker at the wrong iteration (without its history move)."""
    coord, clients = measured_job
    got, seconds = report_round(clients, {0: (probe_report(0), 0), 2: (probe_report(2), 0),
                                          1: (probe_report(1), 4)})
    assert seconds < 5, seconds
    for rank in range(3):
        assert isinstance(got[rank], AbortError), got[rank]
    assert ("worker 1 reports link costs for choices from iteration 4, but worker 0 from "
            "iteration 0") in coord.aborted_reason


def test_a_probe_and_sync_times_in_one_round_stop_the_job(measured_job):
    coord, clients = measured_job
    got, seconds = report_round(clients, {0: (probe_report(0), 0), 2: (probe_report(2), 0),
                                          1: ({"observed": {"0": 0.1}}, 0)})
    assert seconds < 5, seconds
    assert isinstance(got[0], AbortError), got[0]
    assert "worker 1 reports sync times where worker 0 reports link costs" in \
        coord.aborted_reason


def test_a_planner_that_fails_stops_the_job_rather_than_leaving_the_workers_waiting(
        measured_job, monkeypatch):
    coord, clients = measured_job

    def broken(book, reports, start):
        raise ZeroDivisionError("float division by zero")
    monkeypatch.setattr(coord.planner, "decide", broken)
    got, seconds = report_round(clients, {r: (probe_report(r), 0) for r in range(3)})
    assert seconds < 5, seconds
    assert isinstance(got[1], AbortError), got[1]
    assert ("the coordinator cannot choose schemes from the cost reports of call 0 (choices from "
            "iteration 0): ZeroDivisionError: float division by zero") in coord.aborted_reason


def test_a_report_that_never_comes_stops_the_job_naming_the_rank_before_the_workers_give_up(
        measured_job):
    """Workers 0 and 2 report, worker 1 never does: the coordinator stops the job naming worker 1
    a little before the workers' own wait would end (here shortened to 2 s)."""
    coord, clients = measured_job
    coord.collectives.expire_after = 2.0
    got, seconds = report_round(clients, {0: (probe_report(0), 0), 2: (probe_report(2), 0)})
    assert seconds < 6, seconds
    assert isinstance(got[0], AbortError), got[0]
    assert "worker 1 sent no cost report for call 0" in coord.aborted_reason
    assert "worker 0" not in coord.aborted_reason.split("(")[0]


def test_a_bad_report_for_no_current_call_is_only_dropped(measured_job, capfd):
    """A report far ahead of any call the workers wait on (a replay, a confused member) cannot
    hold up the job: it is dropped with its field named, and the job goes on."""
    coord, clients = measured_job
    before = dropped(coord)
    bad = with_field(probe_report(1), ("links", "3", "beta"), 0)
    clients[1].transport.send(COORDINATOR, Msg.COSTS, iteration=10 ** 6, key=COSTS_KEY,
                              obj={"report": bad, "from": 0})
    clients[1].transport.send(COORDINATOR, Msg.COSTS, iteration=10 ** 6 + 1, key=COSTS_KEY,
                              obj={"report": probe_report(1), "from": 0})
    still_serves(coord, clients)
    assert dropped(coord) == before + 2
    err = capfd.readouterr().err
    assert "COSTS: the field 'report.links.3.beta' is 0, not a positive number" in err, err
    assert "more than 1000 ahead of the last completed" in err, err
    got, _ = report_round(clients, {r: (probe_report(r), 0) for r in range(3)})
    assert all(isinstance(got[r], dict) for r in range(3)), got


def test_a_cost_report_in_a_job_of_the_static_model_is_dropped(job, capfd):
    coord, clients = job
    before = dropped(coord)
    clients[1].transport.send(COORDINATOR, Msg.COSTS, iteration=0, key=COSTS_KEY,
                              obj={"report": with_field(probe_report(1), ("flops",), 0),
                                   "from": 0})
    still_serves(coord, clients)
    assert dropped(coord) == before + 1
    assert "COSTS: the field 'report.flops' is 0" in capfd.readouterr().err
