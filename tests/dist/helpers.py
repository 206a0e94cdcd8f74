"""Small nets, a small LMDB, and two ways to run a whole job (coordinator, servers, workers): as
threads of this process over real ZeroMQ sockets (run_threads), and as the `poseidon train`
processes a user starts (run_processes), for the distributed tests."""
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy
from google.protobuf import text_format

from poseidon.dist.worker.snapshots import params_digest
from poseidon.engine.io.datum import array_to_datum
from poseidon.engine.io.lmdb_store import write_lmdb
from poseidon.engine.proto import caffe_pb2
from poseidon.engine.solvers import get_solver

from .jobs import job_env


def make_lmdb(path, n=96, shape=(3, 8, 8), classes=5, seed=0):
    """n uint8 images whose label depends on their content (so training moves the weights)."""
    rs = numpy.random.RandomState(seed)
    images = rs.randint(0, 256, size=(n,) + tuple(shape)).astype(numpy.uint8)
    labels = (images.reshape(n, -1)[:, :classes].argmax(axis=1)).astype(int)
    write_lmdb(str(path), (array_to_datum(img, int(lab)).SerializeToString()
                           for img, lab in zip(images, labels)))
    return str(path)


def fc_net(source, batch, classes=5, test_source=None, test_batch=None):
    """FC-heavy: three InnerProduct layers (192 -> 48 -> 24 -> classes)."""
    test = ""
    if test_source:
        test = f"""
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{test_source}" batch_size: {test_batch or batch} backend: LMDB }} }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip3" bottom: "label" top: "accuracy"
  include {{ phase: TEST }} }}"""
    return f"""
name: "fc_small"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}{test}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  param {{ lr_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}
  inner_product_param {{ num_output: 48 weight_filler {{ type: "gaussian" std: 0.05 }}
    bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 24 weight_filler {{ type: "gaussian" std: 0.1 }}
    bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "ip2" top: "ip2" }}
layer {{ name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
  inner_product_param {{ num_output: {classes} weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss" }}
"""


def conv_net(source, batch, classes=5, test_source=None, test_batch=None):
    """cifar10_quick-style: conv, max pool, relu, conv, relu, ave pool, ip, ip."""
    test = ""
    if test_source:
        test = f"""
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{test_source}" batch_size: {test_batch or batch} backend: LMDB }} }}"""
    accuracy = ""
    if test_source:
        accuracy = f"""
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
  include {{ phase: TEST }} }}"""
    return f"""
name: "conv_small"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}{test}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param {{ lr_mult: 1 }} param {{ lr_mult: 2 }}
  convolution_param {{ num_output: 6 pad: 1 kernel_size: 3 weight_filler {{ type: "gaussian" std: 0.1 }}
    bias_filler {{ type: "constant" }} }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }}
layer {{ name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param {{ num_output: 8 pad: 1 kernel_size: 3 weight_filler {{ type: "gaussian" std: 0.1 }}
    bias_filler {{ type: "constant" }} }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }}
layer {{ name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param {{ pool: AVE kernel_size: 2 stride: 2 }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  param {{ lr_mult: 1 }} param {{ lr_mult: 2 }}
  inner_product_param {{ num_output: 16 weight_filler {{ type: "gaussian" std: 0.1 }}
    bias_filler {{ type: "constant" }} }} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: {classes} weight_filler {{ type: "gaussian" std: 0.1 }}
    bias_filler {{ type: "constant" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}{accuracy}
"""


def solver_param(net_text, max_iter=20, base_lr=0.05, momentum=0.9, weight_decay=0.001,
                 solver_type="SGD", **extra):
    p = caffe_pb2.SolverParameter()
    text_format.Parse(net_text, p.net_param)
    p.base_lr = base_lr
    p.momentum = momentum
    p.weight_decay = weight_decay
    p.lr_policy = "step"
    p.gamma = 0.5
    p.stepsize = 7
    p.max_iter = max_iter
    p.display = 0
    p.random_seed = 3
    p.type = solver_type
    for k, v in extra.items():
        setattr(p, k, v)
    return p


