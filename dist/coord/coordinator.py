"""The coordinator: the information book, Algorithm 1, and the job's small collective services.

It runs as a thread beside worker 0 on a ROUTER socket bound at the job's coordinator address.
- Registration: every rank sends its inbox address, its options and (workers) a description of its
  net and solver. When all P1 + P2 ranks have registered, the coordinator checks that they agree
  (a mismatch stops the job with a message naming both ranks and what differs: the #100 / #43259
  class of silent hangs in Horovod and DDP), builds the book (BestScheme per layer, KV-pair
  placement) and hands the same book to everyone.
- Services: barriers, allreduce-mean of small vectors in rank order (test outputs, the display loss,
  BatchNorm statistics), gathers to worker 0 (the timeline), `Query`.
- Hardening: a message whose fields are not what its handler reads is dropped before it gets here
  (dist/coord/control.py, through the transport's checks); one that does not fit the coordinator's state
  (a collective call already completed, a repeat, a REGISTER once the job runs) is dropped here,
  logged and counted the same way (`transport.drop`), and the unfinished collectives are bounded
  (dist/coord/collectives.py). A member that sends nonsense does not stop the job.
- The cost reports are the exception: every worker waits for the schemes planned from all of a
  call's reports, so a report of a call the workers wait on that cannot be used (a field that is
  not what the planner reads, reports of one call that disagree, a planner that fails on them, or
  a report that does not come while the others have) stops the job at once, naming the rank,
  rather than leaving the workers to wait out 10 x --timeout for an answer that cannot come.
- Liveness: every process sends a heartbeat each second; the coordinator sends one to every process.
  A rank silent for --heartbeat-timeout seconds, or one that reports a failure, makes the
  coordinator broadcast ABORT with a reason naming the lost role and rank, so every process stops
  with that message instead of waiting for ever. The verdict (the reason and the ranks it blames)
  is also written to a file when the local launcher asks for one, so that the launcher's last line
  names the process that stopped the job rather than the first one to exit because of it.

`Coordinator` is the service; `CoordinatorClient`, what a worker or server calls, lives in
dist/coord/client.py and is importable from here too.
"""
import json
import os
import threading
import time
import types

import numpy

from . import control
from .book import InformationBook, describe_net, digest, first_difference
from .records import description_from_wire
from .checks import WireRules
from .client import COSTS_KEY, LOSS_KEY, CoordinatorClient, _key
from .collectives import FUTURE_CALLS, Collectives
from ..cost.links import load_cost_table
from ..cost.model import Planner
from ..errors import AbortError, DistError
from ..job.roles import COORDINATOR
from ..transport import Msg, ZmqTransport

# what callers take from here: the service, with the client and the call keys it pairs with
__all__ = ["Coordinator", "CoordinatorClient", "COSTS_KEY", "LOSS_KEY", "_key", "InformationBook",
           "describe_net", "digest", "first_difference"]

QUERY_FIELDS = ("index", "param", "server")    # what InformationBook.query reads
# the share of the collectives' give-up time (a worker's own wait for the schemes) after which a
# cost report that has not come while others of its call have stops the job, naming the rank
COSTS_PATIENCE = 0.9


