"""The worker: Algorithm 2 (wait-free backpropagation + BSP) inside the engine's own Solver loop.

    session = dist.init()                                        # rank, coordinator, servers
    solver = dist.DistributedSolver(get_solver(path, **session.solver_kwargs()))
    solver.solve()                                               # or solver.step(n) ... finish()

Why it wraps instead of copying: the engine's Solver.step() already does Caffe's loop (tests,
display, smoothed loss, snapshots, early exit). DistributedSolver replaces only its seams on that
solver instance:
- forward_backward: Forward, then for l = L-1..0 BackwardThrough(l) and, right after, the sync of
  layer l goes to a persistent thread pool (WFBP; `--no-overlap` submits all syncs after the whole
  backward), except the last to start, which this thread runs itself (nothing is left to overlap
  with it). The loss is averaged over workers through the coordinator while backward runs.
- apply_update: the BSP barrier: wait until every sync of this iteration is done (the syncs have
  already written the new parameters: by the server for PS layers, locally for SFB layers).
- test: every worker runs its share of test_iter on its shard of the test data; outputs averaged.
- snapshot / restore: one Caffe snapshot by worker 0 (solver history fetched from the servers for
  PS parameters), one cursor file per worker; restore sends worker 0's state to servers and peers.
BatchNorm's stored statistics are averaged over the workers before testing and snapshotting.
- clear_param_diffs: every diff but the weights that SFB rebuilds from factors (never stored), which
  are zeroed once after they may have been written, not every iteration.
- check_finite and the syncs: the loss is checked once, and each synced layer's gradient (or its
  sufficient factors) with one reduction before it is sent, so NaN/Inf never leaves a worker; the
  job stops naming the iteration, the worker, the first bad layer in backward order and the last
  good snapshot.
- --straggler-timeout / --staleness (dist/consistency.py does the servers' side): every layer goes
  by PS, and the displayed loss is worker 0's own (a mean over workers would wait for the slowest).
"""
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import numpy

from poseidon.engine import backend, rng
from poseidon.engine.errors import ModelError

from . import faults
from .book import describe_net, relaxed_consistency
from .errors import DistError
from .session import current, make_current
from .syncer import StreamPool, Syncer, record_event
from .timeline import Timeline, role_path, write_trace
from .transport import Msg, onehost

log = logging.getLogger("poseidon")

_NET_FIELDS = ("net", "net_param", "train_net", "train_net_param", "test_net", "test_net_param",
               "weights", "snapshot_prefix", "device_id", "solver_mode")


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


def _start_sync_thread(device, idle):
    """Pool threads start on CUDA device 0: make them use the worker's device; and lower them
    under --comm-priority idle (dist/priority.py)."""
    if device is not None:
        import cupy
        cupy.cuda.Device(device).use()
    if idle:
        from .priority import idle_this_thread
        idle_this_thread()


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


def _g(x):
    return f"{float(x):.6g}"


class NonFiniteGradient(DistError):
    """A synced layer's gradient holds NaN or Inf (raised by its sync before anything is sent)."""


def worker_cursor_path(state_path, rank):
    """<prefix>_iter_N.solverstate -> <prefix>_iter_N.cursors.worker-R.json."""
    from poseidon.engine.io.manifest import snapshot_base
    return f"{snapshot_base(state_path)}.cursors.worker-{rank}.json"


