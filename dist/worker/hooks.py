"""The worker: Algorithm 2 of the Poseidon paper, as hooks into the engine's one Solver loop.

    session = dist.init()                                        # rank, coordinator, servers
    solver = dist.DistributedSolver(get_solver(path, **session.solver_kwargs()))
    solver.solve()                                               # or solver.step(n) ... finish()

The engine's Solver runs Caffe's loop (tests, display, smoothed loss, snapshots, early exit) and
calls its hooks at fixed points (engine/solvers/hooks.py). WorkerHooks fills them in:

    begin_iteration   each synced layer's scheme for the iteration (BestScheme(l)); a scheme that
                      rebuilds the weight gradient from sufficient factors (SFB) tells the solver
                      to leave it to the sync
    before_forward    layer l's forward waits for the syncs of the last iteration it depends on:
                      layer l's own (its new parameters) and any that still sends a blob the
                      forward overwrites (dist/worker/layerwait.py), not for every sync
    before_backward   every sync of the last iteration done before the gradients are cleared
    after_forward     the loss's mean over the workers is asked for while backward runs
    after_backward    for l = L..1, right after BackwardThrough(l): sync(l) goes to a thread pool
                      (wait-free backpropagation; `--no-overlap` starts them all after the whole
                      backward); the last to start runs on this thread (nothing is left to
                      overlap with it)
    loss              the mean loss over the workers (a signal's snapshot or stop is read here,
                      so every worker acts at the same iteration)
    before_update     the loss's verdict; under --no-overlap, --staleness or --straggler-timeout
                      the full BSP barrier: every sync of the iteration done (they leave the new
                      parameters: the servers' for PS, the local update for SFB). Otherwise the
                      syncs run on into the next iteration's forward (per-layer wait above), and
                      a test, a snapshot, the end of a step() call and the end of training wait
                      for all of them first. A NaN or Inf stops the job naming the first bad
                      layer in backward order, from whichever wait sees the failed sync first
    test              each worker runs its share of test_iter on its shard; outputs averaged
    snapshot/restore  one snapshot of the job on worker 0's disk (dist/worker/snapshots.py)
    begin             the replicas start from worker 0's state (dist/worker/replicas.py)

With --devices-per-node G the solver's net is the leader of G replicas (engine/replicas.py): the
loop has put the replicas' mean gradient of layer l in it before after_backward(l), and SFB sends
the replicas' factors stacked (SyncContext.factors), so these hooks see one net per worker.
BatchNorm's stored statistics are averaged over the workers before testing and snapshotting.
Under --straggler-timeout / --staleness (dist/coord/consistency.py does the servers' side) every layer
goes by PS, and the displayed loss is worker 0's own (a mean over workers would wait for the
slowest).
"""
import logging
import math
import os

import numpy

from poseidon.engine import backend
from poseidon.engine.solvers.hooks import SolverHooks

from ..job import faults
from . import replicas
from ..coord.book import describe_net, relaxed_consistency
from ..coord.records import description_to_wire
from ..cost.sync import CostSync
from ..errors import DistError
from .iterrecord import IterationRecorder
from ..kv.client import KVClient
from .layerwait import forward_waits
from ..schemes import may_send_bottom_data
from ..job.session import current, make_current
from .snapshots import JobSnapshots
from .startup import check_solver, solver_text, sync_pool
from .syncer import StreamPool, SyncContext, Syncer
from .timeline import Timeline, role_path, slice_recorder, write_trace
from ..transport import onehost
from ..job.verdicts import Verdicts
from .wfbp import WaitFreeBackprop

log = logging.getLogger("poseidon")


def spin_seconds(book, roles):
    """How long the main thread's wait for the last sync's answers may spin before it sleeps
    (onehost.SPIN_SECONDS): only on a job whose processes all share this host and have a core
    each, so that the spinning takes no core a server or another worker needs."""
    if not book.data.get("one_host"):
        return 0.0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return onehost.SPIN_SECONDS if roles.workers + roles.servers <= cores else 0.0


