"""`poseidon train`: train from a solver file, on one process or on local/remote workers and servers.

    poseidon train --solver S [--weights W | --snapshot SS] [--gpu N]
    poseidon train --solver S --gpu 0,1                           # one replica per GPU (Caffe's)
    poseidon train --solver S --devices-per-node 2 --workers 2    # 2 workers x 2 CPU replicas
    poseidon train --solver S --workers 4 --servers 2            # all processes on this machine
    poseidon train --demo [--workers 2 --servers 1]                # the embedded digits demo

With --workers/--servers (or --coordinator/--rank on each host) the run is distributed: see dist/.
SIGINT and SIGHUP have Caffe's effects (--sigint_effect stop, --sighup_effect snapshot) on one
process and on a distributed job alike (there every worker acts at the same iteration).
"""
import os
from pathlib import Path

from poseidon import prototxt as shipped_prototxt
from poseidon.dist.job.options import (add_dist_options, check_devices_per_node,
                                   dist_flags_given)
from poseidon.engine import settings
from poseidon.engine.errors import PoseidonError
from poseidon.engine.solvers import final_accuracy_lines

from .common import add_gpu_option, apply_gpu, configure_engine, out, setup_logging

DEMO_SOLVER = shipped_prototxt.path("digits_quick", "solver.prototxt")


def add(sub):
    p = sub.add_parser("train", help="train a model from a solver file")
    p.add_argument("--solver", help="solver prototxt")
    p.add_argument("--demo", action="store_true",
                   help="train the built-in digits demo (makes its LMDBs under --workdir)")
    p.add_argument("--workdir", default="poseidon-demo", help="where --demo puts data and snapshots")
    p.add_argument("--weights", help="comma-separated .caffemodel files to initialise from")
    p.add_argument("--snapshot", help=".solverstate (or .h5) to resume from")
    p.add_argument("--resume", choices=("auto",),
                   help="auto: resume from the newest complete snapshot of the solver's "
                        "snapshot_prefix if there is one (re-running a crashed command); a local "
                        "distributed job is also restarted from it when a process is lost, up to "
                        "--max-restarts times")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sigint_effect", "--sigint-effect", default="stop",
                   choices=("stop", "snapshot", "none"),
                   help="on SIGINT (Ctrl-C): stop (after a final snapshot), snapshot and go on, "
                        "or ignore (Caffe's default: stop)")
    p.add_argument("--sighup_effect", "--sighup-effect", default="snapshot",
                   choices=("stop", "snapshot", "none"),
                   help="on SIGHUP: as --sigint_effect (Caffe's default: snapshot)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="float type of the nets (float64 for equivalence tests)")
    add_gpu_option(p)
    p.add_argument("--cuda-graphs", choices=("on", "off"), default=None,
                   help="with --gpu: replay the stretches of a step between GEMMs as CUDA graphs "
                        "(engine/graphs.py; POSEIDON_CUDA_GRAPHS); default off: not yet timed "
                        "on a device")
    p.add_argument("--devices-per-node", type=int, metavar="G",
                   help="run the net as G replicas (batch_size each, gradients averaged layer "
                        "by layer), one per GPU of a --gpu list (G is the list's length), or G "
                        "on one --gpu id, or G on the CPU (there, and on one id, at most the "
                        "machine's CPU cores); with --workers each worker is a node of G "
                        "replicas behind one leader (see docs/distributed.md)")
    add_dist_options(p)
    p.set_defaults(run=run)


def _prepare_demo(args):
    from poseidon.engine.io.datasets import make_digits_lmdb
    work = Path(args.workdir).resolve()
    data = work / "data" / "digits"
    if not (data / "train").exists():
        out(f"Writing the digits demo set (scikit-learn) to {data}")
        make_digits_lmdb(str(data), shards=1)
    (work / "snapshots").mkdir(parents=True, exist_ok=True)
    os.chdir(work)
    return str(DEMO_SOLVER)


def is_distributed(args):
    return bool(getattr(args, "workers", None) or getattr(args, "servers", None)
                or getattr(args, "coordinator", None))


def run(args):
    configure_engine(args, cuda_graphs=None if args.cuda_graphs is None
                     else args.cuda_graphs == "on")
    if args.demo:
        args.solver = _prepare_demo(args)
    if not args.solver:
        raise PoseidonError("give --solver SOLVER.prototxt (or --demo for the built-in example)")
    if args.weights and args.snapshot:
        raise PoseidonError("give either --weights or --snapshot, not both")
    if args.resume and args.snapshot:
        raise PoseidonError("give either --snapshot or --resume auto, not both")
    if args.devices_per_node is not None:   # G against this machine's devices, before any start
        check_devices_per_node(args.devices_per_node, args.gpu, on_this_machine=True)
    if is_distributed(args):
        from poseidon.engine.solvers import check_solver_file
        check_solver_file(args.solver)   # a bad file: one line, before any process starts
        from poseidon.dist.job.launch import launch
        os.environ.update(settings.environ())    # the job's processes inherit this environment
        return launch(args)
    given = dist_flags_given(args)
    if given:
        raise PoseidonError(f"{', '.join(given)} only apply to a distributed run: add --workers N "
                            f"(or --coordinator with --rank on each host), or drop them")
    setup_logging()
    from poseidon.engine.replicas import plan_devices
    devices = plan_devices(args.gpu, args.devices_per_node)
    apply_gpu(args)
    from poseidon.engine.solvers import get_solver
    solver = get_solver(args.solver, dtype=args.dtype, progress=not args.no_progress,
                        replicas=len(devices), devices=None if devices[0] is None else devices)
    if args.resume == "auto":
        from poseidon.dist.job.resume import newest_complete
        args.snapshot = newest_complete(solver.param.snapshot_prefix,
                                        say=lambda line: out(f"--resume auto: {line}"))
        out(f"--resume auto: resuming from {args.snapshot}" if args.snapshot else
            "--resume auto: no complete snapshot yet: starting from the beginning")
    if args.weights:
        for path in args.weights.split(","):
            solver.net.copy_from(path)
    install_signal_effects(solver, args)
    solver.solve(resume_file=args.snapshot)
    report_final(solver)
    return 0


def report_final(solver):
    for line in final_accuracy_lines(solver):
        out(line)


def install_signal_effects(solver, args):
    """Caffe's --sigint_effect / --sighup_effect: ask the solver to stop or snapshot after the
    current iteration, so a snapshot is never cut in half by the signal."""
    import signal

    def handler_for(effect):
        def handle(signum, frame):
            out(f"Received signal {signum}: {effect} after this iteration")
            solver.request(effect)
        return handle

    for name, effect in (("SIGINT", args.sigint_effect), ("SIGHUP", args.sighup_effect)):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        signal.signal(sig, signal.SIG_IGN if effect == "none" else handler_for(effect))
