"""KV values and gradients in the server's shared memory (`--ipc auto`,
dist/transport/onehost/kvshm.py).

What must hold: the parameters a job ends with do not depend on whether the arrays went through
the shared memory, were placed there (a worker's parameters living in it), or went on the links
(`--ipc links`), bit for bit; one worker of a job may map it while another does not; a worker that
cannot map it falls back to arrays; a server that offers none refuses a push that says its
gradient is there, naming why; and the mapping is refused when it is not what was advertised.

Run: python -m pytest tests/dist/test_kvshm.py -q
"""
import os

import numpy
import pytest

from poseidon.dist.coord.records import Pair
from poseidon.dist.transport import ZmqTransport
from poseidon.dist.transport.onehost import kvshm

from .helpers import (conv_net, fc_net, make_lmdb, params_of, reference, run_processes,
                      run_threads, solver_param)

ITERS = 6

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"),
                                reason="shared KV memory needs Linux (memfd, /proc)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


def shared_weights_net(source, batch):
    """Two InnerProducts sharing one weight (param name; PERMISSIVE makes the second layer's
    blob a view of its own over the owner's storage): placing the parameter must carry every
    blob that shared its storage along."""
    return f"""
name: "shared_small"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}
layer {{ name: "ip0" type: "InnerProduct" bottom: "data" top: "ip0"
  inner_product_param {{ num_output: 12 weight_filler {{ type: "gaussian" std: 0.05 }} }} }}
layer {{ name: "ipa" type: "InnerProduct" bottom: "ip0" top: "ipa"
  param {{ name: "shared_w" }} param {{ name: "shared_b" }}
  inner_product_param {{ num_output: 12 weight_filler {{ type: "gaussian" std: 0.2 }}
    bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relua" type: "ReLU" bottom: "ipa" top: "ipa" }}
layer {{ name: "ipb" type: "InnerProduct" bottom: "ipa" top: "ipb"
  param {{ name: "shared_w" share_mode: PERMISSIVE }} param {{ name: "shared_b" }}
  inner_product_param {{ num_output: 12 weight_filler {{ type: "gaussian" std: 0.2 }}
    bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "out" type: "InnerProduct" bottom: "ipb" top: "out"
  inner_product_param {{ num_output: 5 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "out" bottom: "label" top: "loss" }}
"""


def _run(param, P1, P2, weights, ipc, **extra):
    return run_threads(param, P1, P2, weights=weights, sync="ps", ipc=ipc, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("P1,P2", [(1, 1), (2, 1), (3, 2)])
def test_shared_memory_changes_nothing_but_the_copies(data, tmp_path, P1, P2):
    """One worker: the server updates from the worker's diff without writing it (keep_grad);
    several: the sum goes into the server's scratch; two servers: the pairs of a parameter may
    span both, which is then not placed but copied. All bitwise equal to --ipc links."""
    K = 2
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(conv_net(data, P1 * K), max_iter=ITERS), weights_out=weights)
    param = solver_param(conv_net(data, K), max_iter=ITERS)
    shared = _run(param, P1, P2, weights, "auto")
    links = _run(param, P1, P2, weights, "links")
    for a, b in zip(params_of(shared[0]), params_of(links[0])):
        assert numpy.array_equal(a, b)
    for x, y in zip(shared, links):               # the diffs still hold each worker's last
        for a, b in zip(x.net.learnable_params, y.net.learnable_params):   # gradient: the
            assert numpy.array_equal(a.diff, b.diff)     # server never writes them
    for a, b in zip(params_of(shared[0]), want):
        numpy.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)
    for s in shared[1:]:                          # the replicas read one memory: equal
        for a, b in zip(params_of(s), params_of(shared[0])):
            assert numpy.array_equal(a, b)
    n = len(shared[0].net.learnable_params)
    if P2 == 1:
        assert all(s.placed == set(range(n)) for s in shared)
    assert all(s.placed for s in shared)          # small layers sit on one server either way
    assert all(not s.placed for s in links)


