"""Layers made from their prototxt parameters: the built-in types, and any registered since."""
import numpy

from . import layers  # noqa: F401  (importing registers the built-in types)
from .layer import TRAIN
from .registry import lookup, names


def layer_class(type_name, layer_name="?"):
    return lookup(type_name, layer_name)


def registered_types():
    return names()


def create_layer(param, phase=TRAIN, dtype=numpy.float32, xp=numpy):
    return lookup(param.type, param.name)(param, phase, dtype, xp)
