"""What a worker checks and builds before it joins the job, apart from the hooks themselves.

The solver must be the one the session asked for (its data shard and replica count), since a
mismatch would train silently on the wrong data; the solver settings it registers are the ones
every worker must share; and the threads that run its syncs must use the worker's device.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy

from poseidon.engine.errors import ModelError

from ..errors import DistError

_NET_FIELDS = ("net", "net_param", "train_net", "train_net_param", "test_net", "test_net_param",
               "weights", "snapshot_prefix", "device_id", "solver_mode")


def check_solver(solver, session):
    """Refuse a solver whose train net reads another rank's data shard, or that needs what
    distributed training cannot give yet (gradient clipping)."""
    if tuple(solver.shard) != session.shard():
        raise DistError(f"{session.name}: the solver's train net reads data shard "
                        f"{tuple(solver.shard)}, not {session.shard()}: build it with "
                        f"get_solver(path, **session.solver_kwargs())")
    replicas = session.solver_kwargs()["replicas"]
    if solver.replicas.count != replicas:
        raise DistError(f"{session.name}: the solver runs {solver.replicas.count} replica(s) "
                        f"of the train net, but the job has {replicas} devices per node: "
                        f"build it with get_solver(path, **session.solver_kwargs())")
    if solver.param.clip_gradients >= 0:
        raise ModelError("clip_gradients is not supported in distributed training yet (it "
                         "needs the global gradient norm over every KV pair and every SFB "
                         "layer before any update); remove it from the solver file or train "
                         "on one process")


def solver_text(param):
    """The solver settings that must agree between workers (and that the servers need)."""
    from google.protobuf import text_format
    from poseidon.engine.proto import caffe_pb2
    p = caffe_pb2.SolverParameter()
    p.CopyFrom(param)
    for name in _NET_FIELDS:
        p.ClearField(name)
    return text_format.MessageToString(p)


def _current_device(xp):
    if xp is numpy:
        return None
    import cupy
    return cupy.cuda.runtime.getDevice()


def _start_sync_thread(device):
    """Pool threads start on CUDA device 0: make them use the worker's device."""
    if device is not None:
        import cupy
        cupy.cuda.Device(device).use()


def sync_pool(syncs, xp):
    """The thread pool that runs a worker's `syncs` syncs, each thread on the device the calling
    thread uses (arrays of module `xp`)."""
    return ThreadPoolExecutor(max_workers=max(1, syncs), thread_name_prefix="sync",
                              initializer=_start_sync_thread, initargs=(_current_device(xp),))