@pytest.mark.slow
def test_a_worker_without_the_memory_sends_arrays_beside_one_with_it(data, tmp_path,
                                                                     monkeypatch):
    """Worker 1 cannot map the server's memory (as in another container): it pushes arrays and
    is answered with arrays, worker 0 in shared memory, in the same pairs."""
    K, P1 = 2, 2
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(conv_net(data, P1 * K), max_iter=ITERS), weights_out=weights)
    original = ZmqTransport.kv_segment

    def only_worker_0(self, server):
        return original(self, server) if self.rank == 0 else None
    monkeypatch.setattr(ZmqTransport, "kv_segment", only_worker_0)
    solvers = _run(solver_param(conv_net(data, K), max_iter=ITERS), P1, 1, weights, "auto")
    assert solvers[0].placed and not solvers[1].placed
    for s in solvers:
        for a, b in zip(params_of(s), want):
            numpy.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_placed_parameters_carry_their_sharers_along(data, tmp_path):
    """Weight sharing (param name): every blob that shared a placed parameter's storage reads
    the server's values afterwards, so the job still equals one process on the combined
    batch."""
    K, P1 = 2, 2
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(shared_weights_net(data, P1 * K), max_iter=ITERS),
                     weights_out=weights)
    solvers = _run(solver_param(shared_weights_net(data, K), max_iter=ITERS), P1, 1, weights,
                   "auto")
    net = solvers[0].net
    assert solvers[0].placed == set(range(len(net.learnable_params)))
    ipa, ipb = net.layer_dict["ipa"], net.layer_dict["ipb"]
    assert ipa.blobs[0].shares_storage_with(ipb.blobs[0])
    for s in solvers:
        for a, b in zip(params_of(s), want):
            numpy.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_placed_parameters_carry_their_sharers_along_in_processes(data, tmp_path):
    """The case above as `poseidon train` processes (--ipc auto, --sync ps): the server's memory
    is mapped across processes, and the job still equals one process on the combined batch to
    the same tolerance, every replica bitwise worker 0's."""
    K, P1 = 2, 2
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(shared_weights_net(data, P1 * K), max_iter=ITERS),
                     weights_out=weights)
    got = run_processes(solver_param(shared_weights_net(data, K), max_iter=ITERS), P1, 1,
                        tmp_path, weights=weights, sync="ps", ipc="auto")
    assert len(got) == len(want)
    for a, b in zip(got, want):
        numpy.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_a_python_layers_parameter_is_not_placed(data, tmp_path):
    """A Python layer may keep its blobs' arrays from setup on (tests/dist/fault_layers.py
    CachedScale): its parameter stays where it is (copied through the shared memory), the
    engine's layers' parameters are placed, and the job still equals one process."""
    K, P1 = 8, 2

    def with_python_scale(text):
        layer = ('layer { name: "scale" type: "Python" bottom: "ip1" top: "ip1" python_param { '
                 'module: "tests.dist.fault_layers" layer: "CachedScale" } }\n')
        return text.replace('layer { name: "relu1"', layer + 'layer { name: "relu1"', 1)
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(with_python_scale(fc_net(data, P1 * K)), max_iter=ITERS),
                     weights_out=weights)
    solvers = _run(solver_param(with_python_scale(fc_net(data, K)), max_iter=ITERS), P1, 1,
                   weights, "auto")
    net = solvers[0].net
    python = {pid for pid, b in enumerate(net.learnable_params)
              if b is net.layer_dict["scale"].blobs[0]}
    assert len(python) == 1
    assert solvers[0].placed == set(range(len(net.learnable_params))) - python
    for s in solvers:
        for a, b in zip(params_of(s), want):
            numpy.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_fc_net_with_sfb_layers_places_only_what_goes_by_ps(data, tmp_path):
    """Under hybrid an InnerProduct may go by SFB (each worker updates its own copy): such a
    parameter is never placed in the shared values. As many servers as workers, so that the
    classifier goes by PS (with one server the ring, which needs no server, would take it)."""
    K, P1 = 8, 3
    weights = str(tmp_path / "init.caffemodel")
    want = reference(solver_param(fc_net(data, P1 * K), max_iter=ITERS), weights_out=weights)
    solvers = run_threads(solver_param(fc_net(data, K), max_iter=ITERS), P1, P1, weights=weights,
                          sync="hybrid", ipc="auto")
    book = solvers[0].book
    ps = {p.id for p in book.params if p.scheme == "ps"}
    assert [rec.scheme for rec in book.layers] == ["sfb", "sfb", "ps"]
    assert solvers[0].placed == ps and len(ps) < len(book.params)
    for s in solvers:
        for a, b in zip(params_of(s), want):
            numpy.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


class _Book:
    """The book's pairs, given as [(server, length)] with ids in order."""

    def __init__(self, pairs, dtype="float32"):
        self.data = {"dtype": dtype}
        self._pairs = [Pair(id=i, param=i, offset=0, length=n, server=s)
                       for i, (s, n) in enumerate(pairs)]

    def pairs_on_server(self, index):
        return [p for p in self._pairs if p.server == index]


