"""--priority: each peer's slices go out lower layer first, with a window of bytes in flight.

The scheduler alone (a fake socket whose frames stay "in flight" a few milliseconds): a small
bottom-layer message queued after a big top-layer one overtakes the big one's remaining slices, the
window is never exceeded, arrival order with --priority off, and an abort or a peer that takes
nothing reaches the sender thread. Then a whole job with the bandwidth cap, whose timeline shows
the bottom layer's sync done before the top layer's last slice left (and, with --priority off, the
other way round), and the equivalence with one process with priority on.

Run: python -m pytest tests/dist/test_wire_priority.py -x -q
"""
import json
import threading
import time

import numpy
import pytest
import zmq

from poseidon.dist.errors import AbortError, DeadlineError
from poseidon.dist.transport import URGENT, PeerScheduler, at_priority
from poseidon.dist.transport.scheduler import current_priority

from .helpers import assert_params_close, fc_net, make_lmdb, params_of, reference, run_threads
from .helpers import run_processes, solver_param

SLICE = 1000


class FakeTracker:
    """A frame ZeroMQ holds for `hold` seconds after the send (or for ever: hold None)."""

    def __init__(self, hold):
        self.until = None if hold is None else time.monotonic() + hold

    @property
    def done(self):
        return self.until is not None and time.monotonic() >= self.until

    def wait(self, timeout=-1):
        if self.until is None:
            time.sleep(max(timeout, 0))
            raise zmq.NotDone
        left = self.until - time.monotonic()
        if 0 <= timeout < left:
            time.sleep(timeout)
            raise zmq.NotDone
        time.sleep(max(left, 0))


class FakeSocket:
    """Records the slices sent, in order, and checks the window itself: at each send, the bytes
    of frames not yet released plus this slice's stay within it (or nothing else is held)."""

    def __init__(self, window, hold=0.003, gate=None):
        self.window, self.hold, self.gate = window, hold, gate
        self.sent, self.held, self.over = [], [], []
        self.entered = threading.Event()

    def put(self, item):
        self.entered.set()
        if self.gate is not None and not self.sent:
            self.gate.wait(5)            # the first slice waits until the test has queued more
        self.held = [(n, t) for n, t in self.held if not t.done]
        holding = sum(n for n, _ in self.held)
        if self.held and holding + item.nbytes > self.window:
            self.over.append(holding + item.nbytes)
        tracker = FakeTracker(self.hold)
        self.held.append((item.nbytes, tracker))
        self.sent.append((item.key, item.index))
        return [tracker]


def parts(count):
    return [(b"h", [], SLICE) for _ in range(count)]


def run(ordered, window=3 * SLICE):
    """A big top-layer message (key 9, layer 9) queued first, a small bottom-layer one (key 0)
    queued while the big one's first slice is being sent; the order the slices left in."""
    gate = threading.Event()
    sock = FakeSocket(window, gate=gate)
    sched = PeerScheduler(sock.put, window, ordered=ordered, timeout=5.0)
    big = sched.submit(9, parts(20), (31, 9, 0))
    assert sock.entered.wait(5)                      # the sender has taken slice 0 (at the gate)
    small = sched.submit(0, parts(2), (31, 0, 0))
    gate.set()
    big.wait(5)
    small.wait(5)
    sched.close(1)
    assert not sock.over, f"the window of {window} bytes was exceeded: {sock.over}"
    assert sched.peak_inflight <= window
    return sock.sent


def test_a_bottom_layer_overtakes_the_rest_of_a_top_layer_message():
    sent = run(ordered=True)
    assert sent[0] == (9, 0)                                   # already on its way
    assert sent[1:3] == [(0, 0), (0, 1)], sent[:6]             # then the bottom layer, whole
    assert sent[3:] == [(9, i) for i in range(1, 20)]          # then the rest, in order


def test_priority_off_keeps_arrival_order():
    sent = run(ordered=False)
    assert sent == [(9, i) for i in range(20)] + [(0, 0), (0, 1)]


def test_the_window_holds_slices_back_until_the_peer_takes_them():
    sock = FakeSocket(2 * SLICE, hold=0.02)
    sched = PeerScheduler(sock.put, 2 * SLICE, timeout=5.0)
    t0 = time.monotonic()
    sched.submit(1, parts(10)).wait(5)
    took = time.monotonic() - t0
    sched.close(1)
    assert not sock.over and sched.peak_inflight == 2 * SLICE
    assert took >= 4 * 0.02, f"10 slices, 2 at a time, each held 20 ms, went in {took:.3f} s"


def test_an_abort_reaches_the_sender_thread_and_every_queued_message():
    sock = FakeSocket(SLICE, hold=None)                        # the peer never takes anything
    sched = PeerScheduler(sock.put, SLICE, timeout=30.0, name="rank 0", peer="rank 2")
    first = sched.submit(1, parts(5))
    assert sock.entered.wait(5)                      # its first slice is out, and never taken
    later = sched.submit(0, parts(1))
    time.sleep(0.05)
    t0 = time.monotonic()
    sched.fail(AbortError("the job was aborted"))
    for handover in (first, later):
        with pytest.raises(AbortError):
            handover.wait(5)
    sched._thread.join(2)
    assert not sched._thread.is_alive() and time.monotonic() - t0 < 1.0
    with pytest.raises(AbortError):
        sched.submit(0, parts(1))


def test_a_peer_that_takes_nothing_fails_the_queue_naming_it():
    sock = FakeSocket(SLICE, hold=None)
    sched = PeerScheduler(sock.put, SLICE, timeout=0.3, name="rank 0", peer="rank 2")
    handover = sched.submit(1, parts(3))
    with pytest.raises(DeadlineError, match="rank 0 could not send to rank 2 within 0.3 s"):
        handover.wait(5)
    sched.close(0)


