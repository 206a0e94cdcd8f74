"""The ring all-reduce's neighbours on rings of three and four workers, where a worker's left and
right neighbours are different workers (on two they are the same one, so a mix-up shows nowhere).

- each worker's scheme sends to the worker whose left neighbour it is, receives from the worker
  whose right neighbour it is, and both agree with the plan (ring.py) and the receiving side's
  door check (checks.py);
- the scheme's own send and receive, run for every worker at once over a stand-in transport that
  refuses a piece from any worker but the one awaited, sum the gradients exactly;
- a job of three workers whose worker 2 skips a layer's ring stops within --timeout, naming
  worker 2 as the left neighbour worker 0 waits for.

Run: python -m pytest tests/dist/test_ring_neighbours.py -q
"""
import threading
import time
from types import SimpleNamespace

import numpy
import pytest

from poseidon.dist.coord.book import InformationBook
from poseidon.dist.coord.checks import WireRules
from poseidon.dist.coord.records import LayerRecord, description_from_wire
from poseidon.dist.errors import DistError
from poseidon.dist.job.roles import Roles
from poseidon.dist.schemes import allreduce
from poseidon.dist.schemes.ring import ALL_GATHER, REDUCE_SCATTER, ring_address, ring_key
from poseidon.dist.transport import Message, Msg

from .helpers import fc_net, make_lmdb, run_threads, solver_param, skip_ring_part

LAYER = 3                            # the layer index the stand-in syncs
SHAPES = [(7, 9), (7,)]              # weight and bias: 70 floats, chunks of 23 or 17 floats
PIECE = 5                            # floats a piece, where a test wants several pieces a chunk


class Stage:
    """The CPU side of a syncer's stage: reused buffers by name."""
    on_gpu = False

    def __init__(self):
        self.buffers = {}

    def buffer(self, name, shape, dtype):
        if name not in self.buffers:
            self.buffers[name] = numpy.zeros(shape, dtype)
        return self.buffers[name]

    def synchronize(self):
        pass


class Rule:
    """Notes the summed gradient each parameter is updated with."""

    def __init__(self):
        self.grads = {}

    def update(self, data, grad, history, it, lr_mult, decay_mult, grad_scale):
        self.grads[id(data)] = numpy.array(grad)


def scheme_at(rank, workers, transport=None, seed=0, piece_floats=None):
    """An AllReduceScheme for worker `rank` of `workers`, on a stand-in syncer of one layer
    (`piece_floats`: the layer's piece size, None for the scheme's default)."""
    rs = numpy.random.RandomState(seed + rank)
    blobs = []
    for shape in SHAPES:
        blobs.append(SimpleNamespace(shape=shape, count=int(numpy.prod(shape)),
                                     data=numpy.zeros(shape), diff=rs.standard_normal(shape)))
    ctx = SimpleNamespace(rank=rank, roles=Roles(workers, 1), transport=transport,
                          net=SimpleNamespace(learnable_params=blobs, xp=numpy),
                          book=SimpleNamespace(params=[SimpleNamespace(lr_mult=1.0, decay_mult=1.0)] * 2),
                          rule=Rule(), history={0: [], 1: []}, grad_scale=1.0)
    rec = LayerRecord(index=LAYER, name="fc", type="InnerProduct", M=7, N=9, K=4, sfb=True,
                      params=(0, 1), shapes=tuple(map(tuple, SHAPES)), piece_floats=piece_floats)
    syncer = SimpleNamespace(ctx=ctx, li=LAYER, name="fc", pids=[0, 1], stage=Stage(), rec=rec)
    return allreduce.AllReduceScheme(syncer)


# ----- the neighbours, position by position -----------------------------------------------------
def ring_book(workers):
    """A book that syncs one layer of SHAPES, index LAYER, by the ring."""
    params, pids = [], []
    for bi, shape in enumerate(SHAPES):
        pids.append(len(params))
        params.append({"id": len(params), "name": f"fc[{bi}]", "layer": LAYER,
                       "owner": [LAYER, bi], "shape": list(shape),
                       "count": int(numpy.prod(shape)), "lr_mult": 1.0, "decay_mult": 1.0,
                       "shared": False, "synced": True})
    rec = {"index": LAYER, "name": "fc", "type": "InnerProduct", "M": 7, "N": 9, "K": 4,
           "sfb": True, "params": pids, "shapes": [list(x) for x in SHAPES]}
    desc = description_from_wire({"net": "t", "dtype": "float64", "iter_size": 1,
                                  "layers": [rec], "params": params})
    return InformationBook.build(desc, workers, 1, {"sync": "allreduce",
                                                    "kv_pair_bytes": 1 << 20})


