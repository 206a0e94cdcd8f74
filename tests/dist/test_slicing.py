"""Bounded messages: every message larger than the slice size travels in slices, every socket refuses
a frame much larger than a slice, and large parameters still train.

- Two transports with a small slice: a message of JSON and arrays larger than a slice arrives whole
  and equal, counted once with its payload; a repeated slice, one that is not one of its message's,
  and a first slice of a whole the rules refuse are dropped and counted.
- The slices of a message of several arrays, each several slices long, given to the assembler
  reversed, shuffled or interleaved, are put back by their offsets: the arrays come out bitwise
  equal to the sent ones, and only the last slice completes the message.
- A stranger streams a frame claiming 512 MB into every TCP port of a live job (`--ipc off`, so
  every inbox is TCP, and the coordinator): libzmq drops each connection after the frame's header
  (ZMQ_MAXMSGSIZE), the process's peak resident size (VmHWM; every role is a thread of it) grows by
  less than 64 MB, and the job ends with the parameters of the undisturbed run, bitwise.
- A net whose parameters are larger than the slice (64 KB here) trains to the parameters of one
  process with PS, SFB and hybrid, and resumes from a snapshot bitwise.

Run: python -m pytest tests/dist/test_slicing.py -q -s
"""
import socket
import struct
import threading
import time

import numpy
import pytest

from poseidon.dist.job import security
from poseidon.dist.job.roles import Roles
from poseidon.dist.transport import FIXED_HEADER_BYTES, Msg, encode_header
from poseidon.dist.transport.slices import Assembler, cut
from poseidon.dist.transport.wire import decode_header, encode_slice, make_message

from .gated import run_gated
from .helpers import (assert_params_close, fc_net, make_lmdb, params_of, reference,
                      run_processes, run_threads, solver_param, transport_pair)

SLICE = 8192


@pytest.fixture
def pair():
    yield from transport_pair(Roles(2, 1), (0, 2), timeout=5.0, slice_bytes=SLICE)


def test_a_message_larger_than_a_slice_arrives_whole_and_is_counted_once(pair):
    a, b = pair
    big = numpy.arange(10_000, dtype=numpy.float64)          # 80000 bytes: 10 slices
    small = numpy.ones((3, 5), numpy.float32)
    obj = {"items": ["x" * 100] * 200}                       # about 21 KB of JSON: 3 slices
    receipt = a.send(2, Msg.GATHER, iteration=4, key=9, aux=3, arrays=[big, small], obj=obj)
    receipt.wait()
    got = b.receive(Msg.GATHER, key=9, iteration=4)[0]
    assert got.obj == obj and got.aux == 3 and got.sender == 0
    numpy.testing.assert_array_equal(got.arrays[0], big)
    numpy.testing.assert_array_equal(got.arrays[1], small)
    payload = big.nbytes + small.nbytes + len(__import__("json").dumps(obj))
    ca, cb = a.counters(), b.counters()
    assert receipt.payload_bytes == got.payload_bytes == payload
    assert ca["sent_payload"] == cb["recv_payload"] == payload
    assert ca["sent_messages"] == cb["recv_messages"] == 1
    assert ca["sent_header"] == cb["recv_header"] == got.header_bytes > 10 * 40
    assert cb["received_by_type"] == {"GATHER": 1} and cb["dropped_messages"] == 0


