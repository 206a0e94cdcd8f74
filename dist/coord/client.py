"""A rank's side of the coordinator (dist/coord/coordinator.py): register and wait for the book,
barriers, small allreduces and gathers, queries, cost reports, and the job's end.

Every call is numbered per name, so the coordinator pairs the n-th call of each rank; the keys
that name the calls live here because the coordinator reads the same ones (the loss's allreduce,
the cost reports).
"""
import socket
import zlib

import numpy

from .book import InformationBook
from ..errors import DeadlineError, DistError
from ..job.roles import COORDINATOR
from ..transport import Msg


def _key(name):
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


LOSS_KEY = _key("loss")     # the allreduce every worker makes once per iteration
COSTS_KEY = _key("costs")   # the cost reports and the schemes published from them
REGISTER_MARGIN_S = 5.0     # a rank waits this much longer for the book than the coordinator


class CoordinatorClient:
    """A rank's side of the coordinator: register, barrier, allreduce, gather, query, done."""

    def __init__(self, transport, roles, address, start_timeout=120.0):
        self.transport = transport
        self.roles = roles
        self.address = address
        self.start_timeout = start_timeout
        self._seq = {}
        self.action = None            # 'snapshot' / 'stop' told by the coordinator (signals)
        transport.connect(COORDINATOR, address)    # at once: a failure before registering is told

    def _next(self, name):
        n = self._seq.get(name, 0)
        self._seq[name] = n + 1
        return n

    def register(self, info):
        """Send this rank's info; wait for the book (every rank must register first)."""
        t = self.transport
        t.send(COORDINATOR, Msg.REGISTER, obj=dict(info, rank=t.rank, address=t.address,
                                                  local=t.local_info, host=socket.gethostname()))
        t.beat_to_coordinator(True)
        # a little longer than the coordinator's own wait: when it runs, its ABORT naming the
        # ranks that did not register comes first, and this rank stops with that reason
        patience = self.start_timeout + min(REGISTER_MARGIN_S, self.start_timeout / 4)
        try:
            msg = t.receive(Msg.BOOK, 0, 0, timeout=patience,
                            what="the information book", senders=[COORDINATOR])[0]
        except DeadlineError:
            raise DeadlineError(f"{t.name}: no information book from the coordinator at "
                                f"{self.address} within {patience:g} s: is worker 0 "
                                f"running, and have all {self.roles.size} processes "
                                f"({self.roles.workers} workers, {self.roles.servers} servers) "
                                f"been started?") from None
        t.watch(COORDINATOR)
        return InformationBook.from_wire(msg.obj)

    def barrier(self, name, group="workers", timeout=None):
        key, it = _key(name), self._next(("b", name))
        self.transport.send(COORDINATOR, Msg.BARRIER, iteration=it, key=key,
                            obj={"group": group, "name": name})
        self.transport.receive(Msg.BARRIER_DONE, key, it, timeout=timeout,
                               what=f"the end of barrier '{name}' (the other ranks)",
                               senders=[COORDINATOR])

    def allreduce(self, name, vector, op="mean", timeout=None):
        """Mean (or sum) over the workers, in rank order, of a small float vector (float64 out)."""
        key, it = _key(name), self._next(("r", name))
        vec = numpy.ascontiguousarray(numpy.asarray(vector, numpy.float64).reshape(-1))
        self.transport.send(COORDINATOR, Msg.ALLREDUCE, iteration=it, key=key,
                            aux=0 if op == "mean" else 1, arrays=[vec], obj={"name": name})
        msg = self.transport.receive(Msg.ALLREDUCE_DONE, key, it, timeout=timeout,
                                     what=f"the result of allreduce '{name}'",
                                     senders=[COORDINATOR])[0]
        return numpy.array(msg.arrays[0])

    def allreduce_async(self, name, vector, op="mean"):
        """Start an allreduce; returns a function that waits for and returns the result."""
        key, it = _key(name), self._next(("r", name))
        vec = numpy.ascontiguousarray(numpy.asarray(vector, numpy.float64).reshape(-1))
        self.transport.send(COORDINATOR, Msg.ALLREDUCE, iteration=it, key=key,
                            aux=0 if op == "mean" else 1, arrays=[vec], obj={"name": name})

        def wait(timeout=None):
            msg = self.transport.receive(Msg.ALLREDUCE_DONE, key, it, timeout=timeout,
                                         what=f"the result of allreduce '{name}'",
                                         senders=[COORDINATOR])[0]
            if isinstance(msg.obj, dict) and msg.obj.get("action"):
                self.action = msg.obj["action"]
            return numpy.array(msg.arrays[0])
        return wait

    def gather(self, name, obj, root=0, timeout=None):
        """JSON-able obj from every worker; the list (rank order) on `root`, None elsewhere."""
        key, it = _key(name), self._next(("g", name))
        self.transport.send(COORDINATOR, Msg.GATHER, iteration=it, key=key, aux=root,
                            obj={"name": name, "item": obj})
        if self.transport.rank != root:
            return None
        msg = self.transport.receive(Msg.GATHER_DONE, key, it, timeout=timeout,
                                     what=f"the gather '{name}'", senders=[COORDINATOR])[0]
        return msg.obj["items"]

    def query(self, what, timeout=None, **kw):
        key, it = _key("query"), self._next("query")
        self.transport.send(COORDINATOR, Msg.QUERY, iteration=it, key=key, obj=dict(kw, what=what))
        msg = self.transport.receive(Msg.QUERY_REPLY, key, it, timeout=timeout,
                                     what=f"the answer to query '{what}'", senders=[COORDINATOR])[0]
        if "error" in msg.obj:
            raise DistError(msg.obj["error"])
        return msg.obj["result"]

    def report_costs(self, report, start):
        """Send the coordinator this worker's cost report (its probe, or a refresh window's sync
        times) for choices in force from iteration `start`; returns the call, for `published`."""
        call = self._next("costs")
        self.transport.send(COORDINATOR, Msg.COSTS, iteration=call, key=COSTS_KEY,
                            obj={"report": report, "from": int(start)})
        return call

    def published(self, call, timeout=None):
        """The coordinator's answer to report `call`: every layer's scheme from an iteration on."""
        return self.transport.receive(Msg.SCHEMES, COSTS_KEY, call, timeout=timeout,
                                      what="the schemes the coordinator publishes from the "
                                           "cost reports", senders=[COORDINATOR])[0].obj

    def take_action(self):
        """The snapshot/stop the coordinator told with the last loss (once), or None."""
        action, self.action = self.action, None
        return action

    def request_action(self, action):
        """Ask the coordinator to have every worker snapshot or stop (see Coordinator.request)."""
        try:
            self.query("request_action", action=action, timeout=10)
        except DistError:
            pass

    def failed(self, reason):
        """Tell the coordinator this rank cannot go on (it aborts the job, naming this rank)."""
        try:
            if self.transport.connected(COORDINATOR):
                self.transport.send(COORDINATOR, Msg.FAILED, obj={"reason": reason})
        except Exception:
            pass

    def done(self):
        """This rank has finished normally: stop watching each other."""
        self.transport.unwatch(COORDINATOR)
        self.transport.beat_to_coordinator(False)
        try:
            self.transport.send(COORDINATOR, Msg.DONE)
        except DistError:
            pass
