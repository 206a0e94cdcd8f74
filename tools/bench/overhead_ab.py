"""Part c's measurement, in one child process: the plain engine and the distributed path (this
process as worker 0 of `--workers 1 --servers 1 --sync ps`, the KV server a process of its own)
train the same solver file side by side, in alternating blocks of iterations.

    python -m poseidon.tools.bench.overhead_ab SOLVER_FILE ROUNDS BLOCK WARMUP [OPTIONS_JSON]

(OPTIONS_JSON: more distributed options for both processes, e.g. '{"ipc": "links"}'.)

Why alternate inside one process: on a shared machine the load changes from second to second, and
two separate processes also differ in memory layout and start-up; blocks of a few iterations taken
turn about see the same moment, the same process and the same caches, so what differs is the
distributed path (the syncs' threads and messages, the server process, the barrier). Prints one
JSON line: per-iteration seconds of each side, block by block; the CPU seconds per iteration of
this process for each block and of the server process for each distributed block (from /proc:
each thread's schedstat where the kernel keeps it, in nanoseconds; null where there is none);
the same per thread, summed over the blocks of each side (this
process's threads by their Python names, the server's by their OS names); and the distributed
side's exposed sync time per iteration (DistributedSolver.last_sync: the time the step waited
on its syncs, all done by the end of a step() call; the job runs without --stats, as users do by
default), so the overhead can be split into where it goes.
"""
import json
import os
import re
import subprocess
import sys
import threading
import time


def timed_steps(solver, n, exposed=None):
    """Seconds of each of n single steps of solver; with `exposed` (a list), the distributed
    solver's exposed sync of each step is appended to it (DistributedSolver.last_sync)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        solver.step(1)
        times.append(time.perf_counter() - t)
        if exposed is not None:
            exposed.append(solver.last_sync["exposed_sync_s"])
    return times


def _cpu_fields(path):
    """utime + stime of a /proc stat file, in seconds (raises OSError/ValueError/IndexError)."""
    with open(path, encoding="ascii", errors="replace") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _task_cpu(task):
    """CPU seconds so far of one thread, `task` its /proc folder: schedstat's run time, in
    nanoseconds, where the kernel keeps it; else stat's utime + stime, which count whole clock
    ticks (10 ms), too coarse for threads that run a fraction of a millisecond an iteration.
    Raises OSError/ValueError/IndexError."""
    try:
        with open(f"{task}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return _cpu_fields(f"{task}/stat")


def _thread_label(name):
    """A thread's name without its index in a pool ('sync_1' -> 'sync', 'ZMQbg/IO/0' ->
    'ZMQbg/IO'), so a pool's threads add up under one label; 'recv-0' (the receive thread of
    rank 0) and 'recv--1' (the coordinator's) stay apart."""
    return re.sub(r"[_/]\d+$", "", name) or name


def thread_cpu(pid, names=None):
    """{label: CPU seconds so far} of the threads of process pid, from /proc ({} where it cannot
    say). Labels are the Python thread names given in `names` ({native id: name}) and otherwise
    the OS's thread names (ZeroMQ names its own threads, Python's show as 'python')."""
    out = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            cpu = _task_cpu(f"{base}/{tid}")
            with open(f"{base}/{tid}/comm", encoding="ascii", errors="replace") as f:
                name = (names or {}).get(int(tid)) or f.read().strip()
        except (OSError, ValueError, IndexError, AttributeError):
            continue
        label = _thread_label(name)
        out[label] = out.get(label, 0.0) + cpu
    return out


def _own_thread_names():
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def _cpu_total(threads):
    """A process's CPU seconds from its threads' (thread_cpu: the server's live as long as it
    does), or None where /proc could not say."""
    return sum(threads.values()) if threads else None


def _process_cpu(pid):
    """CPU seconds of process pid so far, or None where /proc cannot say."""
    return _cpu_total(thread_cpu(pid))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    solver_path, rounds, block, warmup = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    extra = json.loads(argv[4]) if len(argv) > 4 else {}
    import logging
    from poseidon import dist
    from poseidon.dist.transport import free_port
    from poseidon.engine.solvers import get_solver
    from poseidon.engine.solvers import log_to_stderr
    log_to_stderr(logging.WARNING)
    address = f"tcp://127.0.0.1:{free_port()}"
    # no --stats: writing its line every iteration would be part of what is measured; the
    # exposed sync is read from the solver itself
    options = dict(workers=1, servers=1, coordinator=address, sync="ps", **extra)
    server = subprocess.Popen(
        [sys.executable, "-c", "import json, sys; from poseidon import dist; dist.init(**json.loads(sys.argv[1]))",
         json.dumps(dict(options, rank=1))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        session = dist.init(rank=0, **options)
        distributed = dist.DistributedSolver(get_solver(solver_path, **session.solver_kwargs()))
        plain = get_solver(solver_path)
        timed_steps(plain, warmup)
        timed_steps(distributed, warmup)
        blocks = {"plain": [], "distributed": []}
        cpu = {"plain": [], "distributed": []}
        server_cpu = []
        threads = {"plain": {}, "distributed": {}, "server": {}}   # label -> CPU seconds
        exposed = []
        me = os.getpid()
        for r in range(rounds):
            order = ("plain", "distributed") if r % 2 == 0 else ("distributed", "plain")
            for side in order:
                dist_side = side == "distributed"
                t0 = thread_cpu(me, _own_thread_names())
                w0 = thread_cpu(server.pid) if dist_side else {}
                c0 = time.process_time()
                blocks[side].append(timed_steps(distributed, block, exposed) if dist_side else
                                    timed_steps(plain, block))
                cpu[side].append((time.process_time() - c0) / block)
                _add_deltas(threads[side], t0, thread_cpu(me, _own_thread_names()))
                if dist_side:             # one read of the server's threads per end
                    w1 = thread_cpu(server.pid)
                    s0, s1 = _cpu_total(w0), _cpu_total(w1)
                    server_cpu.append(None if s0 is None or s1 is None else (s1 - s0) / block)
                    _add_deltas(threads["server"], w0, w1)
        distributed.finish()
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    measured = rounds * block
    per_iteration = {side: {label: seconds / measured for label, seconds in sorted(t.items())}
                     for side, t in threads.items()}
    print(json.dumps(dict(blocks, cpu=cpu, server_cpu=server_cpu, threads=per_iteration,
                          exposed_s=exposed)))


def _add_deltas(total, before, after):
    for label, seconds in after.items():
        total[label] = total.get(label, 0.0) + seconds - before.get(label, 0.0)


if __name__ == "__main__":
    main()