def test_the_priority_is_the_threads_own_and_nested_blocks_restore_it():
    assert current_priority() == URGENT
    with at_priority(3):
        seen = []
        t = threading.Thread(target=lambda: seen.append(current_priority()))
        t.start()
        t.join()
        with at_priority(1):
            assert current_priority() == 1
        assert current_priority() == 3
    assert seen == [URGENT] and current_priority() == URGENT


def test_a_transports_abort_fails_what_its_sender_threads_still_hold():
    from poseidon.dist.job.roles import Roles
    from poseidon.dist.transport import Msg

    from .helpers import transport_pair
    pair = transport_pair(Roles(2, 1), (0, 2), timeout=10.0, slice_bytes=8192, priority="on",
                          bandwidth=1e6)             # 1 MB/s: 800 kB would take 0.8 s
    a, b = next(pair)
    try:
        receipt = a.send(2, Msg.KV_PUSH, iteration=0, key=1, arrays=[numpy.ones(100_000)])
        time.sleep(0.05)
        t0 = time.monotonic()
        a.fail(AbortError("the job was aborted"))
        with pytest.raises(AbortError):
            receipt.wait()
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(AbortError):
            a.send(2, Msg.KV_PUSH, iteration=1, key=1, arrays=[numpy.ones(10)])
    finally:
        next(pair, None)


# ----- a whole job ----------------------------------------------------------------------------
def top_heavy_net(source, batch):
    """A small bottom layer (ip1: 192 x 2) under two big ones (ip2: 2 x 4096, ip3: 4096 x 5),
    with a pause in the backward under ip3, so that ip3's sync is queued first for sure (else
    the thread pool may start the lower layers' syncs first and the order would prove nothing)."""
    return f"""
name: "top_heavy"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param {{ num_output: 2 weight_filler {{ type: "gaussian" std: 0.05 }} }} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 4096 weight_filler {{ type: "gaussian" std: 0.05 }} }} }}
layer {{ name: "pause" type: "Python" bottom: "ip2" top: "paused"
  python_param {{ module: "tests.dist.fault_layers" layer: "SlowBackward"
    param_str: '{{"seconds": 0.03}}' }} }}
layer {{ name: "ip3" type: "InnerProduct" bottom: "paused" top: "ip3"
  inner_product_param {{ num_output: 5 weight_filler {{ type: "gaussian" std: 0.05 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss" }}
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train", n=32)


def capped_timeline(data, path, priority):
    """Worker 0's syncs and slices, per iteration, of a 3-iteration job under a 2 MB/s cap."""
    run_threads(solver_param(top_heavy_net(data, 4), max_iter=3), 2, 1, sync="ps",
                bucket_bytes=0, slice_bytes=8192, bandwidth="2MB", priority=priority,
                timeline=str(path))
    events = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    return events


@pytest.mark.slow
@pytest.mark.parametrize("priority", ["on", "off"])
def test_under_a_cap_the_bottom_layer_syncs_before_the_top_layers_last_slice(data, tmp_path,
                                                                            priority):
    events = capped_timeline(data, tmp_path / "trace.json", priority)
    for it in range(3):
        sync = {e["name"]: e for e in events if e["cat"].startswith("sync")
                and e["args"]["iter"] == it}
        top = [e for e in events if e["name"] == "send ip3" and e["args"]["iter"] == it]
        assert top and all(e["args"]["type"] == "KV_PUSH" for e in top)
        bottom_done = sync["sync ip1"]["ts"] + sync["sync ip1"]["dur"]
        top_last = max(e["ts"] + e["dur"] for e in top)
        if priority == "on":
            assert bottom_done < top_last, (f"iteration {it}: ip1's sync ended "
                                             f"{(bottom_done - top_last) / 1e3:.1f} ms after "
                                             f"ip3's last slice")
        else:                                 # arrival order: ip1's push waits for all of ip3's
            assert bottom_done > top_last


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["ps", "sfb"])
def test_with_priority_on_the_job_still_equals_one_process(data, tmp_path, sync):
    """Pushes and answers through the scheduler (ps), factors between the workers (sfb)."""
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(fc_net(data, 2 * 4), max_iter=6), weights_out=weights)
    solvers = run_threads(solver_param(fc_net(data, 4), max_iter=6), 2, 1, weights=weights,
                          sync=sync, bucket_bytes=0, slice_bytes=8192, priority="on",
                          credit_bytes=16384)
    assert {rec.scheme for rec in solvers[0].book.layers} == {sync}
    for s in solvers:
        assert_params_close(params_of(s), want, rtol=1e-5, label="--priority on")
    for a, b in zip(params_of(solvers[1]), params_of(solvers[0])):
        assert numpy.array_equal(a, b), "replicas differ"
    order = solvers[0].transport.counters()["send_order"]
    assert order["order"] == "lower layers first"
    assert 0 < order["peak_in_flight_bytes"] <= 16384


@pytest.mark.slow
def test_with_priority_on_processes_still_equal_one_process(data, tmp_path):
    """The --sync ps case above as `poseidon train` processes (pushes and answers through each
    process's sender threads): one process within 1e-5, every replica bitwise worker 0's."""
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(fc_net(data, 2 * 4), max_iter=6), weights_out=weights)
    got = run_processes(solver_param(fc_net(data, 4), max_iter=6), 2, 1, tmp_path,
                        weights=weights, sync="ps", bucket_bytes=0, slice_bytes=8192,
                        priority="on", credit_bytes=16384)
    assert_params_close(got, want, rtol=1e-5, label="processes: --priority on")