class DistributedSolver:
    """An engine Solver made distributed; see the module docstring. Attribute access falls through
    to the wrapped solver (iter, net, test_nets, param, ...)."""

    def __init__(self, solver, session=None):
        from poseidon.engine.solvers import Solver, get_solver
        session = session or current()
        if session is None:
            raise DistError("call dist.init() (or pass session=) before DistributedSolver")
        if not session.is_worker:
            raise DistError(f"{session.name} is a server: DistributedSolver runs on workers only")
        if not isinstance(solver, Solver):
            solver = get_solver(solver, **session.solver_kwargs())
        self.__dict__["solver"] = solver
        self.session = session
        make_current(session)                  # Python layers can look up their rank
        self.options = opts = session.options
        self.rank, self.roles = session.rank, session.roles
        self.transport, self.client = session.transport, session.client
        if tuple(solver.shard) != session.shard():
            raise DistError(f"{session.name}: the solver's train net reads data shard "
                            f"{tuple(solver.shard)}, not {session.shard()}: build it with "
                            f"get_solver(path, **session.solver_kwargs())")
        if solver.param.clip_gradients >= 0:
            raise ModelError("clip_gradients is not supported in distributed training yet (it "
                             "needs the global gradient norm over every KV pair and every SFB "
                             "layer before any update); remove it from the solver file or train "
                             "on one process")
        self.net = solver.net
        self.rule = solver.rule
        self.history = solver.history
        description = describe_net(solver.net, solver.param.iter_size)
        self.book = session.register({"role": "worker", "description": description,
                                      "solver": solver_text(solver.param)})
        self.grad_scale = self.book.data["grad_scale"]
        self.relaxed = relaxed_consistency(self.book.options)
        # one worker: the mean loss is its own, and the coordinator shares this process (it runs
        # beside worker 0), so a requested snapshot or stop is read from it directly. The loss's
        # round trip through the coordinator's thread cost 0.15 ms of this thread's time after
        # the forward, and its thread's Python then competed for the GIL with the first layers'
        # backward (about 0.1 ms more; cifar10_quick, part c)
        self._solo = self.roles.workers == 1 and session.coordinator is not None
        self.last_snapshot = None
        self._checks = {}                       # layer -> what is not finite (None: all good)
        self._checks_it = None
        self._checks_cond = threading.Condition()
        self._zero_diffs = set()                # parameters whose diff is known to hold zeros
        self.placed = set()                     # parameters kept in a server's shared memory
        self.syncers = {li: Syncer(self, li) for li in self.book.synced_layers()}
        # the sync that starts after the last backward has nothing left to overlap with: the main
        # thread runs it itself rather than wake a pool thread and then wait to be woken by it
        # (only if no layer below it has a backward to run, as under force_backward)
        need = self.net.layer_need_backward
        lowest = min((li for li in self.syncers if need[li]), default=None)
        self._inline_layer = lowest if lowest is not None and not any(need[:lowest]) else None
        if self._inline_layer is not None:
            self.syncers[self._inline_layer].spin = spin_seconds(self.book, self.roles)
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.syncers)),
                                       thread_name_prefix="sync",
                                       initializer=_start_sync_thread,
                                       initargs=(_current_device(self.net.xp),
                                                 opts.comm_priority == "idle"))
        # --comm-priority idle: the threads the session has started so far, and once more after
        # the first iteration for those made on first use (pyzmq's zero-copy collector and its
        # context's I/O thread)
        self._lower_comm = 2 if opts.comm_priority == "idle" else 0
        self._lower_comm_threads()
        self.streams = StreamPool(len(self.syncers))
        self.timeline = Timeline(self.rank, enabled=bool(opts.timeline))
        self._stats = (open(role_path(opts.stats, "worker", self.rank), "w", encoding="utf-8")
                       if opts.stats else None)
        # the last iteration's barrier wait and exposed sync (seconds), kept without --stats for
        # callers in this process (the bench's part c: a --stats line costs 0.1 ms an iteration)
        self.last_sync = None
        self._pending = []
        self._started = False
        self._finished = False
        self._iter_info = {}
        self._get_seq = 0
        self._slow = max(opts.timeout * 10, opts.start_timeout)
        self._engine = {name: getattr(solver, name) for name in
                        ("step", "snapshot", "restore", "write_manifest")}
        self._peer_cursors = None
        solver.clear_param_diffs = self._clear_param_diffs
        solver.forward_backward = self._forward_backward
        solver.check_finite = self._check_finite
        solver.apply_update = self._apply_update
        solver.test = self._test
        solver.snapshot = self._snapshot
        solver.restore = self._restore
        solver.write_manifest = self._write_manifest
        solver.step = self._step
        if self.rank == 0:
            log.info(f"Distributed: {self.roles.workers} workers x batch "
                     f"{self._batch_size()} , {self.roles.servers} servers, --sync "
                     f"{opts.sync}{', no overlap' if opts.no_overlap else ''}")
            for line in self.book.summary_lines():
                log.info(line)
            if opts.straggler_timeout is not None:
                log.info(f"BSP with drop: a worker later than {opts.straggler_timeout:g} s after "
                         f"a KV pair's first push is left out of that iteration's average")
            elif opts.staleness:
                log.info(f"Bounded staleness (SSP): a worker may run {opts.staleness} "
                         f"iteration(s) ahead of the slowest")

    def __getattr__(self, name):
        solver = self.__dict__.get("solver")
        if solver is None:
            raise AttributeError(name)
        return getattr(solver, name)

    def _batch_size(self):
        for layer in self.net.layers:
            if hasattr(layer, "batch_size"):
                return layer.batch_size
        return "?"

    def server_rank(self, index):
        return self.roles.server_rank(index)

    # ----- the public loop -------------------------------------------------------------------------
    def solve(self, resume_file=None):
        """Train to max_iter as the engine's Solver.solve does, then finish the job."""
        self.solver.solve(resume_file)
        self.finish()

    def step(self, iters):
        return self._step(iters)

    def _step(self, iters):
        self._ensure_started()
        return self._engine["step"](iters)

    # ----- start: every replica from worker 0's state ----------------------------------------------
    def _ensure_started(self):
        if self._started:
            return
        self._started = True
        if self.rank == 0:
            self._init_servers()
            faults.point("init", self.solver.iter)
            self._send_state()
        else:
            faults.point("init", self.solver.iter)
            self._receive_state()
        self.client.barrier("start", timeout=self._slow)
        self._place_in_kv_memory()

    def _place_in_kv_memory(self):
        """Put each PS parameter whose KV pairs all sit, back to back, in the shared memory of
        one server of this host (dist/transport/onehost/kvshm.py) there: its values in the
        server's values, its gradient in this worker's region. The backward then writes the
        gradient where the server reads it and the server updates the values the forward reads; a
        sync moves headers only.

        After the start barrier the server's values are this worker's (worker 0 initialised
        them, the others took worker 0's), so nothing is copied but the gradient. CPU nets only
        (a GPU's parameters live on the device), and not a Python layer's parameters (user code
        may hold on to the arrays); blobs that shared the storage (weight sharing, the test
        nets) are pointed at it too."""
        if self.net.xp is not numpy:
            return
        for pid, blob in enumerate(self.net.learnable_params):
            if pid in self.placed:
                continue
            spot = self._kv_spot(pid)
            if spot is None:
                continue
            values, grads = spot
            numpy.copyto(grads, blob.diff.reshape(-1))
            sharers = [b for net in [self.net] + list(self.solver.test_nets)
                       for layer in net.layers for b in layer.blobs
                       if b is not blob and b.shares_storage_with(blob)]
            blob.place(values, grads)
            for b in sharers:
                b.follow(blob)
            self.placed.add(pid)
        if self.placed and self.rank == 0:
            params = self.net.learnable_params
            mb = sum(params[pid].count * params[pid].dtype.itemsize for pid in self.placed) / 1e6
            log.info(f"{len(self.placed)} of {len(params)} parameters ({mb:.2f} MB) live in the "
                     f"KV servers' shared memory: their syncs move headers only")

    def _kv_spot(self, pid):
        """(values, gradient) views of parameter pid in a server's shared memory, or None."""
        p = self.book.params[pid]
        if p.get("scheme") != "ps":              # the book's BestScheme, fixed for the job
            return None
        owner = self.net.layers[p["owner"][0]]
        if getattr(owner, "type", None) == "Python":
            return None          # user code may keep the blob's arrays: their storage stays
        pairs = sorted(self.book.pairs_of_param(pid), key=lambda rec: rec["offset"])
        if not pairs or len({rec["server"] for rec in pairs}) != 1:
            return None
        segment = self.transport.kv_segment(self.server_rank(pairs[0]["server"]))
        if segment is None:
            return None
        slots = [segment.layout.slots[rec["id"]] for rec in pairs]
        start = slots[0][0]
        if any(off != start + rec["offset"] for (off, _), rec in zip(slots, pairs)):
            return None                          # not back to back
        count = self.net.learnable_params[pid].count
        if sum(n for _, n in slots) != count:
            return None
        region = segment.layout.region
        grads_at = (1 + self.rank) * region + start
        return (segment.array[start:start + count],
                segment.array[grads_at:grads_at + count])

    def _host(self, array):
        return numpy.ascontiguousarray(backend.to_numpy(array)).reshape(-1)

    def _init_servers(self):
        s, t = self.solver, self.transport
        it = s.iter
        cache = {}
        for pair in self.book.pairs:
            pid = pair["param"]
            if pid not in cache:
                cache[pid] = ([self._host(self.net.learnable_params[pid].data)] +
                              [self._host(h) for h in self.history[pid]])
            off, n = pair["offset"], pair["length"]
            t.send(self.server_rank(pair["server"]), Msg.KV_INIT, iteration=it, key=pair["id"],
                   arrays=[a[off:off + n] for a in cache[pid]])
        servers = self.roles.server_ranks()
        for r in servers:
            t.send(r, Msg.KV_INIT_DONE, iteration=it)
        for index, r in enumerate(servers):
            t.receive(Msg.KV_INIT_ACK, index, it, timeout=self._slow, senders=[r],
                      what="the acknowledgement of the parameter initialisation")

    def _send_state(self):
        s, t = self.solver, self.transport
        receipts = []
        for peer in self.roles.worker_ranks()[1:]:
            for pid, blob in enumerate(self.net.learnable_params):
                arrays = [self._host(blob.data)]
                if self.book.params[pid]["scheme"] == "sfb":
                    arrays += [self._host(h) for h in self.history[pid]]
                receipts.append(t.send(peer, Msg.WEIGHTS, iteration=0, key=pid, aux=s.iter,
                                       arrays=arrays))
        for r in receipts:
            r.wait()

    def _receive_state(self):
        s, t = self.solver, self.transport
        for pid, blob in enumerate(self.net.learnable_params):
            msg = t.receive(Msg.WEIGHTS, pid, 0, timeout=self._slow, senders=[0],
                            what=f"worker 0's initial value of parameter "
                                 f"'{self.net.learnable_param_specs[pid].name}'")[0]
            if msg.aux != s.iter:
                raise DistError(f"{self.session.name} starts at iteration {s.iter} but worker 0 "
                                f"at iteration {msg.aux}: resume every worker from the same "
                                f"snapshot (each worker needs its own cursor file)")
            xp = backend.get_array_module(blob.data)
            blob.data[...] = backend.to_xp(msg.arrays[0].reshape(blob.data.shape), xp)
            for h, value in zip(self.history[pid], msg.arrays[1:]):
                h[...] = backend.to_xp(value.reshape(h.shape), xp)

    # ----- Algorithm 2 ------------------------------------------------------------------------------
    def _clear_param_diffs(self):
        """ClearParamDiffs, less the diffs this iteration's backward leaves alone: a weight synced
        by SFB never gets its gradient stored (the rebuild makes it block by block from the
        factors), so its diff is zeroed only when it may hold something (the first iteration, or
        an earlier one whose scheme for the layer was PS), not every iteration (fc_heavy: 234 MB
        of writes per worker per iteration). Decided per layer and per iteration, from the same
        plan that the layer's backward and sync then follow (Syncer.prepare)."""
        it = self.solver.iter
        unwritten = set()
        for syncer in self.syncers.values():
            unwritten.update(syncer.prepare(it))
        to_clear = []
        for pid, blob in enumerate(self.net.learnable_params):
            if pid in unwritten:
                if pid in self._zero_diffs:
                    continue
                self._zero_diffs.add(pid)
            else:
                self._zero_diffs.discard(pid)       # the backward writes it
            to_clear.append(blob)
        self.net.clear_diffs(to_clear)

    def _forward_backward(self):
        s, net, tl = self.solver, self.net, self.timeline
        it = s.iter
        n = s.param.iter_size
        overlap = not self.options.no_overlap
        with self._checks_cond:
            self._checks, self._checks_it = {}, it
        futures = []
        total = 0.0
        t_start = time.time()
        backward_s = 0.0
        backward_end = t_start
        wait_loss = None
        for syncer in self.syncers.values():      # this iteration's schemes (SFB: no local dW)
            syncer.prepare(it)                    # (already fixed by _clear_param_diffs in step)
        for p in range(n):
            last = p == n - 1
            t0 = time.time()
            total += net.Forward()
            faults.point("forward", it)
            t1 = backward_end = time.time()
            tl.event("forward", "forward", t0, t1, thread="compute", args={"iter": it})
            if last and (self.relaxed or self._solo):  # relaxed: no collective, it would wait
                own = total / n
                wait_loss = lambda: [own]  # noqa: E731
            elif last:
                wait_loss = self.client.allreduce_async("loss", [total / n])
            for li in range(len(net.layers) - 1, -1, -1):
                if net.layer_need_backward[li]:
                    b0 = time.time()
                    net.BackwardThrough(li)
                    b1 = backward_end = time.time()
                    backward_s += b1 - b0
                    tl.event(f"backward {net.layer_names[li]}", "backward", b0, b1,
                             thread="compute", args={"iter": it, "layer": li})
                for hook in net.after_backward:
                    hook(li)
                if last and overlap and li in self.syncers:
                    futures.append(self._start_sync(li, it))                        # WFBP
                    faults.point("backward", it)
        if not overlap:
            for li in sorted(self.syncers, reverse=True):
                futures.append(self._start_sync(li, it))
        self._pending = futures
        self._iter_info = {"forward_backward_s": backward_end - t_start,  # not the last sync
                           "backward_s": backward_s, "backward_end": backward_end}
        try:
            loss = float(wait_loss()[0])
        except DistError:
            self._drain()
            raise
        action = self.client.take_action()         # a signal: every worker at this iteration
        if self._solo and action is None:
            action = self.session.coordinator.take_request()
        if action:
            s.request(action)
        self._iter_info["loss"] = loss
        return loss

    def _start_sync(self, li, it):
        """Layer li's sync of iteration it, on the pool, or done here if it is the last to start
        (its Future either way, for the barrier)."""
        ready = record_event(self.net.xp)
        if li != self._inline_layer:
            return self.pool.submit(self.syncers[li].sync, it, ready)
        done = Future()
        try:
            done.set_result(self.syncers[li].sync(it, ready))
        except Exception as e:                  # the barrier reports it, as for the pool's
            done.set_exception(e)
        return done

    # ----- numerical faults ---------------------------------------------------------------------------
    def _stop_line(self):
        return f"stopping (last good snapshot: {self.last_snapshot or 'none written yet'})"

    def nonfinite_error(self, it, layer_name, what):
        return NonFiniteGradient(f"{self.session.name}: iteration {it}: layer '{layer_name}' "
                                 f"{what} has NaN/Inf; {self._stop_line()}")

    def checked(self, it, li, bad):
        """A sync's finiteness verdict (called on its thread before it sends anything)."""
        with self._checks_cond:
            if self._checks_it == it:
                self._checks[li] = bad
                self._checks_cond.notify_all()

    def _first_nonfinite(self, it, wait_s=5.0):
        """After a sync failed: the NonFiniteGradient of the highest bad layer (the first in
        backward order), once every sync of the iteration has given its verdict; else None."""
        with self._checks_cond:
            if not any(self._checks.values()):
                return None
            self._checks_cond.wait_for(lambda: len(self._checks) >= len(self.syncers), wait_s)
            bad = {li: what for li, what in self._checks.items() if what}
        li = max(bad, key=lambda i: max(self.syncers[i].members))   # a bucket: its top layer
        return self.nonfinite_error(it, self.syncers[li].name, bad[li])

    def _check_finite(self, loss):
        """The engine's check, made cheap: the loss here; each synced layer's gradient is checked
        by its sync with one reduction before it is sent (Syncer.sync)."""
        if not math.isfinite(loss):
            which = "this worker's loss" if self.relaxed else "the loss (mean over the workers)"
            raise DistError(f"{self.session.name}: iteration {self.solver.iter}: {which} is "
                            f"{loss:g}; {self._stop_line()}")

    def _drain(self):
        """After a failure: wake the sync threads so the pool is not left blocked."""
        for f in self._pending:
            f.cancel()

    def _lower_comm_threads(self):
        if self._lower_comm:
            from .priority import compute_threads, idle_threads
            idle_threads(keep=compute_threads())
            self._lower_comm -= 1

    def _apply_update(self):
        """The BSP barrier: every layer's sync of this iteration must be done."""
        s = self.solver
        p = s.param
        it = s.iter
        if p.display and it % p.display == 0:
            log.info(f"Iteration {it}, lr = {_g(self.rule.rate(it))}")
        t0 = time.time()
        faults.point("barrier", it)
        done, _ = wait(self._pending, timeout=None, return_when=FIRST_EXCEPTION)
        errors = [f.exception() for f in self._pending if f in done and f.exception() is not None]
        if errors:
            error = self._first_nonfinite(it) or errors[0]
            if not isinstance(error, DistError):
                error = DistError(f"{self.session.name}: a sync thread failed: "
                                  f"{type(error).__name__}: {error}")
            self.transport.fail(error)
            raise error
        stats = [f.result() for f in self._pending]
        self._pending = []
        t1 = time.time()
        barrier_s = t1 - t0
        exposed_s = t1 - self._iter_info.get("backward_end", t0)
        self.last_sync = {"iter": it, "barrier_wait_s": barrier_s, "exposed_sync_s": exposed_s}
        self._lower_comm_threads()                  # outside the barrier's time
        for st in stats:
            self.timeline.event(f"sync {st.name}", f"sync {st.scheme}", st.start, st.end,
                                thread=st.thread,
                                args={"iter": it, "scheme": st.scheme, "layer": st.layer,
                                      "sent_payload": st.sent_payload,
                                      "recv_payload": st.recv_payload})
        if self._stats is not None:
            layers = {st.name: st.as_dict() for st in sorted(stats, key=lambda x: -x.layer)}
            record = {"iter": it, "role": "worker", "rank": self.rank, "time": time.time(),
                      "loss": self._iter_info.get("loss"),
                      "forward_backward_s": round(self._iter_info.get("forward_backward_s", 0), 6),
                      "backward_s": round(self._iter_info.get("backward_s", 0), 6),
                      "barrier_wait_s": round(barrier_s, 6),
                      "exposed_sync_s": round(exposed_s, 6), "layers": layers}
            for key in ("sent_payload", "recv_payload", "sent_header", "recv_header"):
                record[key] = sum(v[key] for v in layers.values())
            notes = [a for st in stats for a in st.reply_aux]
            if notes and self.options.straggler_timeout is not None:
                record["averaged"] = min(notes)        # fewest gradients in any pair's update
            elif notes and self.relaxed:
                record["lead"] = max(notes)            # iterations ahead of the slowest worker
            self._stats.write(json.dumps(record) + "\n")
            self._stats.flush()

    # ----- testing ----------------------------------------------------------------------------------
    def _average_statistics(self):
        """Mean over workers of the stored statistics (BatchNorm) of the train net."""
        if self.roles.workers == 1:
            return
        blobs = [b for layer in self.net.layers if getattr(layer, "stores_statistics", False)
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

    def _test(self, i):
        """Each worker runs ceil(test_iter / P1) batches of its test shard; outputs averaged."""
        s = self.solver
        self._ensure_started()
        p = s.param
        net = s.test_nets[i]
        self._average_statistics()
        n = max(1, math.ceil(p.test_iter[i] / self.roles.workers))
        log.info(f"Iteration {s.iter}, Testing net (#{i})")
        sums, loss = None, 0.0
        for _ in range(n):
            iter_loss = net.Forward()
            if p.test_compute_loss:
                loss += iter_loss
            values = [backend.to_numpy(net.blobs[name].data).astype(numpy.float64).reshape(-1)
                      for name in net.output_names]
            if sums is None:
                sums = values
            else:
                for acc, v in zip(sums, values):
                    acc += v
        local = numpy.concatenate([[loss]] + (sums or [])) / n
        faults.point("test", s.iter)
        mean = self.client.allreduce(f"test-{i}", local, timeout=self._slow)
        if p.test_compute_loss:
            log.info(f"Test loss: {_g(mean[0])}")
        results = {}
        off, k = 1, 0
        for name, acc in zip(net.output_names, sums or []):
            values = mean[off:off + acc.size]
            off += acc.size
            weight = net.blob_loss_weights.get(name, 0)
            for value in values:
                suffix = f" (* {_g(weight)} = {_g(weight * value)} loss)" if weight else ""
                log.info(f"    Test net output #{k}: {name} = {_g(value)}{suffix}")
                k += 1
            shape = net.blobs[name].data.shape
            results[name] = float(values[0]) if values.size == 1 else values.reshape(shape)
        return results

    # ----- snapshots --------------------------------------------------------------------------------
    def _fetch_server_state(self):
        """Worker 0: values and history of every PS parameter from the servers, into history.
        Under --staleness the values too: worker 0's own may miss up to s iterations of the
        others' updates, and the snapshot must hold the servers' parameters with their history."""
        t = self.transport
        seq = self._get_seq
        self._get_seq += 1
        for pair in self.book.pairs:
            t.send(self.server_rank(pair["server"]), Msg.KV_GET, iteration=seq, key=pair["id"])
        hosts = {}
        for pair in self.book.pairs:
            pid = pair["param"]
            msg = t.receive(Msg.KV_GET_REPLY, pair["id"], seq, timeout=self._slow,
                            senders=[self.server_rank(pair["server"])],
                            what=f"the solver state of KV pair {pair['id']} for the snapshot")[0]
            if pid not in hosts:
                count = self.net.learnable_params[pid].count
                hosts[pid] = [numpy.empty(count, self.net.dtype)
                              for _ in range(len(self.history[pid]) + 1)]
            off, n = pair["offset"], pair["length"]
            for k, h in enumerate(hosts[pid]):
                h[off:off + n] = msg.arrays[k]
        refresh = bool(self.options.staleness)
        for pid, (value, *arrays) in hosts.items():
            for h, host in zip(self.history[pid], arrays):
                h[...] = backend.to_xp(host.reshape(h.shape), backend.get_array_module(h))
            if refresh:
                data = self.net.learnable_params[pid].data
                data[...] = backend.to_xp(value.reshape(data.shape), backend.get_array_module(data))

    def _cursor_state(self):
        s = self.solver
        return {"iter": s.iter, "rng": rng.get_state(), "train": s.net.data_cursors(),
                "test": [t.data_cursors() for t in s.test_nets], "rank": self.rank,
                "workers": self.roles.workers}

    def _snapshot(self):
        """One consistent snapshot on worker 0's disk: the engine's files (weights, solverstate
        with the servers' history, worker 0's cursors), one cursor file per other worker (sent to
        worker 0), and the engine's manifest over all of them, written last."""
        s = self.solver
        faults.point("snapshot", s.iter)
        self._average_statistics()
        cursors = self.client.gather("cursors", self._cursor_state(), timeout=self._slow)
        state_file = None
        if self.rank == 0:
            self._fetch_server_state()
            self._peer_cursors = cursors[1:]
            try:
                state_file = self._engine["snapshot"]()
            finally:
                self._peer_cursors = None
            log.info(f"Distributed snapshot at iteration {s.iter}: {state_file} (+ cursor files "
                     f"of {self.roles.workers - 1} other worker(s))")
        self.client.barrier("snapshot", timeout=self._slow)
        faults.point("snapshot-done", s.iter)
        self.last_snapshot = state_file or self._state_file_name()
        return state_file

    def _state_file_name(self):
        """The solverstate path worker 0 writes at this iteration (the engine's naming)."""
        from poseidon.engine.proto import caffe_pb2
        hdf5 = self.solver.param.snapshot_format == caffe_pb2.SolverParameter.HDF5
        return self.solver.snapshot_filename(".solverstate.h5" if hdf5 else ".solverstate")

    def _write_manifest(self, state_file, extra_files=()):
        """Worker 0, inside the engine's snapshot(): the other workers' cursor files, then the
        manifest naming them too (so a torn distributed snapshot is refused on resume)."""
        from poseidon.engine.io import caffemodel
        extra = list(extra_files)
        for cursor in self._peer_cursors or []:
            path = worker_cursor_path(state_file, cursor["rank"])
            caffemodel.write_atomic(path, json.dumps(cursor).encode("utf-8"))
            extra.append(path)
        faults.point("snapshot-files", self.solver.iter)
        return self._engine["write_manifest"](state_file, extra)

    def _restore(self, path):
        """Worker 0 restores the engine snapshot and hands every other worker its cursor file;
        the parameters and solver state follow when the run starts (_ensure_started)."""
        s, t = self.solver, self.transport
        if self.rank == 0:
            self._engine["restore"](path)
            for r in self.roles.worker_ranks()[1:]:
                cursor = worker_cursor_path(os.fspath(path), r)
                if not os.path.exists(cursor):
                    raise DistError(f"no cursor file {cursor} for worker {r} beside the snapshot "
                                    f"{path}: a distributed snapshot has one per worker; resume "
                                    f"with the worker count it was written with")
                with open(cursor, "r", encoding="utf-8") as f:
                    state = json.load(f)
                if int(state.get("workers", 0)) != self.roles.workers:
                    raise DistError(f"{path} was written by a run of {state.get('workers')} "
                                    f"workers; this one has {self.roles.workers}: resume with "
                                    f"--workers {state.get('workers')}")
                t.send(r, Msg.CURSOR, obj=state)
        else:
            state = t.receive(Msg.CURSOR, 0, 0, timeout=self._slow, senders=[0],
                              what="this worker's data cursor from worker 0's snapshot")[0].obj
            if state.get("fresh"):                 # --resume auto found no snapshot
                return
            s.iter = int(state["iter"])
            if state.get("rng") is not None:
                rng.set_state(state["rng"])
            s.net.set_data_cursors(state.get("train"))
            for net, cursors in zip(s.test_nets, state.get("test") or []):
                net.set_data_cursors(cursors)
        self.last_snapshot = os.fspath(path)
        self._started = False

    # ----- the end ----------------------------------------------------------------------------------
    def finish(self):
        """Gather the timeline, stop the servers (worker 0), leave the job. Call once at the end."""
        if self._finished:
            return
        self._finished = True
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
            for r in self.roles.server_ranks():
                self.transport.send(r, Msg.KV_SHUTDOWN)
        if self._stats is not None:
            self._stats.close()
        self.pool.shutdown(wait=True)
        self.session.close()
