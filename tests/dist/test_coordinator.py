"""The coordinator service on its own (registration, book, Query, barrier, allreduce in rank order,
gather, missing ranks), the KV server's handlers, and the Python API (dist.init) in processes.

Run: python -m pytest tests/dist/test_coordinator.py -q
"""
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy
import pytest

from poseidon.dist.coord.coordinator import Coordinator, CoordinatorClient
from poseidon.dist.coord.records import description_to_wire
from poseidon.dist.errors import AbortError, DistError
from poseidon.dist.kv.store import KVServer
from poseidon.dist.schemes import choose_scheme
from poseidon.dist.job.roles import COORDINATOR, Roles
from poseidon.dist.transport import Msg, ZmqTransport, free_port

from .helpers import fc_net, make_lmdb, run_threads, solver_param
from .test_cost_book import _description

ROOT = Path(__file__).resolve().parents[2]


def start_job(workers, servers, start_timeout=10.0, local0=False):
    """The coordinator and a client per rank; `local0`: worker 0's transport and the
    coordinator's hand their messages over in the process, as dist/job/session.py attaches them."""
    roles = Roles(workers, servers)
    port = free_port()
    coord = Coordinator(roles, "127.0.0.1", port, timeout=5, start_timeout=start_timeout).start()
    clients = []
    for rank in range(roles.size):
        t = ZmqTransport(rank, namer=roles.name, timeout=5)
        t.bind("127.0.0.1")
        if local0 and rank == 0:
            t.attach_local(COORDINATOR, coord.transport)
            coord.transport.attach_local(0, t)
        t.start()
        clients.append(CoordinatorClient(t, roles, f"tcp://127.0.0.1:{port}", start_timeout))
    return roles, coord, clients


class _NoSocket:
    """Stands for a ZeroMQ socket that must not be used."""

    def send(self, *args, **kwargs):
        raise AssertionError("a message between worker 0 and its coordinator took a socket")


def close(coord, clients):
    for c in clients:
        c.done()
    coord.join(10)
    for c in clients:
        c.transport.close(0)


