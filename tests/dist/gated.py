"""A job whose roles are threads of this process (as helpers.run_threads) but whose workers train in
chunks and call gate(chunk, sessions) before each, so a test can interleave an attack with training at known
points without timing assumptions; the sessions are kept for their transports and addresses."""
import threading

import numpy

from .helpers import params_of


def run_gated(param, workers, servers, chunks, gate=None, keys=None, weights=None, timeout=30,
              **options):
    """Train param.max_iter iterations in `chunks` equal steps, worker 0 starting from `weights`
    (a .caffemodel; the fillers' random draws of threads are not reproducible). Returns (worker 0's parameters,
    {rank: Session}); raises the first error of any role."""
    from poseidon.dist.job.options import DistOptions
    from poseidon.dist.job.process import run_role
    from poseidon.dist.job.session import Session
    from poseidon.dist.transport import free_port
    from poseidon.dist.worker.hooks import DistributedSolver
    from poseidon.engine.solvers import get_solver
    assert param.max_iter % chunks == 0
    opts = dict(workers=workers, servers=servers, coordinator=f"tcp://127.0.0.1:{free_port()}",
                local=True, timeout=timeout, dtype="float64", start_timeout=timeout, keys=keys)
    opts.update(options)
    sessions, results, errors = {}, {}, {}

    def worker(rank):
        try:
            session = Session(DistOptions(**opts), rank)
            sessions[rank] = session
            solver = get_solver(param, **session.solver_kwargs())
            if weights and rank == 0:
                solver.net.copy_from(weights)
            ds = DistributedSolver(solver, session)
            for c in range(chunks):
                if gate is not None:
                    gate(c, sessions)
                ds.step(param.max_iter // chunks)
            ds.finish()
            results[rank] = params_of(ds.solver)
            ds.solver.net.shutdown()
        except BaseException as e:       # re-raised below
            errors[rank] = e

    def server(rank):
        try:
            run_role({"solver": param, "options": opts}, rank, in_thread=True,
                     on_session=lambda s: sessions.__setitem__(rank, s))
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=worker if r < workers else server, args=(r,),
                                name=f"role-{r}", daemon=True) for r in range(workers + servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    if errors:
        raise errors[min(errors)]
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"roles still running: {alive}"
    for got in results.values():                    # replicas agree bitwise
        for a, b in zip(got, results[0]):
            numpy.testing.assert_array_equal(a, b)
    return results[0], sessions


class FuzzRun:
    """A fuzzer thread paced against a gated job (run_gated): started at chunk 1, it must have sent
    (chunk / (chunks - 2)) of its frames before chunk `chunk` runs, and the last chunk runs once
    every frame has been dropped somewhere. `send(i)` sends frame i; `dropped()` counts drops."""

    def __init__(self, frames, chunks, send, dropped):
        import threading
        self.frames, self.chunks = frames, chunks
        self._send, self.dropped = send, dropped
        self.sent = 0
        self.errors = []
        self.progress = threading.Condition()

    def _run(self, before, after):
        try:
            before()
            for i in range(self.frames):
                self._send(i)
                with self.progress:
                    self.sent = i + 1
                    self.progress.notify_all()
            after()
        except BaseException as e:     # reported by the gate and the test
            self.errors.append(e)
            with self.progress:
                self.progress.notify_all()

    def pace(self, chunk, start, before=lambda: None, after=lambda: None):
        """Call from the gate of worker 0: `start()` at chunk 1, then the thread, then the waits."""
        import threading
        import time
        if chunk == 1:          # the job is running: start the fuzzer
            start()
            threading.Thread(target=self._run, args=(before, after), daemon=True).start()
        if chunk >= 1:          # let it get (chunk / (chunks - 2)) of the way before going on
            need = min(self.frames, self.frames * chunk // (self.chunks - 2))
            with self.progress:
                self.progress.wait_for(lambda: self.sent >= need or self.errors, timeout=120)
        if chunk == self.chunks - 1:   # the last chunk runs once every frame has been dropped
            deadline = time.monotonic() + 60
            while (self.dropped() < self.frames and time.monotonic() < deadline
                   and not self.errors):
                time.sleep(0.05)


    def train(self, param, workers, servers, start, before, after, **job):
        """run_gated with this fuzzer paced in worker 0's gate; `start(sessions)` runs at chunk 1
        before the fuzzer thread. Returns (worker 0's parameters, sessions, seconds) once the
        fuzzer sent every frame without an error."""
        import threading
        import time

        def gate(chunk, sessions):
            if threading.current_thread().name == "role-0":
                self.pace(chunk, lambda: start(sessions), before=before, after=after)

        t0 = time.monotonic()
        got, sessions = run_gated(param, workers, servers, self.chunks, gate=gate, **job)
        elapsed = time.monotonic() - t0
        assert not self.errors, self.errors
        assert self.sent == self.frames
        return got, sessions, elapsed


def member_sockets(ctx, keys, sessions, targets):
    """PUSH sockets holding the job's keys (a member), one per {name: rank} of `targets`."""
    import zmq
    from poseidon.dist.job import security
    socks = {}
    for name, rank in targets.items():
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        security.secure_client(s, keys)
        s.connect(sessions[rank].transport.address)
        socks[name] = s
    return socks
