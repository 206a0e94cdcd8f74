"""The model and solver files shipped with the package, one folder a net (written by poseidon.models).

They are package data: read them through `path()` rather than a path relative to the source tree, so
that an installed wheel finds them as well as a checkout.

    from poseidon import prototxt
    prototxt.path("cifar10_quick", "deploy.prototxt")
"""
from importlib import resources
from pathlib import Path


def folder() -> Path:
    """The folder that holds one sub-folder per net (a real folder: wheels install unzipped)."""
    return Path(str(resources.files(__name__)))


def path(model: str, name: str = "deploy.prototxt") -> Path:
    """The file NAME of the shipped net MODEL (it may not exist: callers report that themselves)."""
    return folder() / model / name


def models() -> list:
    """The names of the shipped nets that have a deploy file."""
    return sorted(p.parent.name for p in folder().glob("*/deploy.prototxt"))