def reference(param, dtype=numpy.float64, weights_out=None):
    """(solver before training, trained params) of one process on the given (combined-batch) net;
    saves the initial weights to weights_out first when given."""
    solver = get_solver(param, dtype=dtype)
    if weights_out:
        solver.net.save(weights_out)
    solver.step(param.max_iter)
    params = [numpy.array(b.data) for b in solver.net.learnable_params]
    solver.net.shutdown()
    return params


def run_threads(param, workers, servers, weights=None, snapshot=None, timeout=60, **options):
    """Run every role of a job as threads of this process. Returns the workers' DistributedSolvers
    (rank order); raises the first error of any role."""
    from poseidon.dist.job.process import run_role
    from poseidon.dist.transport import free_port
    opts = dict(workers=workers, servers=servers,
                coordinator=f"tcp://127.0.0.1:{free_port()}", local=True, timeout=timeout,
                dtype="float64", start_timeout=timeout)
    opts.update(options)
    job = {"solver": param, "weights": weights, "snapshot": snapshot, "options": opts}
    results, errors = {}, {}

    def role(rank):
        try:
            results[rank] = run_role(job, rank, in_thread=True)
        except BaseException as e:   # collected and re-raised below
            errors[rank] = e

    threads = [threading.Thread(target=role, args=(r,), name=f"role-{r}", daemon=True)
               for r in range(workers + servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    alive = [t.name for t in threads if t.is_alive()]
    if errors:
        rank = min(errors)
        raise errors[rank]
    if alive:
        raise AssertionError(f"roles still running: {alive}")
    solvers = [results[r] for r in range(workers)]
    for ds in solvers:
        ds.solver.net.shutdown()
        for t in ds.solver.test_nets:
            t.shutdown()
    return solvers


# run_threads' keywords that run_processes does not pass on: the launcher sets them (coordinator,
# local, rank, keys: a local job makes its own), or they are arguments of their own
_THREAD_ONLY = ("coordinator", "local", "rank", "workers", "servers", "keys")


def run_processes(param, workers, servers, tmp_path, weights=None, snapshot=None, timeout=60,
                  env=None, **options):
    """The job run_threads runs, as `poseidon train` processes (the launcher, its workers and
    servers): the SolverParameter `param` (its net inline) goes to a solver file under tmp_path
    with a snapshot at max_iter; the keywords become the flags of the same name (sync="ps":
    --sync ps, no_overlap=True: --no-overlap, bucket_bytes=0: --bucket-bytes 0, ...). Asserts
    that the job exits 0 and (but under --staleness) that every worker's replica at the snapshot
    is worker 0's, bit for bit; returns the snapshot's parameters in learnable-parameter order
    (as params_of).

    The processes get tests/dist/jobs.py's environment (POSEIDON_CONV=im2col: pin the same route
    for an in-process reference), updated by `env` when given."""
    folder = Path(tmp_path) / "process-job"
    folder.mkdir(parents=True, exist_ok=True)
    p = caffe_pb2.SolverParameter()
    p.CopyFrom(param)
    p.snapshot_prefix = str(folder / "snap")
    if not p.snapshot:
        p.snapshot = p.max_iter
    p.snapshot_after_train = True               # the snapshot at max_iter, whatever the interval
    solver_file = folder / "solver.prototxt"
    solver_file.write_text(text_format.MessageToString(p))
    dtype = options.pop("dtype", "float64")
    flags = ["--workers", workers, "--servers", servers, "--dtype", dtype,
             "--timeout", timeout, "--start-timeout", timeout]
    if weights:
        flags += ["--weights", weights]
    if snapshot:
        flags += ["--snapshot", snapshot]
    flags += _train_flags(options)
    cmd = [sys.executable, "-m", "poseidon.tools.cli", "train", "--solver", str(solver_file),
           "--no-progress", *map(str, flags)]
    done = subprocess.run(cmd, cwd=folder, env=dict(job_env(), **(env or {})), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout * 4,
                          stdin=subprocess.DEVNULL)
    shown = " ".join(map(str, flags))
    assert done.returncode == 0, (f"poseidon train {shown}: exit {done.returncode}\n"
                                  f"{done.stdout[-4000:]}")
    base = folder / f"snap_iter_{p.max_iter}"
    params = _snapshot_params(p, f"{base}.caffemodel", dtype)
    want = params_digest(params)
    lagging = options.get("staleness")      # under SSP a replica may miss the last updates
    for rank in range(1, 1 if lagging else workers):
        cursor = json.loads(Path(f"{base}.cursors.worker-{rank}.json").read_text())
        assert cursor["params_sha256"] == want, (
            f"poseidon train {shown}: worker {rank}'s parameters at iteration {p.max_iter} differ "
            f"from worker 0's snapshot")
    return params


def _train_flags(options):
    """`poseidon train` flags for run_threads' keywords (DistOptions' fields); a keyword with no
    flag is refused naming it."""
    from poseidon.dist.job.options import DistOptions
    flags = []
    for name, value in options.items():
        if name not in DistOptions.FIELDS or name in _THREAD_ONLY:
            raise TypeError(f"run_processes cannot give `poseidon train` {name}={value!r}: "
                            f"no flag of that name, or one run_processes sets itself")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif DistOptions.FIELDS[name]:
                raise TypeError(f"run_processes: {flag} cannot be turned off")
        elif value is not None:
            flags += [flag, value]
    return flags


def _snapshot_params(param, path, dtype):
    """The learnable parameters of the solver's TRAIN net as a .caffemodel sets them."""
    from poseidon.engine.net import Net
    net = Net(param.net_param, dtype=numpy.dtype(dtype).type)
    try:
        net.copy_from(path)
        return [numpy.array(b.data) for b in net.learnable_params]
    finally:
        net.shutdown()


def params_of(solver):
    """The parameters of an engine Solver, or of a DistributedSolver's."""
    from poseidon.engine import backend
    solver = getattr(solver, "solver", solver)
    return [numpy.array(backend.to_numpy(b.data)) for b in solver.net.learnable_params]


def assert_params_close(got, want, rtol=1e-5, label=""):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = max(numpy.abs(w).max(), 1e-12)
        err = numpy.abs(g - w).max() / scale
        assert err <= rtol, f"{label} param {i}: max relative error {err:.3g} > {rtol}"


def transport_pair(roles, ranks, **options):
    """Two started ZmqTransports of `ranks` (two ranks of `roles`) on loopback, connected both ways;
    a generator for fixtures: yields them, then closes them."""
    from poseidon.dist.transport import ZmqTransport
    a, b = (ZmqTransport(rank, namer=roles.name, **options) for rank in ranks)
    for t in (a, b):
        t.bind("127.0.0.1")
        t.start()
    a.connect(ranks[1], b.address)
    b.connect(ranks[0], a.address)
    yield a, b
    a.close(0)
    b.close(0)


def skip_ring_part(monkeypatch, rank, layer, iteration):
    """Worker `rank` neither sends nor takes its part of layer `layer`'s ring at `iteration`: a
    peer that went missing, as its neighbours see it."""
    from poseidon.dist.schemes import allreduce
    scheme = allreduce.AllReduceScheme
    real_send, real_receive = scheme.send, scheme.receive

    def absent(self, it):
        return self.ctx.rank == rank and self.syncer.name == layer and it == iteration

    def send(self, it, stats):
        if not absent(self, it):
            real_send(self, it, stats)

    def receive(self, it, stats):
        if not absent(self, it):
            real_receive(self, it, stats)
    monkeypatch.setattr(scheme, "send", send)
    monkeypatch.setattr(scheme, "receive", receive)
