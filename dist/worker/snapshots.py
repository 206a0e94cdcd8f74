"""One snapshot for a whole distributed job, and a resume of every worker from it.

Worker 0 writes the engine's files (weights, and a solverstate holding the history the servers keep
for PS parameters, fetched from them first), its own cursors, and one cursor file per other worker
(gathered through the coordinator); the manifest, written last, covers all of them, so a torn
distributed snapshot is refused on resume. On resume worker 0 reads the snapshot and hands every
other worker its cursor file; the parameters and solver state reach them when the run starts again
(dist/worker/replicas.py), as at any start.
"""
import hashlib
import json
import logging
import os

import numpy

from poseidon.engine import backend
from poseidon.engine.io import caffemodel
from poseidon.engine.io.manifest import snapshot_base
from poseidon.engine.proto import caffe_pb2

from ..job import faults
from ..errors import DistError
from ..schemes import scheme_class
from ..transport import Msg

log = logging.getLogger("poseidon")


def worker_cursor_path(state_path, rank):
    """<prefix>_iter_N.solverstate -> <prefix>_iter_N.cursors.worker-R.json."""
    return f"{snapshot_base(state_path)}.cursors.worker-{rank}.json"


def params_digest(arrays):
    """A SHA-256 of parameter values (dtype, shape and bytes of each, in order): equal digests
    mean bitwise-equal replicas."""
    h = hashlib.sha256()
    for a in arrays:
        a = numpy.ascontiguousarray(backend.to_numpy(a))
        h.update(f"{a.dtype.str}{a.shape};".encode("ascii"))
        h.update(a.reshape(-1).view(numpy.uint8))       # the bytes, without a copy
    return h.hexdigest()


def state_file_name(solver):
    """The solverstate path worker 0 writes at the solver's iteration (the engine's naming)."""
    hdf5 = solver.param.snapshot_format == caffe_pb2.SolverParameter.HDF5
    return solver.snapshot_filename(".solverstate.h5" if hdf5 else ".solverstate")


class JobSnapshots:
    """The snapshot and restore points of a worker's hooks. `average_statistics()`: the mean of the
    stored statistics over the workers (BatchNorm), taken before the weights are written."""

    def __init__(self, name, rank, roles, client, kv, transport, verdicts, staleness,
                 average_statistics, slow):
        self.name, self.rank, self.roles = name, rank, roles
        self.client, self.kv, self.transport = client, kv, transport
        self.verdicts, self.staleness = verdicts, staleness
        self.average_statistics, self.slow = average_statistics, slow
        self._peer_cursors = None

    def _fetch_server_state(self, solver):
        """Worker 0: the history of every PS parameter from the servers, and under --staleness
        the values too (worker 0's own may miss up to s iterations of the others' updates)."""
        net = solver.net
        counts = {pid: b.count for pid, b in enumerate(net.learnable_params)}
        book, last = self.kv.book, max(solver.iter - 1, 0)   # the iteration just updated
        on_servers = None                # all the servers hold, unless a layer may leave them
        if book.measured:                # (the measured cost model): those PS syncs now
            on_servers = [p.id for p in book.params if p.scheme is not None
                          and scheme_class(book.scheme_of_param(p.id, last)).uses_servers]
        hosts = self.kv.fetch_state(counts, net.dtype, lambda pid: len(solver.history[pid]),
                                    pids=on_servers)
        for pid, (value, *arrays) in hosts.items():
            for h, host in zip(solver.history[pid], arrays):
                h[...] = backend.to_xp(host.reshape(h.shape), backend.get_array_module(h))
            if self.staleness:
                data = net.learnable_params[pid].data
                data[...] = backend.to_xp(value.reshape(data.shape), backend.get_array_module(data))

    def snapshot(self, solver, write):
        faults.point("snapshot", solver.iter)
        self.average_statistics()
        mine = dict(solver.cursor_state(), rank=self.rank, workers=self.roles.workers,
                    params_sha256=params_digest(b.data for b in solver.net.learnable_params))
        cursors = self.client.gather("cursors", mine, timeout=self.slow)
        state_file = None
        if self.rank == 0:
            self._check_replicas(solver.iter, cursors)
            self._fetch_server_state(solver)
            self._peer_cursors = cursors[1:]
            try:
                state_file = write()
            finally:
                self._peer_cursors = None
            log.info(f"Distributed snapshot at iteration {solver.iter}: {state_file} (+ cursor "
                     f"files of {self.roles.workers - 1} other worker(s))")
        self.client.barrier("snapshot", timeout=self.slow)
        faults.point("snapshot-done", solver.iter)
        self.verdicts.last_snapshot = state_file or state_file_name(solver)
        return state_file

    def _check_replicas(self, iteration, cursors):
        """Worker 0: under BSP every replica holds the same bits; say which ones do not (the
        snapshot keeps worker 0's). Under --staleness replicas may lag and are not compared."""
        if self.staleness:
            return
        own = cursors[0]["params_sha256"]
        differ = [c["rank"] for c in cursors[1:] if c.get("params_sha256") != own]
        if differ:
            log.warning(f"iteration {iteration}: the parameters of "
                        f"{', '.join(self.roles.name(r) for r in differ)} differ from worker 0's "
                        f"(the replicas should be bitwise identical; the snapshot holds worker "
                        f"0's)")

    def snapshot_files(self, solver, state_file):
        """Worker 0, before the manifest: the other workers' cursor files."""
        extra = []
        for cursor in self._peer_cursors or []:
            path = worker_cursor_path(state_file, cursor["rank"])
            caffemodel.write_atomic(path, json.dumps(cursor).encode("utf-8"))
            extra.append(path)
        faults.point("snapshot-files", solver.iter)
        return extra

    def _cursor_of(self, path, rank):
        cursor = worker_cursor_path(os.fspath(path), rank)
        if not os.path.exists(cursor):
            raise DistError(f"no cursor file {cursor} for worker {rank} beside the snapshot "
                            f"{path}: a distributed snapshot has one per worker; resume with the "
                            f"worker count it was written with")
        with open(cursor, "r", encoding="utf-8") as f:
            state = json.load(f)
        if int(state.get("workers", 0)) != self.roles.workers:
            raise DistError(f"{path} was written by a run of {state.get('workers')} workers; "
                            f"this one has {self.roles.workers}: resume with --workers "
                            f"{state.get('workers')}")
        return state

    def restore(self, solver, path, read):
        """Worker 0 reads the snapshot and sends each other worker its cursors; they take them."""
        if self.rank == 0:
            read(path)
            for r in self.roles.worker_ranks()[1:]:
                self.transport.send(r, Msg.CURSOR, obj=dict(self._cursor_of(path, r),
                                                            snapshot=os.fspath(path)))
        else:
            state = self.transport.receive(
                Msg.CURSOR, 0, 0, timeout=self.slow, senders=[0],
                what="this worker's data cursor from worker 0's snapshot")[0].obj
            if state.get("fresh"):                 # --resume auto found no snapshot
                return
            solver.load_cursor_state(state)
            path = state.get("snapshot") or path   # worker 0's file ('auto' names none)
        self.verdicts.last_snapshot = os.fspath(path)