class WorkerHooks(SolverHooks):
    """Algorithm 2 for one worker; see the module docstring."""

    updates_parameters = True          # the syncs leave the new parameters (servers or SFB)

    def __init__(self, solver, session):
        self.session = session
        self.options = opts = session.options
        self.rank, self.roles = session.rank, session.roles
        self.transport, self.client = session.transport, session.client
        check_solver(solver, session)
        self.solver, self.net = solver, solver.net
        self.book = session.register({"role": "worker",
                                      "description": description_to_wire(describe_net(
                                          solver.net, solver.param.iter_size,
                                          solver.replicas.count)),
                                      "solver": solver_text(solver.param)})
        self.relaxed = relaxed_consistency(self.book.options)
        # one worker: the mean loss is its own, and the coordinator shares this process (it runs
        # beside worker 0), so a requested snapshot or stop is read from it directly
        self._solo = self.roles.workers == 1 and session.coordinator is not None
        self._slow = max(opts.timeout * 10, opts.start_timeout)
        self.kv = KVClient(self.transport, self.book, self.roles, self._slow)
        self.verdicts = Verdicts(session.name)
        self.placed = set()                     # parameters kept in a server's shared memory
        self._make_syncers(solver)
        self.costs = CostSync(self.book, self.client, self.kv, self.transport, self.roles,
                              opts.cost_refresh, self._slow)
        self.snapshots = JobSnapshots(session.name, self.rank, self.roles, self.client, self.kv,
                                      self.transport, self.verdicts, opts.staleness,
                                      self._average_statistics, self._slow)
        self._make_schedule()
        self._make_records()
        # the last iteration's barrier wait and exposed sync (seconds), kept without --stats for
        # callers in this process (the bench's part c, which must not pay for writing a --stats
        # line every iteration while it measures the sync path's cost)
        self.last_sync = None
        self._mean_loss = None                  # the pending mean of the loss over the workers
        self._started = False
        self._finished = False
        if self.rank == 0:
            self._log_job()

    def _make_syncers(self, solver):
        """One Syncer per synced layer, all sharing one SyncContext (what a sync may use)."""
        self.streams = StreamPool(len(self.book.synced_layers()))
        ctx = SyncContext(name=self.session.name, rank=self.rank, roles=self.roles,
                          book=self.book, net=self.net, rule=solver.rule, history=solver.history,
                          grad_scale=self.book.data["grad_scale"], transport=self.transport,
                          kv=self.kv, streams=self.streams, placed=self.placed,
                          verdicts=self.verdicts, factors=solver.factored.factors)
        self.syncers = {li: Syncer(ctx, li) for li in self.book.synced_layers()}

    def _make_schedule(self):
        """Wait-free backprop over the syncers: the sync pool, the per-layer waits, and which
        sync (if any) the training thread runs itself."""
        opts = self.options
        # the sync that starts after the last backward has nothing left to overlap with: the main
        # thread runs it itself (only if no layer below it has a backward to run, as under
        # force_backward)
        need = self.net.layer_need_backward
        lowest = min((li for li in self.syncers if need[li]), default=None)
        inline = lowest if lowest is not None and not any(need[:lowest]) else None
        if inline is not None:
            self.syncers[inline].spin = spin_seconds(self.book, self.roles)
        self.pool = sync_pool(len(self.syncers), self.net.xp)
        # the per-layer wait (dist/worker/layerwait.py); --no-overlap and relaxed consistency keep the
        # full barrier in before_update
        self.layer_wait = not (opts.no_overlap or self.relaxed)
        waits = (forward_waits(self.net, self.syncers,
                               lambda s: may_send_bottom_data(self.book, s.members, self.relaxed))
                 if self.layer_wait else {})
        self.wfbp = WaitFreeBackprop(self.syncers, self.pool, not opts.no_overlap, waits, inline,
                                     self._sync_failed)

    def _make_records(self):
        """The timeline and the per-iteration record (with its --stats file, if asked for)."""
        opts = self.options
        self.timeline = Timeline(self.rank, enabled=bool(opts.timeline))
        if opts.timeline:
            self.transport.slice_log = slice_recorder(self.timeline, self.net.layer_names)
        stats = (open(role_path(opts.stats, "worker", self.rank), "w", encoding="utf-8")
                 if opts.stats else None)
        self.record = IterationRecorder(self.rank, self.timeline, self.net.layer_names, stats)

    def _log_job(self):
        opts = self.options
        batch = next((layer.batch_size for layer in self.net.layers
                      if layer.batch_size is not None), "?")
        per_node = self.solver.replicas.count
        devices = f" x {per_node} devices" if per_node > 1 else ""
        log.info(f"Distributed: {self.roles.workers} workers{devices} x batch {batch} , "
                 f"{self.roles.servers} servers, --sync {opts.sync}"
                 f"{', no overlap' if opts.no_overlap else ''}")
        for line in self.book.summary_lines():
            log.info(line)
        if opts.straggler_timeout is not None:
            log.info(f"BSP with drop: a worker later than {opts.straggler_timeout:g} s after a "
                     f"KV pair's first push is left out of that iteration's average")
        elif opts.staleness:
            log.info(f"Bounded staleness (SSP): a worker may run {opts.staleness} iteration(s) "
                     f"ahead of the slowest")

    # ----- start: every replica from worker 0's state ----------------------------------------------
    def begin(self, solver):
        if self._started:
            return
        self._started = True
        net, history, it = self.net, solver.history, solver.iter
        faults.point("init", it)
        self.costs.start(it, net)         # the measured model's first choices, from `it`
        if self.rank == 0:
            replicas.init_servers(self.kv, net, history, it)
            replicas.send_state(self.transport, self.roles, self.book, net, history, it)
        else:
            replicas.receive_state(self.transport, self.session.name, net, history, it,
                                   self._slow)
        self.client.barrier("start", timeout=self._slow)
        replicas.place_in_kv_memory(self.book, self.transport, self.kv, self.rank, net,
                                    solver.test_nets, self.placed)

    # ----- Algorithm 2 (the schedule itself: dist/worker/wfbp.py) -------------------------------------------
    def begin_iteration(self, solver, it):
        """A new iteration: its verdicts, any scheme change the cost model published (which moves
        values and history, so no sync may be in flight), each layer's scheme; the layers whose
        scheme makes the weight gradient from sufficient factors."""
        self.verdicts.begin(it)
        if self.costs.due(it):
            self._settle()
        self.costs.before_iteration(it, self.net, solver.history)   # newly published schemes
        self.record.begin(it)
        return self.wfbp.begin_iteration(it)

    def before_forward(self, solver, it, layer):
        if layer == 0:
            self.record.forward_started(it)
        self.wfbp.before_forward(layer)

    def before_backward(self, solver, it):
        """The solver clears the gradients next, and the backward writes the top diffs: no sync
        of the last iteration may still be sending them."""
        self.record.forward_ended(it)
        self._settle()

    def after_forward(self, solver, it, pass_index, loss):
        faults.point("forward", it)
        self.record.loss_known(it, loss)
        if pass_index < solver.param.iter_size - 1:
            return
        mean = self.record.of(it).loss_sum / solver.param.iter_size
        if self.relaxed or self._solo:           # relaxed: no collective, it would wait
            self._mean_loss = lambda: [mean]
        else:
            self._mean_loss = self.client.allreduce_async("loss", [mean])

    def after_backward(self, solver, it, layer, pass_index, event):
        self.record.backward_done(it, layer, self.net.layer_need_backward[layer])
        if pass_index < solver.param.iter_size - 1:
            return
        self.wfbp.backward_done(it, layer, event)
        if not self.options.no_overlap and layer in self.syncers:
            faults.point("backward", it)

    wants_backward_events = True        # a sync's device-to-host moves wait for its backward

    def loss(self, solver, it, loss):
        """The mean loss over the workers, and a requested snapshot or stop, which every worker
        takes at this iteration."""
        try:
            loss = float(self._mean_loss()[0])
        except DistError:
            self._drain()
            raise
        action = self.client.take_action()
        if self._solo and action is None:
            action = self.session.coordinator.take_request()
        if action:
            solver.request(action)
        self.record.of(it).mean_loss = loss
        return loss

    def _drain(self):
        """After a failure: cancel the syncs not yet started, so the pool is not left blocked, and
        forget them (a later iteration waits for its own syncs only)."""
        self.wfbp.cancel()

    def _sync_failed(self, it, errors):
        """A waited sync of iteration `it` failed: stop the job naming the first bad layer in
        backward order when a gradient held NaN/Inf, else the failure itself."""
        error = self.verdicts.first_bad(it, self.syncers) or errors[0]
        if not isinstance(error, DistError):
            error = DistError(f"{self.session.name}: a sync thread failed: "
                              f"{type(error).__name__}: {error}")
        self.transport.fail(error)
        raise error

    def before_update(self, solver, it, loss):
        """The loss's verdict; then, where the per-layer wait is off, the BSP barrier: every
        layer's sync of this iteration done."""
        if not math.isfinite(loss):
            self._drain()
            which = "this worker's loss" if self.relaxed else "the loss (mean over the workers)"
            raise DistError(f"{self.session.name}: iteration {it}: {which} is {loss:g}; "
                            f"{self.verdicts.stop_line()}")
        faults.point("barrier", it)
        if not self.layer_wait:
            self._settle()

    def end_step(self, solver):
        self._settle()          # the caller of step() reads the parameters next

    def _settle(self):
        """Wait for every sync still in flight, then record their iteration: last_sync, the
        timeline's sync events and the --stats line. barrier_wait_s: this last wait;
        exposed_sync_s: every wait on that iteration's syncs (the per-layer ones of the next
        forward too) and the sync run on the training thread."""
        settled = self.wfbp.wait_all()
        if settled is None:
            return
        it, stats, barrier_s, exposed_s = settled
        self.last_sync = {"iter": it, "barrier_wait_s": barrier_s, "exposed_sync_s": exposed_s}
        self.record.settled(it, stats, barrier_s, exposed_s,
                            self._cost_fields if self.costs.active else None,
                            self._consistency_notes(stats))
        self.costs.after_iteration(it, stats)

    def _cost_fields(self, st):
        """The measured model's predicted and observed seconds of a layer's sync (--stats)."""
        return {"predicted_s": self.costs.predicted_seconds(st.layer, st.scheme),
                "observed_s": self.costs.observed.get(st.layer)}

    def _consistency_notes(self, stats):
        """Under relaxed consistency, what the servers noted on their replies: the fewest
        gradients any pair averaged (--straggler-timeout) or the most iterations this worker ran
        ahead of the slowest (--staleness)."""
        notes = [a for st in stats for a in st.reply_aux]
        if notes and self.options.straggler_timeout is not None:
            return {"averaged": min(notes)}
        if notes and self.relaxed:
            return {"lead": max(notes)}
        return None

    # ----- testing ----------------------------------------------------------------------------------
    def _average_statistics(self):
        """Mean over workers of the stored statistics (BatchNorm) of the train net."""
        if self.roles.workers == 1:
            return
        blobs = [b for layer in self.net.layers if layer.stores_statistics
                 for b in layer.blobs]
        if not blobs:
            return
        flat = numpy.concatenate([backend.to_numpy(b.data).astype(numpy.float64).reshape(-1)
                                  for b in blobs])
        mean = self.client.allreduce("statistics", flat, timeout=self._slow)
        off = 0
        for b in blobs:
            n = b.count
            b.data[...] = backend.to_xp(mean[off:off + n].reshape(b.data.shape).astype(b.dtype),
                                        backend.get_array_module(b.data))
            off += n

    def before_test(self, solver, index):
        self._settle()                            # the test nets read the parameters
        self.begin(solver)
        self._average_statistics()

    def test_batches(self, solver, index, batches):
        """Each worker runs ceil(test_iter / P1) batches of its test shard."""
        return max(1, math.ceil(batches / self.roles.workers))

    def reduce_test(self, solver, index, means):
        faults.point("test", solver.iter)
        return self.client.allreduce(f"test-{index}", means, timeout=self._slow)

    # ----- snapshots --------------------------------------------------------------------------------
    def snapshot(self, solver, write):
        self._settle()
        return self.snapshots.snapshot(solver, write)

    def snapshot_files(self, solver, state_file):
        return self.snapshots.snapshot_files(solver, state_file)

    def restore(self, solver, path, read):
        self._settle()
        self.snapshots.restore(solver, path, read)
        self._started = False                     # the replicas start again from the snapshot

    @property
    def last_snapshot(self):
        return self.verdicts.last_snapshot

    # ----- the end ----------------------------------------------------------------------------------
    def end(self, solver):
        self.finish()

    def finish(self):
        """Gather the timeline, stop the servers (worker 0), leave the job. Call once at the end."""
        if self._finished:
            return
        self._finished = True
        self._settle()
        opts = self.options
        if opts.timeline:
            items = self.client.gather("timeline", {"rank": self.rank,
                                                    "events": self.timeline.events()},
                                       timeout=self._slow)
            if self.rank == 0:
                write_trace(opts.timeline, [(it["rank"], it["events"]) for it in items])
                log.info(f"Timeline of {len(items)} workers written to {opts.timeline}")
        self.client.barrier("end", timeout=self._slow)
        if self.rank == 0:
            self.kv.shutdown()
        self.record.close()
        self.pool.shutdown(wait=True)
        self.session.close()