def register_all(roles, clients, desc, options):
    books = {}

    def reg(rank):
        info = {"role": roles.role(rank), "options": options, "pid": rank}
        if roles.is_worker(rank):
            info.update(description=description_to_wire(desc), solver="base_lr: 0.1\n")
        books[rank] = clients[rank].register(info)
    threads = [threading.Thread(target=reg, args=(r,)) for r in range(roles.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return books


OPTIONS = {"workers": 3, "servers": 1, "sync": "hybrid", "kv_pair_bytes": 1024,
           "sum_gradients": False, "dtype": "float32"}


@pytest.mark.parametrize("local0", [False, True])
def test_services(local0):
    roles, coord, clients = start_job(3, 1, local0=local0)
    swapped = []                         # (table, rank, its socket): put back before closing
    try:
        desc = _description([("InnerProduct", 64, 32, 4, True), ("Convolution", 8, 27, 4, False)])

        def no_socket(transport, rank):  # every message between the two must be handed over
            swapped.append((transport._out, rank, transport._out[rank]))
            transport._out[rank] = (_NoSocket(), threading.Lock())
        if local0:
            no_socket(clients[0].transport, COORDINATOR)
        books = register_all(roles, clients, desc, OPTIONS)
        if local0:
            no_socket(coord.transport, 0)
        assert {b.digest() for b in books.values()} == {coord.book.digest()}
        book = books[0]
        assert book.data["addresses"]["2"] == clients[2].transport.address
        # the 8x27 convolution, 3 workers, 1 server: the ring's 2·2·(2/3)·224 floats against
        # PS's 2·216·(3 + 1 − 2)/1 (BestScheme over the three registered schemes)
        assert book.best_scheme(1) == "allreduce"
        assert choose_scheme(book.layer(1), 3, 1, sync="ps+sfb") == "ps"
        # Query over the socket
        assert clients[1].query("best_scheme", index=0) == book.best_scheme(0)
        assert clients[1].query("layer", index=1) == book.layer(1).to_wire()
        assert clients[2].query("pairs", server=0) == [p.to_wire() for p in book.pairs]
        assert clients[3].query("cluster")["workers"] == 3
        with pytest.raises(DistError, match="unknown query"):
            clients[0].query("nonsense")
        # allreduce: mean over the workers in rank order; gather to worker 0; barrier
        results = {}

        def work(rank):
            c = clients[rank]
            results[rank] = c.allreduce("v", numpy.array([rank, 10.0 * rank]))
            results[("sum", rank)] = c.allreduce("v", [1.0], op="sum")
            results[("g", rank)] = c.gather("g", {"rank": rank})
            c.barrier("b")
        threads = [threading.Thread(target=work, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        for r in range(3):
            numpy.testing.assert_array_equal(results[r], [1.0, 10.0])
            assert results[("sum", r)][0] == 3.0
        assert results[("g", 0)] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert results[("g", 1)] is None
        sent, got = clients[0].transport.counters(), coord.transport.counters()
        assert got["received_by_type"]["ALLREDUCE"] == 6 and sent["sent_messages"] >= 6
    finally:
        for table, rank, socket_and_lock in swapped:
            table[rank] = socket_and_lock
        close(coord, clients)


def register_all_but(roles, clients, absent):
    """Every rank of a 2-worker job but `absent` registers, each on a thread of its own; the
    DistError each got, by rank."""
    desc = _description([("InnerProduct", 8, 8, 2, True)])
    errors = {}

    def reg(rank):
        try:
            clients[rank].register({"role": roles.role(rank), "options": dict(OPTIONS, workers=2),
                                    "description": description_to_wire(desc), "solver": ""})
        except DistError as e:
            errors[rank] = e
    threads = [threading.Thread(target=reg, args=(r,)) for r in range(roles.size) if r != absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return errors


def test_missing_rank_is_named():
    roles, coord, clients = start_job(2, 1, start_timeout=1.0)
    try:
        clients[0].start_timeout = clients[2].start_timeout = 5
        errors = register_all_but(roles, clients, absent=1)
        assert isinstance(errors[0], AbortError)
        assert "only 2 of 3 processes registered" in str(errors[0])
        assert "missing: worker 1" in str(errors[0])
    finally:
        for c in clients:
            c.transport.close(0)
        coord.join(5)


@pytest.mark.slow
def test_a_bad_cost_report_from_worker_1_ends_a_job_at_once_naming_it(tmp_path, monkeypatch):
    """Two workers and a server train under the measured model; worker 1's probe reports a link
    of bandwidth 0. The job ends within seconds (not the 10 x --timeout the workers would wait
    for schemes that never come) with an error naming worker 1 and the field."""
    import time
    from poseidon.dist.cost import probe
    real = probe.Prober.report

    def report(self, dtype, xp=numpy):
        out = real(self, dtype, xp)
        if self.transport.rank == 1:
            out["links"]["2"]["beta"] = 0
        return out
    monkeypatch.setattr(probe.Prober, "report", report)
    data = make_lmdb(tmp_path / "db")
    timeout = 8
    t0 = time.monotonic()
    with pytest.raises(AbortError) as e:
        run_threads(solver_param(fc_net(data, 4), max_iter=4), 2, 1, timeout=timeout,
                    cost_model="measured")
    assert time.monotonic() - t0 < 3 * timeout          # the workers' wait is 10 x timeout
    assert "worker 1 sent a cost report the coordinator cannot use" in str(e.value)
    assert "the field 'report.links.2.beta' is 0, not a positive number" in str(e.value)


# ----- KV server handlers -----------------------------------------------------------------------
class FakeTransport:
    def __init__(self, rank):
        self.rank = rank
        self.sent = []
        self.dropped = []

    def drop(self, msg, reason):
        self.dropped.append(reason)

    def set_fifo(self, types):
        pass

    def send(self, dest, mtype, iteration=0, key=0, aux=0, arrays=(), obj=None):
        from poseidon.dist.transport import Receipt
        self.sent.append((dest, mtype, iteration, key, [numpy.array(a) for a in arrays]))
        return Receipt(sum(numpy.asarray(a).nbytes for a in arrays), 24)


class Msg_:
    def __init__(self, mtype, sender, iteration, key, arrays):
        self.type, self.sender, self.iteration, self.key = mtype, sender, iteration, key
        self.arrays, self.payload_bytes, self.header_bytes = arrays, 8, 24
        self.shared = False


@pytest.mark.parametrize("handler", ["update", "average"])
def test_server_sums_in_rank_order_then_handles(handler):
    from poseidon.engine.solvers.rules import make_rule
    from poseidon.dist.coord.book import InformationBook
    desc = _description([("InnerProduct", 2, 3, 1, False)])
    book = InformationBook.build(desc, 3, 1, dict(OPTIONS, dtype="float64", sync="ps"))
    book.data["dtype"] = "float64"
    param = solver_param(fc_net("x", 1), base_lr=0.5, momentum=0.0, weight_decay=0.0)
    t = FakeTransport(3)
    server = KVServer(t, book, Roles(3, 1), make_rule(param), handler=handler)
    bundle = book.bundles[0]                 # the layer's weight and bias: one message each way
    pairs = [book.pairs[k] for k in bundle.pairs]
    assert [p.param for p in pairs] == [0, 1]
    for pair in pairs:
        server.on_init(Msg_(Msg.KV_INIT, 0, 0, pair.id, [numpy.ones(pair.length)]))
    grads = [[numpy.full(pair.length, g * (k + 1)) for k, pair in enumerate(pairs)]
             for g in (1.0, 2.0, 6.0)]
    for r in (2, 0, 1):                                      # arrival order does not matter
        server.on_push(Msg_(Msg.KV_PUSH, r, 0, bundle.id, grads[r]))
        if r != 1:
            assert not [s for s in t.sent if s[1] == Msg.KV_VALUE]
    replies = [s for s in t.sent if s[1] == Msg.KV_VALUE]
    assert [s[0] for s in replies] == [0, 1, 2]
    mean = (1.0 + 2.0 + 6.0) / 3
    for s in replies:
        assert s[3] == bundle.id and len(s[4]) == 2
        for k, values in enumerate(s[4]):
            expected = 1.0 - 0.5 * mean * (k + 1) if handler == "update" else mean * (k + 1)
            numpy.testing.assert_allclose(values, expected)
    server.on_push(Msg_(Msg.KV_PUSH, 0, 5, bundle.id, grads[0]))   # dropped, not fatal
    assert len(t.dropped) == 1 and "the pair is at iteration 1" in t.dropped[0]
    server.on_push(Msg_(Msg.KV_PUSH, 0, 1, bundle.id, grads[0][:1]))   # half a message
    assert len(t.dropped) == 2 and "carries 1 arrays, its message holds 2 pairs" in t.dropped[1]
    server.on_push(Msg_(Msg.KV_PUSH, 0, 1, pairs[1].id, grads[0][1:]))   # not a message key
    assert len(t.dropped) == 3 and "is not the first pair of a message" in t.dropped[2]
    assert len(t.sent) == len(replies)


# ----- refusals -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_clip_gradients_refused_clearly(tmp_path):
    data = make_lmdb(tmp_path / "db")
    p = solver_param(fc_net(data, 4), max_iter=2)
    p.clip_gradients = 10
    with pytest.raises(Exception, match="clip_gradients is not supported in distributed"):
        run_threads(p, 2, 1, timeout=20)


# ----- the Python API -----------------------------------------------------------------------------
SCRIPT = """
import sys
from poseidon import dist
from poseidon.engine.solvers import get_solver
session = dist.init()                       # a server rank serves here and exits
solver = dist.DistributedSolver(get_solver(sys.argv[1], **session.solver_kwargs()))
solver.solve()
print("done", session.rank, solver.iter, flush=True)
"""


def test_python_api_under_an_mpirun_like_environment(tmp_path):
    data = make_lmdb(tmp_path / "db")
    (tmp_path / "net.prototxt").write_text(fc_net(data, 4))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 5\n'
        f'snapshot_after_train: false\n')
    (tmp_path / "train.py").write_text(SCRIPT)
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for rank in range(3):
        env = dict(os.environ, PYTHONPATH=str(ROOT), POSEIDON_WORKERS="2", POSEIDON_SERVERS="1",
                   POSEIDON_COORDINATOR=address, PMI_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "train.py", "solver.prototxt"], cwd=tmp_path,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert "done 0 5" in outs[0] and "done 1 5" in outs[1]
    assert "done" not in outs[2]                             # the server exited inside init()


def test_an_abort_spares_the_rank_that_failed_and_closes_without_lingering(monkeypatch):
    """The rank whose FAILED stopped the job has said why and is exiting: no ABORT is queued for
    it (one that cannot be delivered held the coordinator's close, and worker 0's process with
    it, for the whole 2 s linger, and the launcher then blamed the wrong process), and after an
    abort the coordinator's sockets linger 0.5 s, not 2."""
    from poseidon.dist.coord.coordinator import Coordinator
    from poseidon.dist.transport import Message

    coord = Coordinator(Roles(2, 1), "127.0.0.1", 0)
    sent, closed = [], []
    monkeypatch.setattr(coord.transport, "connect", lambda rank, address: None)
    monkeypatch.setattr(coord.transport, "send",
                        lambda rank, mtype, **kw: sent.append((rank, mtype)))
    real_close = coord.transport.close
    monkeypatch.setattr(coord.transport, "close",
                        lambda linger=1.0: (closed.append(linger), real_close(0)))
    coord.registered = {r: {"address": "tcp://127.0.0.1:1"} for r in range(3)}
    failed = Message(Msg.FAILED, 1, 0, 0, 0, [], {"reason": "NaN"}, 0, 0)
    monkeypatch.setattr(coord, "_register_all", lambda: None)
    monkeypatch.setattr(coord, "_serve", lambda: coord._on_failed(failed))
    coord._run()
    assert coord.aborted_reason == "worker 1 failed: NaN"
    assert sent == [(0, Msg.ABORT), (2, Msg.ABORT)]
    assert closed == [0.5]