@pytest.mark.parametrize("workers", [3, 4, 5])
def test_every_worker_is_its_left_neighbours_right_neighbour(workers):
    schemes = [scheme_at(r, workers) for r in range(workers)]
    for r, s in enumerate(schemes):
        assert s.position == r
        assert s.left != r and s.right != r, (r, s.left, s.right)
        assert schemes[s.left].right == r, \
            f"worker {r}: its left neighbour {s.left} sends to {schemes[s.left].right}"
        assert schemes[s.right].left == r, \
            f"worker {r}: its right neighbour {s.right} takes from {schemes[s.right].left}"
        plan = s.plan
        for phase in (REDUCE_SCATTER, ALL_GATHER):
            for step in range(workers - 1):
                # what r is sent is what its left neighbour sends, and what r sends is what its
                # right neighbour is sent
                assert plan.received_chunk(phase, step, r) == \
                    plan.sent_chunk(phase, step, schemes[s.left].position), (r, phase, step)
                assert plan.sent_chunk(phase, step, r) == \
                    plan.received_chunk(phase, step, schemes[s.right].position), (r, phase, step)
    # the door of every worker takes a piece from its scheme's left neighbour and no other worker
    book, roles = ring_book(workers), Roles(workers, 1)
    assert book.best_scheme(LAYER) == "allreduce"
    for r, s in enumerate(schemes):
        rules = WireRules(r, roles, namer=roles.name)
        rules.set_book(book)
        length = s.plan.expected_length(0, r)
        for sender in range(workers):
            piece = Message(Msg.RING, sender, 1, ring_key(LAYER, 0), 0,
                            [numpy.zeros(length)], None, 30, length * 8)
            reason = rules.check(piece)
            assert (reason is None) == (sender == s.left), (r, sender, s.left, reason)


# ----- the whole ring over a stand-in transport -------------------------------------------------
class Hub:
    """Every worker's inbox. A receive that finds its piece from any worker but the awaited one
    fails at once (as the door check would drop it); one that waits WAIT seconds fails too."""
    WAIT = 5.0

    def __init__(self):
        self.cond = threading.Condition()
        self.inbox = {}                # (dest, key, iteration) -> (sender, array)
        self.log = []                  # (sender, dest, layer, slot)

    def transport(self, rank):
        hub = self

        class Transport:
            def send(self, dest, mtype, iteration=0, key=0, arrays=(), **kw):
                assert mtype == Msg.RING
                with hub.cond:
                    slot = (dest, key, iteration)
                    assert slot not in hub.inbox, f"worker {rank} sent {slot} twice"
                    hub.inbox[slot] = (rank, numpy.array(arrays[0]))
                    hub.log.append((rank, dest) + ring_address(key))
                    hub.cond.notify_all()
                return SimpleNamespace(wait=lambda: None, nbytes=arrays[0].nbytes)

            def receive(self, mtype, key, iteration, count=1, timeout=None, what=None,
                        senders=None):
                deadline = time.monotonic() + hub.WAIT
                with hub.cond:
                    while (rank, key, iteration) not in hub.inbox:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise AssertionError(f"worker {rank} never got {what}")
                        hub.cond.wait(left)
                    sender, array = hub.inbox.pop((rank, key, iteration))
                assert senders is not None and sender in senders, \
                    f"worker {rank} awaits {what} from {senders} but worker {sender} sent it"
                return [SimpleNamespace(arrays=[array], sender=sender)]
        return Transport()


def run_ring(workers, iteration=2):
    hub = Hub()
    schemes = [scheme_at(r, workers, hub.transport(r), seed=11, piece_floats=PIECE)
               for r in range(workers)]
    want = [sum(s.params[b][1].diff for s in schemes) for b in range(len(SHAPES))]
    errors = {}

    def one(s):
        stats = SimpleNamespace(sent=lambda receipt: None, received=lambda msg: None)
        try:
            s.send(iteration, stats)
            s.receive(iteration, stats)
        except BaseException as e:       # re-raised by the test's thread
            errors[s.position] = e
    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in schemes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * Hub.WAIT)
    assert not any(t.is_alive() for t in threads), "a worker of the stand-in ring hangs"
    if errors:
        raise errors[min(errors)]
    return hub, schemes, want


@pytest.mark.parametrize("workers", [3, 4])
def test_every_piece_comes_from_the_left_and_the_sums_are_exact(monkeypatch, workers):
    monkeypatch.setattr(allreduce, "PIECE_FLOATS", PIECE)     # several pieces a chunk
    hub, schemes, want = run_ring(workers)
    assert schemes[0].plan.pieces > 1
    assert not hub.inbox, "pieces were sent that nobody took"
    assert len(hub.log) == workers * schemes[0].plan.slots
    for sender, dest, layer, slot in hub.log:
        assert layer == LAYER
        assert dest == (sender + 1) % workers, (sender, dest, slot)
    first = None
    for s in schemes:
        got = [s.ctx.rule.grads[id(blob.data)] for _, blob, _ in s.params]
        for g, w in zip(got, want):
            numpy.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
        if first is None:
            first = got
        for g, f in zip(got, first):
            assert numpy.array_equal(g, f), "replicas differ"


# ----- a job: a stalled worker is named as the awaited left neighbour ---------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


@pytest.mark.slow
def test_a_stalled_worker_is_named_by_its_right_neighbour(data, monkeypatch):
    """Three workers; worker 2 skips its part of ip2's ring at iteration 1. Worker 0, whose left
    neighbour is worker 2, waits for ip2's piece no longer than --timeout, and the job stops with
    one line naming the layer, the iteration and worker 2 (not worker 1, its right neighbour)."""
    skip_ring_part(monkeypatch, 2, "ip2", 1)
    timeout = 3.0
    start = time.monotonic()
    with pytest.raises(DistError) as err:
        run_threads(solver_param(fc_net(data, 4), max_iter=4), 3, 1, sync="allreduce",
                    timeout=timeout)
    took = time.monotonic() - start
    text = str(err.value)
    assert "\n" not in text
    assert "layer 'ip2'" in text and "iteration 1" in text, text
    assert "from worker 2" in text and "from worker 1" not in text, text
    assert f"timed out after {timeout:g} s" in text, text
    assert took < 4 * timeout
