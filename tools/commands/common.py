"""Pieces several subcommands share: device choice, phase parsing, logging set-up."""
import logging
import sys

from poseidon.engine import backend


def add_gpu_option(parser):
    parser.add_argument("--gpu", default=None,
                        help="GPU id to run on (CuPy); 'all' is not supported; omit for the CPU")


def apply_gpu(args, local_rank=0):
    backend.set_mode_from_flag(args.gpu, local_rank)


def setup_logging():
    from poseidon.engine.solvers import log_to_stderr
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
