"""The ring all-reduce's pieces go zero-copy: the receiver reads the sender's buffer whenever the
transport gets to it, up to the moment the sender's receipt says it is done. Meanwhile the solver's
rule takes the summed gradient as scratch (engine/solvers/rules.py), so the scheme must wait for
its sends before it applies the rule, or a slow neighbour is sent a half-updated sum.

Here a stand-in transport hands pieces over by reference and one worker reads late; the rule
stand-in scribbles over the gradient it is given, as the real one may. Every worker must still
apply exactly the sum of the workers' gradients, bit for bit the same on each.

Run: python -m pytest tests/dist/test_ring_zero_copy.py -q
"""
import threading
import time
from types import SimpleNamespace

import numpy
import pytest

from poseidon.dist.transport import Msg

from .test_ring_neighbours import SHAPES, scheme_at

WAIT = 5.0          # seconds any stand-in wait lasts at most
LATE = 0.05         # seconds the slow worker takes before it reads a piece


class ScribblingRule:
    """Notes the gradient each parameter is updated with, then overwrites it (scratch)."""

    def __init__(self):
        self.grads = {}

    def update(self, data, grad, history, it, lr_mult, decay_mult, grad_scale):
        self.grads[id(data)] = numpy.array(grad)
        grad[...] = numpy.nan


class ZeroCopyHub:
    """Pieces pass by reference; a send's receipt is done once its receiver has read it."""

    def __init__(self, slow):
        self.slow = slow
        self.cond = threading.Condition()
        self.inbox = {}                 # (dest, key, iteration) -> (sender, array, read event)

    def transport(self, rank):
        hub = self

        class Transport:
            def send(self, dest, mtype, iteration=0, key=0, arrays=(), **kw):
                assert mtype == Msg.RING
                read = threading.Event()
                with hub.cond:
                    hub.inbox[(dest, key, iteration)] = (rank, arrays[0], read)
                    hub.cond.notify_all()

                def wait(timeout=None):
                    assert read.wait(WAIT), f"worker {dest} never read worker {rank}'s piece"
                return SimpleNamespace(wait=wait, payload_bytes=arrays[0].nbytes,
                                       header_bytes=0)

            def receive(self, mtype, key, iteration, count=1, timeout=None, what=None,
                        senders=None):
                deadline = time.monotonic() + WAIT
                with hub.cond:
                    while (rank, key, iteration) not in hub.inbox:
                        left = deadline - time.monotonic()
                        assert left > 0, f"worker {rank} never got {what}"
                        hub.cond.wait(left)
                    sender, array, read = hub.inbox.pop((rank, key, iteration))
                if rank == hub.slow:
                    time.sleep(LATE)
                piece = numpy.array(array)          # the moment the bytes leave the sender
                read.set()
                return [SimpleNamespace(arrays=[piece], sender=sender)]
        return Transport()


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_a_late_reader_gets_the_sum_not_the_rules_scratch(workers):
    hub = ZeroCopyHub(slow=workers - 1)
    schemes = [scheme_at(r, workers, hub.transport(r), seed=5) for r in range(workers)]
    for s in schemes:
        s.ctx.rule = ScribblingRule()
    want = [sum(s.params[b][1].diff for s in schemes) for b in range(len(SHAPES))]
    errors = {}

    def one(s):
        stats = SimpleNamespace(sent=lambda receipt: None, received=lambda msg: None)
        try:
            for it in (1, 2):
                s.send(it, stats)
                s.receive(it, stats)
        except BaseException as e:        # re-raised below, on the test's thread
            errors[s.position] = e
    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in schemes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * WAIT)
    assert not any(t.is_alive() for t in threads), "a worker of the stand-in ring hangs"
    if errors:
        raise errors[min(errors)]
    first = None
    for s in schemes:
        got = [s.ctx.rule.grads[id(blob.data)] for _, blob, _ in s.params]
        for b, (g, w) in enumerate(zip(got, want)):
            assert numpy.isfinite(g).all(), \
                f"worker {s.position} was sent the rule's scratch for parameter {b}"
            numpy.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
        first = first or got
        for g, f in zip(got, first):
            assert numpy.array_equal(g, f), "replicas differ"
