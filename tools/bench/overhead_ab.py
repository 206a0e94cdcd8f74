"""Part c's measurement, in one child process: the plain engine and the distributed path (this
process as worker 0 of `--workers 1 --servers 1 --sync ps`, the KV server a process of its own)
train the same solver file side by side, in alternating blocks of iterations.

    python -m tools.bench.overhead_ab SOLVER_FILE ROUNDS BLOCK WARMUP

Why alternate inside one process: on a shared machine the load changes from second to second, and
two separate processes also differ in memory layout and start-up; blocks of a few iterations taken
turn about see the same moment, the same process and the same caches, so what differs is the
distributed path (the syncs' threads and messages, the server process, the barrier). Prints one
JSON line: per-iteration seconds of each side, block by block.
"""
import json
import subprocess
import sys
import time


def _steps(solver, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        solver.step(1)
        times.append(time.perf_counter() - t)
    return times


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    solver_path, rounds, block, warmup = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    import logging
    import dist
    from dist.transport import free_port
    from engine.solvers import get_solver
    from engine.solvers.solver import log_to_stderr
    log_to_stderr(logging.WARNING)
    address = f"tcp://127.0.0.1:{free_port()}"
    options = dict(workers=1, servers=1, coordinator=address, sync="ps")
    server = subprocess.Popen(
        [sys.executable, "-c", "import json, sys, dist; dist.init(**json.loads(sys.argv[1]))",
         json.dumps(dict(options, rank=1))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        session = dist.init(rank=0, **options)
        distributed = dist.DistributedSolver(get_solver(solver_path, **session.solver_kwargs()))
        plain = get_solver(solver_path)
        _steps(plain, warmup)
        _steps(distributed, warmup)
        blocks = {"plain": [], "distributed": []}
        for r in range(rounds):
            order = ("plain", "distributed") if r % 2 == 0 else ("distributed", "plain")
            for side in order:
                blocks[side].append(_steps(plain if side == "plain" else distributed, block))
        distributed.finish()
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    print(json.dumps(blocks))


if __name__ == "__main__":
    main()
