"""The layer types by the name prototxt files use (Caffe's LayerRegistry).

A layer class registers itself with `@register("TypeName")` beside its definition; the factory
(engine/factory.py) imports the built-in layers and looks types up here.
"""
import difflib

from .errors import ModelError

_TYPES = {}


def register(type_name):
    """Class decorator adding a layer type under the name prototxt files use (`type: "..."`)."""

    def add(cls):
        if type_name in _TYPES:
            raise ValueError(f"layer type '{type_name}' is registered twice "
                             f"({_TYPES[type_name].__module__} and {cls.__module__})")
        cls.type = type_name
        _TYPES[type_name] = cls
        return cls

    return add


def lookup(type_name, layer_name="?"):
    """The class registered as `type_name`; ModelError naming the layer and the closest type."""
    try:
        return _TYPES[type_name]
    except KeyError:
        close = difflib.get_close_matches(type_name, list(_TYPES), n=1, cutoff=0.7)
        known = (f"did you mean '{close[0]}'?" if close
                 else "known: " + ", ".join(sorted(_TYPES)))
        raise ModelError(f"layer '{layer_name}': unknown layer type '{type_name}': fix the type or "
                         f"register a Python layer with @engine.register('{type_name}'); "
                         f"{known}") from None


def names():
    return sorted(_TYPES)
