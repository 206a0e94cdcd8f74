"""Pieces several subcommands share: device choice, phase parsing, logging set-up."""
import logging
import os
import sys

from poseidon.engine import backend


def add_gpu_option(parser):
    parser.add_argument("--gpu", default=None,
                        help="GPU id to run on (CuPy); 'all' is not supported; omit for the CPU")
    parser.add_argument("--refresh-routes", action="store_true",
                        help="time the convolution routes again on this machine instead of "
                             "taking the cached choices (POSEIDON_CONV_REFRESH=1)")


def apply_route_refresh(args):
    """--refresh-routes, through the environment so that a job's processes see it too."""
    if getattr(args, "refresh_routes", False):
        os.environ["POSEIDON_CONV_REFRESH"] = "1"


def apply_gpu(args, local_rank=0):
    apply_route_refresh(args)
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