def test_layout_aligns_each_pair_and_gives_each_worker_a_region():
    book = _Book([(0, 5), (1, 7), (0, 32), (0, 1)])
    layout = kvshm.Layout(book, 0, workers=2)
    assert layout.slots == {0: (0, 5), 2: (16, 32), 3: (48, 1)}
    assert layout.region == 64 and layout.nbytes == 3 * 64 * 4
    memory = kvshm.ServerMemory.make()
    segment = memory.allocate(layout)
    segment.values(2)[...] = 1.5
    segment.grads(1, 2)[...] = 2.5
    other = kvshm.open_segment(memory.describe(), layout)      # what a worker maps
    assert other.values(2).tolist() == [1.5] * 32
    assert other.grads(1, 2).tolist() == [2.5] * 32 and other.grads(0, 2).sum() == 0
    other.values(0)[...] = 3.0                                  # one memory, both ways
    assert segment.values(0).tolist() == [3.0] * 5


def test_a_mapping_that_is_not_what_was_advertised_is_refused(tmp_path):
    book = _Book([(0, 100)])
    layout = kvshm.Layout(book, 0, workers=1)
    memory = kvshm.ServerMemory.make()
    info = memory.describe()
    assert kvshm.open_segment(info, layout) is None             # not sized yet: too small
    memory.allocate(layout)
    assert kvshm.open_segment(info, layout) is not None
    assert kvshm.open_segment(dict(info, ino=info["ino"] + 1), layout) is None
    assert kvshm.open_segment(dict(info, fd=10 ** 6), layout) is None
    assert kvshm.open_segment({"pid": "x"}, layout) is None
    bigger = kvshm.Layout(_Book([(0, 1000)]), 0, workers=1)
    assert kvshm.open_segment(info, bigger) is None


def test_a_server_without_shared_memory_refuses_a_shared_push():
    """A push that says its gradient is in shared memory, to a server that offers none (a
    member that disagrees about --ipc, or a forged message), is dropped naming why."""
    from poseidon.engine.solvers.rules import make_rule
    from poseidon.dist.coord.book import InformationBook
    from poseidon.dist.kv.store import KVServer
    from poseidon.dist.job.roles import Roles
    from poseidon.dist.transport import Msg
    from .test_coordinator import OPTIONS, Msg_, _description

    class Transport:
        rank, timeout = 2, 30.0

        def __init__(self):
            self.dropped = []

        def set_fifo(self, types):
            pass

        def drop(self, msg, reason):
            self.dropped.append(reason)

    desc = _description([("InnerProduct", 2, 3, 1, False)])
    book = InformationBook.build(desc, 2, 1, dict(OPTIONS, dtype="float32"))
    param = solver_param(fc_net("unused", 2))
    t = Transport()
    server = KVServer(t, book, Roles(2, 1), make_rule(param))
    key = book.bundles_on_server(0)[0].id
    for pair in server.pairs.values():
        pair.iteration = 0
    msg = Msg_(Msg.KV_PUSH, 0, 0, key, [])
    msg.shared = True
    server.on_push(msg)
    assert len(t.dropped) == 1 and "shared memory" in t.dropped[0] and "offers none" in t.dropped[0]


def test_the_sized_memory_is_sealed_so_no_process_of_this_user_can_shrink_it():
    """Another process of the same user opens the server's memfd through /proc and tries to
    shrink (or grow) it: the kernel refuses, and the server's mapping still reads to its end
    (unsealed, the shrink succeeded and the server's next access there was a SIGBUS)."""
    import subprocess
    import sys
    book = _Book([(0, 4096)])
    layout = kvshm.Layout(book, 0, workers=1)
    memory = kvshm.ServerMemory.make()
    segment = memory.allocate(layout)
    segment.values(0)[...] = 7
    info = memory.describe()
    attack = ("import os, sys\n"
              f"fd = os.open('/proc/{info['pid']}/fd/{info['fd']}', os.O_RDWR)\n"
              "for size in (0, 1 << 30):\n"
              "    try:\n"
              "        os.ftruncate(fd, size)\n"
              "        print('resized to', size)\n"
              "    except PermissionError:\n"
              "        print('refused')\n")
    out = subprocess.run([sys.executable, "-c", attack], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=60).stdout.decode()
    assert out.split() == ["refused", "refused"], out
    assert os.fstat(memory.fd).st_size >= layout.nbytes
    assert float(segment.values(0)[-1]) == 7.0            # the server reads its mapping's end
    assert kvshm.open_segment(info, layout) is not None   # a worker still maps it
