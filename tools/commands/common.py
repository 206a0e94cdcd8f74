"""Pieces several subcommands share: device choice, phase parsing, logging set-up."""
import logging
import sys

from engine import backend
from engine.errors import PoseidonError


def add_gpu_option(parser):
    parser.add_argument("--gpu", default=None,
                        help="GPU id to run on (CuPy); 'all' is not supported; omit for the CPU")


def apply_gpu(args, local_rank=0):
    if args.gpu is None or str(args.gpu).lower() in ("", "none", "cpu", "-1"):
        backend.set_mode_cpu()
        return
    try:
        ids = [int(x) for x in str(args.gpu).split(",")]
    except ValueError:
        raise PoseidonError(f"--gpu takes a device id or a comma-separated list, got "
                            f"'{args.gpu}'; give e.g. --gpu 0 (or omit it for the CPU)") from None
    if any(i < 0 for i in ids):
        raise PoseidonError(f"--gpu takes device ids >= 0, got '{args.gpu}'; omit it for the CPU")
    try:
        backend.set_mode_gpu(ids[local_rank % len(ids)])
    except RuntimeError as e:   # no CuPy, no CUDA device, or no device of that id
        raise PoseidonError(f"--gpu {args.gpu}: {e}") from None


def setup_logging():
    from engine.solvers.solver import log_to_stderr
    log_to_stderr()


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise __import__("argparse").ArgumentTypeError(f"expected a positive integer, got '{text}'")
    if value < 1:
        raise __import__("argparse").ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return value


def out(line=""):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


logger = logging.getLogger("poseidon")
