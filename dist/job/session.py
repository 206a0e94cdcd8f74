"""One process's membership in a job: its rank, sockets, coordinator link and (on a server) its loop.

`init(...)` is the Python API's entry (Horovod's hvd.init()): it reads the options and the rank
(keywords, then --rank, then what mpirun or srun set), starts the coordinator thread on worker 0,
binds this process's inbox and connects to the coordinator. On a server rank it serves until the
job ends and then exits the program (as ps-lite and BytePS servers do), so a training script needs
no branch for servers. On a worker it returns the Session that `DistributedSolver` uses.
"""
import logging
import os
import sys
import threading

from . import faults
from ..coord.checks import WireRules
from ..coord.coordinator import Coordinator, CoordinatorClient
from ..errors import DistError
from .options import DistOptions, send_order, shared_kv_memory
from .stalls import watch_server
from .roles import COORDINATOR, Roles, rank_from_environment
from ..cost.probe import answer_probes
from .security import resolve_keys
from ..transport import (ZmqTransport, coordinator_bind_address, interface_address, route_address,
                        split_address)

_current = None
_local = threading.local()


def _warn(line):
    logging.getLogger("poseidon").warning(line)


def current():
    """This worker's Session (the one made current in this thread, else the process's), or None."""
    return getattr(_local, "session", None) or _current


def make_current(session):
    """What current() returns in this thread, and in the process when none is set there yet (a
    Python layer looks up its rank this way, also when roles run as threads in tests)."""
    global _current
    _local.session = session
    if _current is None:
        _current = session


def _checked_rank(rank, options, roles):
    """This process's rank: given, from --rank, or from mpirun's / srun's variables; in range."""
    if rank is None:
        rank = options.rank
    if rank is None:
        rank, _ = rank_from_environment()
    if rank is None:
        raise DistError("this process's rank is unknown: give --rank (0..P1+P2-1), or start "
                        "it with mpirun or srun (which set OMPI_COMM_WORLD_RANK, PMI_RANK or "
                        "SLURM_PROCID)")
    if not 0 <= rank < roles.size:
        raise DistError(f"rank {rank} is outside this job of {roles.workers} workers and "
                        f"{roles.servers} servers (ranks 0..{roles.size - 1})")
    return rank


