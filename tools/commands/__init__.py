"""One module per `poseidon` subcommand; each has `add(subparsers)` setting `run`.

A subcommand whose module needs a package this machine lacks (pyzmq for the distributed ones,
say, on a GPU image that has only CuPy and PyTorch) is still listed, and says what to install
when run: the other subcommands (bench --probe among them) work without it.
"""
import argparse
import importlib

from poseidon.engine.errors import PoseidonError

ORDER = ("train", "test", "timing", "summary", "data", "mean", "bench", "keys", "simulate", "plot")
PIP_NAMES = {"zmq": "pyzmq"}


def _unavailable(sub, name, missing):
    package = PIP_NAMES.get(missing, missing)
    p = sub.add_parser(name, help=f"(needs {package}, not installed here)", add_help=False,
                       prefix_chars="\0")          # takes whatever follows as it is
    p.add_argument("rest", nargs=argparse.REMAINDER)

    def run(args):
        raise PoseidonError(f"this subcommand needs the {package} package, which is not "
                            f"installed: pip install {package}")
    p.set_defaults(run=run)


def register_all(sub):
    for name in ORDER:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ImportError as e:
            if not e.name or e.name.startswith("poseidon"):
                raise                               # our own code: a real error
            _unavailable(sub, name, e.name.split(".")[0])
            continue
        module.add(sub)
