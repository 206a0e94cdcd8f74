"""The training step with InnerProduct weights updated from their factors against the diff path.

    python -m poseidon.tools.bench.factored_ab [NET] [ROUNDS] [STEPS]     (defaults: fc_heavy 12 3)

Two solvers on the same solver file in one process take turns, `STEPS` steps each per round, so
both see the same moment of a machine whose speed drifts; the second has its factored weights
switched off (engine/solvers/factored.py). Prints the median and minimum step time of each, and
whether the parameters came out bitwise equal.
"""
import logging
import sys
import tempfile
from pathlib import Path

import numpy

from poseidon.engine.solvers import get_solver
from poseidon.engine.solvers import log_to_stderr

from . import nets
from .overhead_ab import timed_steps


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv else "fc_heavy"
    rounds = int(argv[1]) if len(argv) > 1 else 12
    steps = int(argv[2]) if len(argv) > 2 else 3
    log_to_stderr(logging.WARNING)
    net = getattr(nets, name)()
    path = nets.write_solver_files(net, Path(tempfile.mkdtemp()), 10 ** 6)
    solvers = {"from factors": get_solver(str(path)), "diff path": get_solver(str(path))}
    solvers["diff path"].factored.entries = []
    factored = [layer.name for _, _, layer in solvers["from factors"].factored.entries]
    times = {key: [] for key in solvers}
    for key, solver in solvers.items():
        timed_steps(solver, 2)                             # warm-up: buffers, caches
    for r in range(rounds):
        order = list(solvers) if r % 2 == 0 else list(solvers)[::-1]
        for key in order:
            times[key] += timed_steps(solvers[key], steps)
    print(f"{net.title}: weights from factors: {', '.join(factored) or 'none'}; "
          f"{rounds} rounds of {steps} steps")
    for key, t in times.items():
        print(f"  {key:13s} median {numpy.median(t) * 1e3:7.1f} ms, min {min(t) * 1e3:7.1f} ms")
    same = all(numpy.array_equal(a.data, b.data) for a, b in
               zip(*(s.net.learnable_params for s in solvers.values())))
    print(f"  parameters after the run: {'bitwise equal' if same else 'not bitwise equal'}")


if __name__ == "__main__":
    main()