class Coordinator:
    """The coordinator service thread. `start()` binds (so a busy port fails at once) and runs."""

    def __init__(self, roles, bind_host, port, timeout=30.0, start_timeout=120.0, heartbeat=1.0,
                 lost_after=10.0, log=None, stall_warning=0.0, warn=None, keys=None,
                 cost_table=None, verdict_file=None):
        self.roles = roles
        self.verdict_file = verdict_file  # where the abort's reason and blamed ranks are written
        # a --cost-table file is read and checked here, before anything binds: a fault in it is
        # one line from worker 0 at start
        self.planner = Planner(roles, load_cost_table(cost_table) if cost_table else None)
        self.stall_warning = float(stall_warning or 0)
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.heartbeat = heartbeat
        self.log = log or (lambda line: None)
        self.warn = warn or self.log
        self.transport = ZmqTransport(COORDINATOR, namer=roles.name, timeout=timeout,
                                      router=True, heartbeat=heartbeat, lost_after=lost_after,
                                      name="the coordinator", keys=keys,
                                      rules=WireRules(COORDINATOR, roles, roles.name))
        self.transport.set_fifo(list(Msg))
        try:
            self.address = self.transport.bind(bind_host, port)
        except Exception as e:
            self.transport.close(0)
            raise DistError(f"the coordinator cannot bind {bind_host}:{port}: {e} (is another job "
                            f"using this port? pick another --coordinator port)") from None
        self.book = None
        self.registered = {}
        self.done = set()
        self.error = None
        self.aborted_reason = None
        self.failed_rank = None           # the rank whose FAILED stopped the job (it knows why)
        self.blamed = None                # the ranks an abort blames (None: not decided yet)
        self._thread = None
        # a collective no member still waits for is given up: a member waits for one at most
        # max(10 timeouts, the start timeout) (DistributedSolver's patience for slow peers)
        self.collectives = Collectives(max(10 * timeout, start_timeout), log=self.log)
        self._requested = None        # 'snapshot' or 'stop' (a signal), told with the next loss
        self._costs_done = -1         # the last cost-report call whose schemes were published

    def request(self, action):
        """Have every worker snapshot or stop after the iteration whose loss is reduced next
        (safe from a signal handler: it only sets a field)."""
        if self._requested != "stop":
            self._requested = action

    def take_request(self):
        """The snapshot/stop requested since the last call, or None (a job of one worker takes it
        here at its next iteration instead of with the reduced loss)."""
        action, self._requested = self._requested, None
        return action

    def start(self):
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)
        self.transport.start()
        self._thread.start()
        return self

    def join(self, timeout=None):
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    # ----- the thread ------------------------------------------------------------------------------
    def _run(self):
        try:
            self._register_all()
            self._serve()
        except AbortError as e:
            if self.blamed is None:     # a FAILED names its rank; else a watched rank went silent
                self.blamed = self.transport.silent_ranks()
            self._abort(str(e))
        except DistError as e:
            self._abort(str(e))
        except Exception as e:          # a bug in the service: stop the job, say where
            self._abort(f"the coordinator failed: {type(e).__name__}: {e}")
            self.error = e
        finally:
            # after an abort, the ABORTs are best effort: one queued for a rank that has exited
            # would hold the close for the whole linger, and worker 0 (whose process this thread
            # lives in) with it, past the launcher's patience (it then names the wrong cause)
            self.transport.close(linger=0.5 if self.aborted_reason is not None else 2.0)

    def _register_all(self):
        start = time.monotonic()
        deadline = start + self.start_timeout
        warned = start
        roles = self.roles
        while len(self.registered) < roles.size:
            now = time.monotonic()
            left = deadline - now
            missing = [r for r in range(roles.size) if r not in self.registered]
            if left <= 0:
                self.blamed = missing
                raise DistError(f"only {len(self.registered)} of {roles.size} processes registered "
                                f"with the coordinator within {self.start_timeout:g} s; missing: "
                                f"{', '.join(roles.name(r) for r in missing)} (start them with the "
                                f"same --workers, --servers and --coordinator, each with its own "
                                f"--rank)")
            if self.stall_warning and now - warned >= self.stall_warning:
                warned = now        # the ranks that did register wait for these: say which
                self.warn(f"the coordinator: waiting {now - start:.0f} s for "
                          f"{', '.join(roles.name(r) for r in missing)} to register "
                          f"({len(self.registered)} of {roles.size} have; --start-timeout "
                          f"{self.start_timeout:g})")
            msg = self.transport.next(timeout=min(left, 0.5))
            if msg is not None:
                self._handle(msg, {Msg.REGISTER: self._on_register, Msg.FAILED: self._on_failed,
                                   Msg.DONE: lambda m: self.done.add(m.sender)},
                             "before every rank has registered")
        self._check_agreement()
        workers0 = self.registered[0]
        self.book = InformationBook.build(
            description_from_wire(workers0["description"]), roles.workers, roles.servers,
            workers0["options"],
            addresses={r: info["address"] for r, info in self.registered.items()},
            hosts={r: info["host"] for r, info in self.registered.items()},
            local={r: info.get("local") for r, info in self.registered.items()},
            solver_text=workers0.get("solver", ""))
        for rank in range(roles.size):
            self.transport.send(rank, Msg.BOOK, obj=self.book.to_wire())
        self.log(f"all {roles.size} processes registered ({roles.workers} workers, "
                 f"{roles.servers} servers); book sent")

    def _handle(self, msg, handlers, when):
        """Hand msg to its handler; a type not taken now, or a message its handler cannot use,
        is dropped (logged and counted), never raised: only a failure of the job stops it."""
        handler = handlers.get(msg.type)
        if handler is None:
            self.transport.drop(msg, f"{msg.type.name} is not taken {when}")
            return
        try:
            handler(msg)
        except DistError:            # AbortError too: a rank failed, or ranks really disagree
            raise
        except Exception as e:       # a field no check foresaw: this message is bad, not the job
            self.transport.drop(msg, f"{msg.type.name} could not be used ({type(e).__name__}: "
                                     f"{e})")

    def _on_register(self, msg):
        info = msg.obj               # its fields were checked on arrival (dist/coord/control.py)
        rank = info["rank"]
        if rank in self.registered:
            old = self.registered[rank]
            if all(old.get(f) == info.get(f) for f in ("host", "pid", "address")):
                self.transport.drop(msg, f"a second REGISTER from {self.roles.name(rank)}")
                return
            raise DistError(f"two processes registered as {self.roles.name(rank)}: "
                            f"{old['host']} pid {old['pid']} and {info['host']} pid {info['pid']}; "
                            f"give each process its own --rank")
        self.registered[rank] = info
        self.transport.connect(rank, info["address"])
        self.transport.watch(rank)

    def _check_agreement(self):
        roles = self.roles
        base = self.registered[0]
        for rank in range(1, roles.size):
            info = self.registered[rank]
            diff = first_difference(base["options"], info["options"])
            if diff:
                raise DistError(f"{roles.name(0)} and {roles.name(rank)} were started with "
                                f"different options ({diff}); start every process of the job "
                                f"with the same --workers, --servers, --sync, --kv-pair-bytes, "
                                f"--sum-gradients and --dtype")
            if not roles.is_worker(rank):
                continue
            if digest(info["description"]) != digest(base["description"]):
                diff = first_difference(base["description"], info["description"])
                raise DistError(f"{roles.name(0)} and {roles.name(rank)} do not train the same "
                                f"network: {diff}")
            if info.get("solver", "") != base.get("solver", ""):
                a = dict(line.split(":", 1) for line in base.get("solver", "").splitlines()
                         if ":" in line)
                b = dict(line.split(":", 1) for line in info.get("solver", "").splitlines()
                         if ":" in line)
                diff = first_difference(a, b) or "the solver files differ"
                raise DistError(f"{roles.name(0)} and {roles.name(rank)} use different solver "
                                f"settings ({diff})")

    def _serve(self):
        roles = self.roles
        for rank in self.done:
            self.transport.unwatch(rank)
        last_beat = 0.0
        handlers = {Msg.BARRIER: self._on_barrier, Msg.ALLREDUCE: self._on_allreduce,
                    Msg.GATHER: self._on_gather, Msg.FAILED: self._on_failed,
                    Msg.DONE: self._on_done, Msg.QUERY: self._on_query,
                    Msg.COSTS: self._on_costs}
        while len(self.done) < roles.size:
            msg = self.transport.next(timeout=0.2)
            if msg is not None:
                self._handle(msg, handlers, "once every rank has registered")
            now = time.monotonic()
            if self.stall_warning:
                self._inspect_stalls(now)
            if now - last_beat >= self.heartbeat:
                last_beat = now
                self._costs_overdue(now)
                self.collectives.expire(now)
                for rank in range(roles.size):
                    if rank not in self.done:
                        try:
                            self.transport.send(rank, Msg.HEARTBEAT)
                        except DistError:
                            pass

    # ----- services --------------------------------------------------------------------------------
    def _group(self, name):
        return self.roles.worker_ranks() if name == "workers" else list(range(self.roles.size))

    def _arrive(self, kind, msg, group, value, **kw):
        """File msg's part of a collective; the Open collective, or None when msg was dropped
        (a call already completed, far ahead, repeated, from outside the group, ...)."""
        entry, reason = self.collectives.arrive(kind, msg, group, value,
                                                name=msg.obj.get("name", msg.key), **kw)
        if reason is not None:
            self.transport.drop(msg, reason)
        return entry

    def _inspect_stalls(self, now):
        """One line per --stall-warning interval per collective still waiting: for whom."""
        for entry in self.collectives.open.values():
            if now - entry.warned >= self.stall_warning:
                entry.warned = now
                missing = ", ".join(self.roles.name(r) for r in entry.group
                                    if r not in entry.arrived)
                self.warn(f"the coordinator: {entry.label}: waiting {now - entry.since:.0f} s "
                          f"for {missing}")

    def _on_barrier(self, msg):
        group = self._group(msg.obj["group"])
        entry = self._arrive("barrier", msg, group, True, tag=msg.obj["group"])
        if entry is not None and entry.complete:
            self.collectives.finish(entry)
            for rank in group:
                self.transport.send(rank, Msg.BARRIER_DONE, iteration=msg.iteration, key=msg.key)

    def _on_allreduce(self, msg):
        workers = self.roles.worker_ranks()
        entry = self._arrive("allreduce", msg, workers, numpy.array(msg.arrays[0], numpy.float64))
        if entry is None or not entry.complete:
            return
        got = entry.arrived
        acc = got[workers[0]].copy()
        for rank in workers[1:]:                  # rank order: the same bits every time
            if got[rank].shape != acc.shape:      # the workers really disagree: say so
                raise DistError(f"allreduce '{msg.obj.get('name', msg.key)}': "
                                f"{self.roles.name(rank)} sent {got[rank].size} values, "
                                f"{self.roles.name(workers[0])} {acc.size}")
            acc += got[rank]
        self.collectives.finish(entry)
        if msg.aux == 0:
            acc /= len(workers)
        told = None
        if msg.key == LOSS_KEY and self._requested:     # every worker acts at this iteration
            told, self._requested = {"action": self._requested}, None
        for rank in workers:
            self.transport.send(rank, Msg.ALLREDUCE_DONE, iteration=msg.iteration,
                                key=msg.key, arrays=[acc], obj=told)

    def _on_gather(self, msg):
        workers = self.roles.worker_ranks()
        entry = self._arrive("gather", msg, workers, msg.obj["item"], root=msg.aux)
        if entry is not None and entry.complete:
            self.collectives.finish(entry)
            self.transport.send(entry.root, Msg.GATHER_DONE, iteration=msg.iteration,
                                key=msg.key, obj={"items": [entry.arrived[r] for r in workers]})

    def _on_costs(self, msg):
        """Every worker's cost report of a call in: plan, and publish the same choices to every
        worker. The report's fields are checked here, not in the receive thread: a bad one of a
        call the workers wait on stops the job naming its sender; one of no such call (far
        ahead, already published, in a job of the static model) is dropped."""
        roles = self.roles
        call = msg.iteration
        current = (self.book.measured and roles.is_worker(msg.sender)
                   and self._costs_done < call <= self._costs_done + FUTURE_CALLS)
        why = control.costs_reason(msg, roles, {rec.index for rec in self.book.layers})
        if why is not None:
            self.transport.drop(msg, why)
            if current:
                raise DistError(f"{roles.name(msg.sender)} sent a cost report the coordinator "
                                f"cannot use ({why}); every worker waits for the schemes planned "
                                f"from all the reports of call {call}")
            return
        if not self.book.measured:
            self.transport.drop(msg, "COSTS in a job of the static cost model, which takes none")
            return
        workers = roles.worker_ranks()
        entry, reason = self.collectives.arrive("costs", msg, workers, msg.obj, name="costs")
        if reason is not None:
            self.transport.drop(msg, reason)
            return
        self._costs_agree(entry, msg.sender)
        if not entry.complete:
            return
        self.collectives.finish(entry)
        self._costs_done = max(self._costs_done, call)
        start = msg.obj["from"]
        try:
            published = self.planner.decide(self.book, {r: entry.arrived[r]["report"]
                                                        for r in workers}, start)
            why = control.SCHEMAS[Msg.SCHEMES].reason(
                types.SimpleNamespace(type=Msg.SCHEMES, obj=published, sender=COORDINATOR),
                roles)
        except Exception as e:        # the reports were checked: the planner's fault, said once
            what = str(e) if isinstance(e, DistError) else f"{type(e).__name__}: {e}"
            raise DistError(f"the coordinator cannot choose schemes from the cost reports of call "
                            f"{call} (choices from iteration {start}): {what}") from None
        if why is not None:
            raise DistError(f"the coordinator's schemes from the cost reports of call {call} are "
                            f"not what a worker takes ({why})")
        for rank in workers:
            self.transport.send(rank, Msg.SCHEMES, iteration=call, key=msg.key, obj=published)

    def _costs_agree(self, entry, sender):
        """The report `sender` just filed says what the others of its call say: choices from the
        same iteration (published under one, a switch would reach some worker at the wrong
        iteration, without its history move), and the same kind (a probe or sync times)."""
        others = [r for r in entry.arrived if r != sender]
        if not others:
            return
        rank = min(others)          # every earlier arrival already agreed with the others
        mine, theirs = entry.arrived[sender], entry.arrived[rank]
        name = self.roles.name

        def kind(obj):
            return "link costs" if "links" in obj["report"] else "sync times"
        if kind(mine) != kind(theirs):
            raise DistError(f"{name(sender)} reports {kind(mine)} where {name(rank)} reports "
                            f"{kind(theirs)} (cost report call {entry.call}); the workers of a "
                            f"job report the same thing at the same call")
        if mine["from"] != theirs["from"]:
            raise DistError(f"{name(sender)} reports {kind(mine)} for choices from iteration "
                            f"{mine['from']}, but {name(rank)} from iteration {theirs['from']} "
                            f"(cost report call {entry.call}); the workers of a job must agree "
                            f"on when the choices take effect")

    def _costs_overdue(self, now):
        """Stop the job naming the workers whose report of the next cost call has not come while
        the others' came COSTS_PATIENCE of the collectives' give-up time ago: the others wait for
        the schemes only that long, and would then stop naming no culprit."""
        patience = COSTS_PATIENCE * self.collectives.expire_after
        for entry in list(self.collectives.open.values()):
            if (entry.kind != "costs" or entry.call != self._costs_done + 1
                    or now - entry.since <= patience):
                continue
            name = self.roles.name
            missing = [r for r in entry.group if r not in entry.arrived]
            why = (f"{', '.join(name(r) for r in missing)} sent no cost report for call "
                   f"{entry.call} within {patience:.3g} s of the others "
                   f"({', '.join(name(r) for r in sorted(entry.arrived))}), who wait for the "
                   f"schemes planned from every worker's report")
            raise DistError("; ".join([why] + self.transport.drop_notes(missing)))

    def _on_query(self, msg):
        q = dict(msg.obj)             # its fields were checked on arrival (dist/coord/control.py)
        what = q.pop("what")
        if what == "request_action":          # a signal on a rank other than worker 0
            self.request(q["action"])
            self.transport.send(msg.sender, Msg.QUERY_REPLY, iteration=msg.iteration,
                                key=msg.key, obj={"result": True})
            return
        try:
            result = {"result": self.book.query(what, **{f: q[f] for f in QUERY_FIELDS if f in q})}
        except (DistError, KeyError, ValueError) as e:
            result = {"error": f"{e}" if not isinstance(e, KeyError) else
                      f"query '{what}': {e} is not in the book"}
        self.transport.send(msg.sender, Msg.QUERY_REPLY, iteration=msg.iteration, key=msg.key,
                            obj=result)

    def _on_failed(self, msg):
        reason = msg.obj["reason"]
        self.failed_rank = msg.sender
        self.blamed = [msg.sender]
        raise AbortError(f"{self.roles.name(msg.sender)} failed: {reason}")

    def _on_done(self, msg):
        self.done.add(msg.sender)
        self.transport.unwatch(msg.sender)

    def _write_verdict(self, reason):
        """The abort's reason and blamed ranks for the local launcher (written whole, then
        renamed, before any ABORT is sent: whoever exits because of it exits after this)."""
        if not self.verdict_file:
            return
        tmp = f"{self.verdict_file}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"reason": reason, "ranks": list(self.blamed or [])}, f)
            os.replace(tmp, self.verdict_file)
        except OSError:
            pass

    def _abort(self, reason):
        self.aborted_reason = reason
        self._write_verdict(reason)
        self.log(f"stopping the job: {reason}")
        for rank, info in list(self.registered.items()):
            if rank in self.done or rank == self.failed_rank:   # it stopped by itself
                continue
            try:
                self.transport.connect(rank, info["address"])
                self.transport.send(rank, Msg.ABORT, obj={"reason": reason})
            except Exception:
                pass