class Session:
    def __init__(self, options, rank=None, log=None, verdict_file=None):
        """verdict_file: on worker 0, where the coordinator writes why it stopped the job and
        whom it blames (the local launcher reads it for its last line)."""
        self.options = options
        self.roles = Roles(options.workers, options.servers)
        rank = _checked_rank(rank, options, self.roles)
        if not options.coordinator:
            raise DistError("a distributed process needs --coordinator tcp://HOST:PORT")
        self.rank = rank
        self.log = log or (lambda line: None)
        host, port = split_address(options.coordinator)
        loopback = host in ("127.0.0.1", "localhost") or options.local
        self.keys = resolve_keys(options.keys, options.insecure, loopback,
                                 options.trusted_network)
        if options.interface:
            address = interface_address(options.interface)
        else:
            address = "127.0.0.1" if loopback else route_address(host)
        self.coordinator = None
        if rank == 0:
            self.coordinator = Coordinator(self.roles, "127.0.0.1" if loopback else
                                           coordinator_bind_address(host),
                                           port, timeout=options.timeout,
                                           start_timeout=options.start_timeout,
                                           lost_after=options.heartbeat_timeout,
                                           log=self.log, stall_warning=options.stall_warning,
                                           warn=_warn, keys=self.keys,
                                           cost_table=options.cost_table,
                                           verdict_file=verdict_file).start()
        self.transport = ZmqTransport(rank, namer=self.roles.name, timeout=options.timeout,
                                      bandwidth=options.bandwidth_bytes(),
                                      lost_after=options.heartbeat_timeout, keys=self.keys,
                                      rules=WireRules(rank, self.roles, self.roles.name),
                                      local_ipc=options.ipc != "off",
                                      direct_links=options.ipc in ("auto", "links"),
                                      shared_memory=shared_kv_memory(options),
                                      slice_bytes=options.slice_bytes,
                                      priority=send_order(options, loopback),
                                      credit_bytes=options.credit_bytes)
        if self.coordinator is not None:   # one process: their messages skip the sockets
            self.transport.attach_local(COORDINATOR, self.coordinator.transport)
            self.coordinator.transport.attach_local(rank, self.transport)
        self.transport.mailbox.owner = self.name               # for the stall inspector
        self.transport.mailbox.stall_warning = options.stall_warning
        self.transport.bind(address)      # this address only (127.0.0.1 for a local job)
        answer_probes(self.transport)     # the measured cost model's probes (dist/cost/probe.py)
        self.transport.start()
        self.client = CoordinatorClient(self.transport, self.roles, options.coordinator,
                                        start_timeout=options.start_timeout)
        self.book = None
        self._closed = False

    @property
    def name(self):
        return self.roles.name(self.rank)

    @property
    def is_worker(self):
        return self.roles.is_worker(self.rank)

    @property
    def is_server(self):
        return self.roles.is_server(self.rank)

    def shard(self):
        """(rank, P1): what a worker's Data layers read."""
        return (self.rank, self.roles.workers)

    def solver_kwargs(self):
        """Keywords for engine.solvers.get_solver so its nets read this worker's share, as
        --devices-per-node replicas (engine/replicas.py)."""
        import numpy
        return {"shard": self.shard(), "test_shard": self.shard(),
                "dtype": numpy.dtype(self.options.dtype),
                "replicas": int(self.options.devices_per_node)}

    def register(self, info):
        """Register with the coordinator, wait for the book, connect to the peers that matter."""
        faults.point("register")
        self.book = self.client.register(dict(info, options=self.options.shared(),
                                              pid=os.getpid()))
        self.transport.set_book(self.book)
        peers = (range(self.roles.size) if self.is_worker else self.roles.worker_ranks())
        for r in peers:
            if r != self.rank:
                self.transport.connect(r, self.book.address(r), self.book.local(r))
        local = sorted(self.roles.short(r) for r, how in self.transport.routes.items()
                       if how == "ipc")
        if local:
            direct = ("; KV pushes and their answers on direct links (--ipc zmq: all through "
                      "ZeroMQ; --ipc off: TCP)" if self.transport.direct_links() else
                      " (--ipc off for TCP)")
            self.log(f"{self.name}: {', '.join(local)} on this host: Unix sockets, no CURVE"
                     f"{direct}")
        return self.book

    def server_rank(self, server_index):
        return self.roles.server_rank(server_index)

    def serve(self, stats_path=None):
        """The server role: register, build the update rule from the book, serve until shutdown."""
        from google.protobuf import text_format
        from poseidon.engine.proto import caffe_pb2
        from poseidon.engine.solvers.rules import make_rule
        from ..kv.store import KVServer
        self.transport.set_fifo(KVServer.MESSAGES)     # before the book: INIT may come at once
        faults.watch_server(self.transport)
        book = self.register({"role": "server"})
        param = caffe_pb2.SolverParameter()
        text_format.Parse(book.data["solver"], param)
        server = KVServer(self.transport, book, self.roles, make_rule(param),
                          stats_path=stats_path, log=self.log, memory=self.transport.kv_memory)
        self.log(f"{self.name}: {len(server.pairs)} KV pairs, {server.bytes_held() / 1e6:.2f} MB")
        stop = threading.Event()
        watch_server(server, self.options.stall_warning, self.name, self.roles.name, _warn, stop)
        try:
            server.run()
        finally:
            stop.set()
        return server

    def fail(self, reason):
        self.client.failed(reason)

    def close(self, wait_coordinator=30.0):
        """Tell the coordinator we are done; on worker 0 wait for the others to be done too."""
        if self._closed:
            return
        self._closed = True
        self.client.done()
        if self.coordinator is not None:
            self.coordinator.join(wait_coordinator)
        self.transport.close(linger=2.0)

    def abort_close(self):
        """Close without waiting (after a failure)."""
        if self._closed:
            return
        self._closed = True
        self.transport.close(linger=0.5)
        if self.coordinator is not None:
            self.coordinator.join(3.0)


def init(serve_and_exit=True, **kw):
    """The Python API's start: options from keywords or the environment; returns the Session.

    On a server rank (rank >= P1) it serves the KV store until the job ends and then calls
    sys.exit(0), unless serve_and_exit=False."""
    global _current
    options = kw.pop("options", None) or DistOptions.from_environment(**kw)
    session = Session(options)
    _current = session
    if session.is_server and serve_and_exit:
        try:
            session.serve()
        finally:
            session.close()
        sys.exit(0)
    return session


__all__ = ["Session", "init", "current", "COORDINATOR"]
