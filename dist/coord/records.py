"""The information book's records, typed: a layer, a parameter, a KV pair, a bundle (one KV
message).

Why frozen dataclasses: every process builds the same book and must reach the same decisions
from it, so nothing may change a record behind another reader's back; a misspelt field is an
AttributeError where a misspelt key was a KeyError far from its cause. The records travel as JSON
objects (the book to every process, a worker's description of its net to the coordinator, a
simulator profile on disk); `to_wire` and `from_wire` convert at those places only, and keep the
bytes of the old dicts: the same keys in the same order, an optional field left out while None.
Sequences are tuples here and lists on the wire.
"""
from __future__ import annotations   # the `X | None` annotations on Python 3.9

import dataclasses
from dataclasses import dataclass


def _tuple(values):
    return None if values is None else tuple(values)


def _list(values):
    return None if values is None else list(values)


def _wire(record, convert):
    """The record's JSON object: its fields in order, `convert`ed by name, None ones left out
    (every optional field of these records is None exactly when its key is absent)."""
    out = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if value is not None:
            out[field.name] = convert[field.name](value) if field.name in convert else value
    return out


@dataclass(frozen=True)
class LayerRecord:
    """A layer whose parameters are synced: its GEMM's rows (M×N weight, K rows of input),
    whether it can give sufficient factors, its parameter ids and their shapes. A worker's
    description (describe_net) and a simulator profile give the first fields; the book adds
    the scheme (Algorithm 1's first choice), the schemes the measured model may move it to
    (`candidates`), the layer its sync starts after (`group`), and the ring's piece size."""
    index: int
    name: str
    type: str
    M: int
    N: int
    K: int
    sfb: bool
    params: tuple[int, ...]
    weight_grad: bool | None = None     # whether backward makes the weight gradient (None: unsaid)
    shapes: tuple[tuple[int, ...], ...] | None = None      # each parameter's dims (None: unsaid)
    piece_floats: int | None = None     # the ring's piece (--piece-bytes; None: the default)
    scheme: str | None = None
    candidates: tuple[str, ...] | None = None
    group: int | None = None

    @classmethod
    def from_wire(cls, obj):
        fields = dict(obj, params=tuple(obj["params"]))
        if obj.get("shapes") is not None:
            fields["shapes"] = tuple(tuple(s) for s in obj["shapes"])
        fields["candidates"] = _tuple(obj.get("candidates"))
        return cls(**fields)

    def to_wire(self):
        return _wire(self, {"params": list, "shapes": lambda s: [list(x) for x in s],
                            "candidates": list})


@dataclass(frozen=True)
class ParamRecord:
    """A learnable parameter: `id` is its index in net.learnable_params (the solver's history
    order); `layer` the layer that syncs it (the first of those sharing it); `owner` (layer,
    blob) where it lives. `scheme` is set in the book only (None there: not synced), which is
    why `to_wire` takes whether to write it."""
    id: int
    name: str
    layer: int
    owner: tuple[int, int]
    shape: tuple[int, ...]
    count: int
    lr_mult: float
    decay_mult: float
    shared: bool
    synced: bool
    scheme: str | None = None

    @classmethod
    def from_wire(cls, obj):
        return cls(**dict(obj, owner=tuple(obj["owner"]), shape=tuple(obj["shape"])))

    def to_wire(self, with_scheme=True):
        out = {"id": self.id, "name": self.name, "layer": self.layer, "owner": list(self.owner),
               "shape": list(self.shape), "count": self.count, "lr_mult": self.lr_mult,
               "decay_mult": self.decay_mult, "shared": self.shared, "synced": self.synced}
        if with_scheme:
            out["scheme"] = self.scheme
        return out


@dataclass(frozen=True)
class Pair:
    """A KV pair: `length` elements of parameter `param` from `offset`, kept on `server`."""
    id: int
    param: int
    offset: int
    length: int
    server: int

    @classmethod
    def from_wire(cls, obj):
        return cls(**obj)

    def to_wire(self):
        return _wire(self, {})


@dataclass(frozen=True)
class Bundle:
    """One KV message each way: the pairs it carries (their first one's id is its own, which keys
    its push and reply), the layer its sync starts after, and its server (None until placed)."""
    id: int
    layer: int
    pairs: tuple[int, ...]
    server: int | None = None

    @classmethod
    def from_wire(cls, obj):
        return cls(**dict(obj, pairs=tuple(obj["pairs"])))

    def to_wire(self):
        return _wire(self, {"pairs": list})


def description_from_wire(obj):
    """A net's description (dist/coord/book.describe_net) with its layers and parameters as
    records, from its JSON object."""
    return dict(obj, layers=[LayerRecord.from_wire(r) for r in obj["layers"]],
                params=[ParamRecord.from_wire(p) for p in obj["params"]])


def description_to_wire(description):
    """The JSON object of a net's description (its parameters without a scheme)."""
    return dict(description, layers=[r.to_wire() for r in description["layers"]],
                params=[p.to_wire(with_scheme=False) for p in description["params"]])