class DistributedSolver:
    """An engine Solver with a worker's hooks plugged in: solve(), step(n), then finish().

    solver: a Solver built with get_solver(path, **session.solver_kwargs()), or a solver path."""

    def __init__(self, solver, session=None):
        from poseidon.engine.solvers import Solver, get_solver
        session = session or current()
        if session is None:
            raise DistError("call dist.init() (or pass session=) before DistributedSolver")
        if not session.is_worker:
            raise DistError(f"{session.name} is a server: DistributedSolver runs on workers only")
        if not isinstance(solver, Solver):
            solver = get_solver(solver, **session.solver_kwargs())
        make_current(session)                  # Python layers can look up their rank
        self.solver = solver
        self.hooks = WorkerHooks(solver, session)
        solver.set_hooks(self.hooks)

    def solve(self, resume_file=None):
        """Train to max_iter as the engine's Solver.solve does, then leave the job."""
        self.solver.solve(resume_file)

    def step(self, iters):
        return self.solver.step(iters)

    def finish(self):
        self.hooks.finish()

    # what callers read of the worker (the solver's own state is on .solver)
    @property
    def last_sync(self):
        return self.hooks.last_sync

    @property
    def iter(self):
        return self.solver.iter

    @property
    def rank(self):
        return self.hooks.rank

    @property
    def session(self):
        return self.hooks.session

    @property
    def transport(self):
        return self.hooks.transport

    @property
    def net(self):
        return self.solver.net

    @property
    def book(self):
        return self.hooks.book

    @property
    def syncers(self):
        return self.hooks.syncers

    @property
    def placed(self):
        return self.hooks.placed

    @property
    def last_snapshot(self):
        return self.hooks.last_snapshot
