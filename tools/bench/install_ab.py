"""Part a of `poseidon bench` (engine training img/s) of two installs, alternated
in one run: each side is a child process that builds its own part-a runners (its own
tools.bench.throughput.EngineRunner, same nets and batches) and trains only when the parent says,
so exactly one side computes at a time; the order swaps every round.

    python -m poseidon.tools.bench.install_ab OLD_PYTHON NEW_PYTHON [ROUNDS [SECONDS [NETS]]]

ROUNDS (default 8) rounds of one run a side, each run about SECONDS long (default 1.5), on NETS
(comma-separated, default cifar10_quick,fc_heavy,vgg_block).

OLD_PYTHON and NEW_PYTHON are the interpreters of two environments, each with one install (an
older one may have the top-level `tools` package of earlier layouts). Why children: two installs
of the package cannot share one process (their protobuf schemas register the same file name).
"""
import json
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys
try:
    from poseidon.tools.bench import nets, throughput
except ImportError:
    from tools.bench import nets, throughput
runners = {}
for line in sys.stdin:
    name, iters = line.split()
    if name not in runners:
        bn = getattr(nets, name)()
        runners[name] = (throughput.EngineRunner(bn), bn.batch)
        runners[name][0].timed(3)
    runner, batch = runners[name]
    n = int(iters)
    seconds = runner.timed(n) if n else runner.timed(1)
    print(json.dumps({"img_s": batch * max(n, 1) / seconds, "s": seconds}), flush=True)
'''


def main():
    if not 3 <= len(sys.argv) <= 6:
        sys.exit("usage: python -m poseidon.tools.bench.install_ab OLD_PYTHON NEW_PYTHON "
                 "[ROUNDS [SECONDS [NETS]]]")
    old_py, new_py = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    run_s = float(sys.argv[4]) if len(sys.argv) > 4 else 1.5
    names = sys.argv[5].split(",") if len(sys.argv) > 5 else ["cifar10_quick", "fc_heavy",
                                                               "vgg_block"]
    sides = {s: subprocess.Popen([py, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, cwd="/tmp")
             for s, py in (("old", old_py), ("new", new_py))}

    def ask(side, name, iters):
        p = sides[side]
        p.stdin.write(f"{name} {iters}\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    out = {}
    for name in names:
        step = max(ask(s, name, 0)["s"] for s in sides)       # builds, warms, one timed step
        iters = max(2, int(round(run_s / step)))
        rates, ratios = {"old": [], "new": []}, []
        for k in range(rounds):
            got = {}
            for side in (("old", "new") if k % 2 == 0 else ("new", "old")):
                got[side] = ask(side, name, iters)["img_s"]
                rates[side].append(got[side])
            ratios.append(got["new"] / got["old"])
        out[name] = {"old_img_s": round(statistics.median(rates["old"]), 1),
                     "new_img_s": round(statistics.median(rates["new"]), 1),
                     "new_over_old_median": round(statistics.median(ratios), 3),
                     "new_over_old_range": [round(min(ratios), 3), round(max(ratios), 3)],
                     "rounds": rounds, "iterations_per_run": iters}
        print(name, json.dumps(out[name]), flush=True)
    for p in sides.values():
        p.stdin.close()
        p.wait(timeout=60)


if __name__ == "__main__":
    main()
