"""One module per `poseidon` subcommand; each has `add(subparsers)` setting `run`."""
from . import bench, data, mean, summary, test, timing, train


def register_all(sub):
    for module in (train, test, timing, summary, data, mean, bench):
        module.add(sub)