def test_repeated_foreign_and_refused_slices_are_dropped(pair):
    a, b = pair
    sock = a._out[2][0]
    big = numpy.arange(4096, dtype=numpy.float64)            # 32768 bytes: 4 slices
    header = encode_header(Msg.SF, 0, 1, 2, 0, [big])
    parts = cut(header, [big], SLICE)
    assert len(parts) == 4
    for head, part in parts[:2] + parts[1:2] + parts[2:]:   # slice 1 twice
        sock.send_multipart([head, part.tobytes()])
    got = b.receive(Msg.SF, key=2, iteration=1)[0]
    numpy.testing.assert_array_equal(got.arrays[0], big)
    head, part = parts[0]
    bad = bytearray(head)
    struct.pack_into("<Q", bad, FIXED_HEADER_BYTES + 6 + 4 + 2, 100)   # byte 100: not a slice
    sock.send_multipart([bytes(bad), part.tobytes()])
    huge = numpy.lib.stride_tricks.as_strided(numpy.zeros(1), (1 << 28,), (0,))   # 2 GB, claimed
    claim = encode_slice(encode_header(Msg.SF, 0, 1, 3, 0, [huge]), SLICE, 0, 0, SLICE)
    sock.send_multipart([claim, bytes(SLICE)])
    deadline = time.monotonic() + 5
    while b.counters()["dropped_messages"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.counters()["dropped_messages"] == 3
    assert b.counters()["recv_messages"] == 1
    assert "a message of 2147483648 bytes (at most" in b._last_drop[0]
    assert len(b._assembler) == 0


def _received_slices(header, arrays, slice_bytes):
    """The slices of a message as a receiver decodes them, each with its own copy of its bytes."""
    out = []
    for head, part in cut(header, arrays, slice_bytes):
        mtype, flags, sender, iteration, key, aux, _ = decode_header(head)
        out.append(make_message(head, mtype, flags, sender, iteration, key, aux, [part.copy()],
                                part.size))
    return out


@pytest.mark.parametrize("order", ["reversed", "shuffled", "interleaved"])
def test_slices_arriving_out_of_order_are_put_back_by_their_offsets(order):
    rs = numpy.random.RandomState(11)
    first = rs.standard_normal(5000)                          # 40000 bytes: 4 full slices + 1
    second = rs.randint(-2**31, 2**31 - 1, size=(3, 1700), dtype=numpy.int32)   # 20400: 2 + 1
    header = encode_header(Msg.GATHER, 1, 6, 4, 0, [first, second])
    slices = _received_slices(header, [first, second], SLICE)
    assert len(slices) == 8
    assert [m.slice[2:4] for m in slices][:2] == [(0, 0), (0, SLICE)]
    if order == "reversed":
        slices = slices[::-1]
    elif order == "shuffled":            # each array's short last slice still comes last
        slices = [slices[i] for i in (2, 6, 0, 3, 5, 1, 4, 7)]
    else:                                                     # the arrays' slices alternate
        slices = [slices[i] for i in (7, 2, 6, 4, 5, 1, 0, 3)]
    assembler = Assembler(lambda msg, flags, specs: None)
    for msg in slices[:-1]:
        assert assembler.add(msg) == (None, None)
    whole, reason = assembler.add(slices[-1])
    assert reason is None and whole is not None and len(assembler) == 0
    assert (whole.type, whole.sender, whole.iteration, whole.key) == (Msg.GATHER, 1, 6, 4)
    assert whole.payload_bytes == first.nbytes + second.nbytes
    got_first, got_second = whole.arrays
    assert got_first.dtype == first.dtype and got_first.shape == first.shape
    assert got_second.dtype == second.dtype and got_second.shape == second.shape
    assert got_first.tobytes() == first.tobytes(), f"{order}: array 0 is not the sent bytes"
    assert got_second.tobytes() == second.tobytes(), f"{order}: array 1 is not the sent bytes"


def _vm_hwm_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def _claim_512mb(address, limit_bytes=96 << 20, seconds=20.0):
    """A plain TCP client: a ZMTP 3.0 greeting (CURVE, as a client), then one frame header claiming
    512 MB, then zeros streamed until the job drops the connection (at most limit_bytes). Returns
    the bytes it managed to write after the header."""
    host, port = address[6:].rsplit(":", 1)
    greeting = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") +
                b"\x00" + b"\x00" * 31)
    frame = b"\x02" + struct.pack(">Q", 512 << 20)
    chunk = b"\x00" * (1 << 20)
    written = 0
    deadline = time.monotonic() + seconds
    with socket.create_connection((host, int(port)), timeout=5) as s:
        try:
            s.sendall(greeting + frame)
            while written < limit_bytes and time.monotonic() < deadline:
                s.sendall(chunk)
                written += len(chunk)
        except (ConnectionResetError, BrokenPipeError, socket.timeout):
            pass
    return written


