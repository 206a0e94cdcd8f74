"""One module per `poseidon` subcommand; each has `add(subparsers)` setting `run`."""
from . import bench, data, keys, mean, plot, simulate, summary, test, timing, train


def register_all(sub):
    for module in (train, test, timing, summary, data, mean, bench, keys, simulate, plot):
        module.add(sub)
