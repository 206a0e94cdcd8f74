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
    parser.add_argument("--tf32", action="store_true",
                        help="with --gpu: let float32 GEMMs use TF32 tensor cores (Ampere and "
                             "newer; faster, 10-bit mantissa inputs); default full FP32")


def apply_route_refresh(args):
    """--refresh-routes, through the environment so that a job's processes see it too."""
    if getattr(args, "refresh_routes", False):
        os.environ["POSEIDON_CONV_REFRESH"] = "1"


def apply_gpu(args, local_rank=0):
    apply_route_refresh(args)
    if getattr(args, "tf32", False):
        if args.gpu is None or str(args.gpu).lower() in ("", "none", "cpu", "-1"):
            from poseidon.engine.errors import PoseidonError
            raise PoseidonError("--tf32 is a GPU math mode and the run is on the CPU: add "
                                "--gpu N, or drop --tf32")
        os.environ[backend.TF32_VARIABLE] = "1"     # through the environment: a job's processes
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