def test_a_frame_claiming_512mb_is_refused_on_every_port_of_a_live_job(tmp_path):
    data = make_lmdb(tmp_path / "train", n=64)
    param = solver_param(fc_net(data, 8), max_iter=8)
    from poseidon.engine.solvers import get_solver
    solver = get_solver(param, dtype=numpy.float64)
    weights = str(tmp_path / "init.caffemodel")
    solver.net.save(weights)
    solver.net.shutdown()
    keys = security.make_keys()
    want, _ = run_gated(param, 2, 1, 4, keys=keys, weights=weights, ipc="off")
    streamed = {}

    def gate(chunk, sessions):
        if chunk != 1 or threading.current_thread().name != "role-0":
            return
        ports = [sessions[0].options.coordinator] + [s.transport.address
                                                     for s in sessions.values()]
        streamed["before_kb"] = _vm_hwm_kb()
        for address in ports:
            streamed[address] = _claim_512mb(address)
        streamed["after_kb"] = _vm_hwm_kb()

    got, sessions = run_gated(param, 2, 1, 4, gate=gate, keys=keys, weights=weights, ipc="off")
    grown_mb = (_vm_hwm_kb() - streamed["before_kb"]) / 1024
    ports = {k: v for k, v in streamed.items() if k.startswith("tcp://")}
    assert len(ports) == 4, ports
    assert all(v < (64 << 20) for v in ports.values()), ports    # each connection was dropped
    assert grown_mb < 64, f"the peak resident size grew by {grown_mb:.0f} MB"
    for a, b in zip(got, want):
        numpy.testing.assert_array_equal(a, b)
    print(f"\n4 ports, each sent a frame header claiming 512 MB: dropped after "
          f"{max(ports.values()) >> 20} MB at most; VmHWM grew by {grown_mb:.1f} MB; parameters "
          f"bitwise equal to the undisturbed run")


# ----- large parameters still train -------------------------------------------------------------
TRAIN_SLICE = 8192                     # ip1's weight (768 x 48 float64) is 36 slices


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slices")
    return make_lmdb(folder / "train", n=64, shape=(3, 16, 16)), folder


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["ps", "sfb", "allreduce", "hybrid"])
def test_parameters_larger_than_a_slice_train_as_in_one_process(big, sync):
    data, folder = big
    weights = str(folder / f"init-{sync}.caffemodel")
    want = reference(solver_param(fc_net(data, 2 * 8), max_iter=6), weights_out=weights)
    solvers = run_threads(solver_param(fc_net(data, 8), max_iter=6), 2, 1, weights=weights,
                          sync=sync, slice_bytes=TRAIN_SLICE)
    for s in solvers:
        assert_params_close(params_of(s), want, rtol=1e-5, label=f"--sync {sync}")
    for a, b in zip(params_of(solvers[1]), params_of(solvers[0])):
        assert numpy.array_equal(a, b), "replicas differ"
    sliced = solvers[1].transport.counters()["slices"]
    assert sliced["received"] > 0, sliced            # worker 0's WEIGHTS at least came in slices


@pytest.mark.slow
def test_parameters_larger_than_a_slice_train_as_processes(big, tmp_path):
    """The hybrid case above as `poseidon train` processes (--slice-bytes 8192), over TCP alone
    (--ipc off: no shared memory or direct links, so every push, answer and factor goes in
    slices): one process on the combined batch within 1e-5, every replica bitwise worker 0's."""
    data, _ = big
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(fc_net(data, 2 * 8), max_iter=6), weights_out=weights)
    got = run_processes(solver_param(fc_net(data, 8), max_iter=6), 2, 1, tmp_path,
                        weights=weights, sync="hybrid", slice_bytes=TRAIN_SLICE, ipc="off")
    assert_params_close(got, want, rtol=1e-5, label="processes: --sync hybrid, 8 KB slices")


@pytest.mark.slow
def test_a_resume_with_slices_is_bitwise_equal_to_an_uninterrupted_run(big, tmp_path):
    data, _ = big

    def param(prefix):
        p = solver_param(fc_net(data, 8), max_iter=8)
        p.snapshot = 4
        p.snapshot_prefix = str(prefix)
        return p
    options = dict(dtype="float32", slice_bytes=TRAIN_SLICE)
    full = run_threads(param(tmp_path / "a" / "run"), 2, 1, **options)
    resumed = run_threads(param(tmp_path / "b" / "run"), 2, 1,
                          snapshot=str(tmp_path / "a" / "run_iter_4.solverstate"), **options)
    assert resumed[0].solver.iter == 8
    for got, exp in zip(resumed, full):
        for a, b in zip(params_of(got), params_of(exp)):
            assert numpy.array_equal(a, b), "resumed run differs from the uninterrupted one"
