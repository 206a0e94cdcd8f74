"""Pieces several subcommands share: device choice, phase parsing, logging set-up."""
import logging
import sys

from poseidon.engine import backend, settings
from poseidon.engine.errors import PoseidonError


def add_gpu_option(parser):
    parser.add_argument("--gpu", default=None,
                        help="GPU id to run on (CuPy); 'all' is not supported; omit for the CPU")
    parser.add_argument("--refresh-routes", action="store_true",
                        help="time the convolution routes again on this machine instead of "
                             "taking the cached choices (as POSEIDON_CONV_REFRESH=1)")
    parser.add_argument("--tf32", action="store_true",
                        help="with --gpu: let float32 GEMMs use TF32 tensor cores (Ampere and "
                             "newer; faster, 10-bit mantissa inputs); default full FP32")


def apply_route_refresh(args):
    """--refresh-routes: the engine's conv_refresh setting."""
    if getattr(args, "refresh_routes", False):
        settings.configure(conv_refresh=True)


def configure_engine(args, **values):
    """The engine's settings from this command's flags (`values`: more of them, None where a
    flag was not given), then all of them checked: a bad POSEIDON_* variable ends the command
    here with one line, before any work starts."""
    apply_route_refresh(args)
    settings.configure(**{name: value for name, value in values.items() if value is not None})


def apply_gpu(args, local_rank=0):
    configure_engine(args)
    if getattr(args, "tf32", False):
        if args.gpu is None or str(args.gpu).lower() in ("", "none", "cpu", "-1"):
            raise PoseidonError("--tf32 is a GPU math mode and the run is on the CPU: add "
                                "--gpu N, or drop --tf32")
        settings.configure(tf32=True)
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
