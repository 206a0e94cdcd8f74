"""Net: a stack of layers built from a NetParameter, run forward and backward layer by layer.

`BackwardThrough(l)` runs the backward of layer l alone, so a caller can act between layers: the
Solver's loop calls its hooks there (engine/solvers/hooks.py), which is where a distributed worker
schedules the synchronisation of layer l while layers l-1..0 are still computing (wait-free
backpropagation). `Backward()` runs them all; its `after_layer(l)`, when given, is called right
after each. Which layers need backward is worked out in engine/backward_plan.py, and the weights
files are read and written in engine/net_weights.py.
"""
import collections

import numpy

from . import backend, net_weights
from .backward_plan import plan_backward
from .blob import Blob
from .errors import DataError, ModelError, PoseidonError
from .factory import create_layer
from .layer import TRAIN, TEST
from .layers.batchnorm_scale import BatchNormScalePair, can_pair
from .layers.fusion import absorb_relus
from .proto import caffe_pb2
from . import prototxt


class ParamSpec:
    """How the solver treats one learnable blob: its multipliers and a readable name."""

    __slots__ = ("name", "lr_mult", "decay_mult", "layer_index", "blob_index")

    def __init__(self, name, lr_mult, decay_mult, layer_index, blob_index):
        self.name, self.lr_mult, self.decay_mult = name, lr_mult, decay_mult
        self.layer_index, self.blob_index = layer_index, blob_index

    def __repr__(self):
        return f"ParamSpec({self.name}, lr_mult={self.lr_mult}, decay_mult={self.decay_mult})"


def parse_phase(phase):
    if isinstance(phase, str):
        try:
            return {"TRAIN": TRAIN, "TEST": TEST}[phase.upper()]
        except KeyError:
            raise ModelError(f"phase must be TRAIN or TEST, got '{phase}'") from None
    if phase not in (TRAIN, TEST):
        raise ModelError(f"phase must be engine.TRAIN (0) or engine.TEST (1), got {phase!r}")
    return int(phase)


class Net:
    """A network in one phase. pycaffe-like: `Net(model_file, phase, weights=None)`.

    model: a prototxt path or a NetParameter. dtype: float32 normally, float64 for gradient checks.
    xp: numpy or cupy (default: the mode set by engine.set_mode_cpu/gpu). shard: (rank, size) given
    to data layers so that each of `size` workers reads its own part of the data. source: the file
    a NetParameter came from, so that errors name its file:line (a path model sets it itself).
    """

    flat = None   # FlatParams (engine/flat_params.py) once a solver lays the parameters out flat

    def __init__(self, model, phase=TRAIN, weights=None, level=0, stages=(), dtype=numpy.float32,
                 xp=None, shard=(0, 1), state=None, source=None):
        self.source = model if isinstance(model, str) else source
        param = prototxt.read_net(model) if isinstance(model, str) else self._copy(model)
        self.phase = parse_phase(phase)
        self.dtype = numpy.dtype(dtype)
        self.xp = xp or backend.default_xp()
        self.shard = tuple(shard)
        net_state = caffe_pb2.NetState(phase=self.phase, level=level, stage=list(stages))
        if param.HasField("state"):
            merged = caffe_pb2.NetState()
            merged.CopyFrom(param.state)
            merged.MergeFrom(net_state)
            merged.phase = self.phase
            net_state = merged
        if state is not None:
            net_state.MergeFrom(state)
            net_state.phase = self.phase
        self.name = param.name
        self.force_backward = param.force_backward
        try:
            filtered = prototxt.filter_net(param, net_state)
            self.param = prototxt.insert_splits(filtered)
            self._build()
        except (ModelError, DataError) as e:
            raise self._locate(e) from None
        self.backward_passes = [0] * len(self.layers)   # backward runs per layer, see BackwardThrough
        if weights:
            self.copy_from(weights)

    def _pair_batchnorm_scale(self):
        """A Scale run in place right after the BatchNorm whose output it scales (the pairs of
        ResNet and Inception files) runs with it as one (engine/layers/batchnorm_scale.py): the
        two layer indices get the pair's two members, which keep the layers' names, parameters
        and per-layer steps; the pair may fold the Scale into the BatchNorm's passes, and saves
        the Scale its copy of the input (one activation-sized buffer and one pass over it per
        pair)."""
        for li in range(1, len(self.layers)):
            if can_pair(self.layers[li - 1], self.layers[li], self.top_vecs[li - 1],
                        self.bottom_vecs[li], self.top_vecs[li]):
                pair = BatchNormScalePair(self.layers[li - 1], self.layers[li])
                self.layers[li - 1], self.layers[li] = pair.members
                self._pairs[li - 1] = pair
                self.layers[li].reshape(self.bottom_vecs[li], self.top_vecs[li])  # decides the fold
        self.layer_dict = collections.OrderedDict(zip(self.layer_names, self.layers))

    @staticmethod
    def _copy(param):
        out = caffe_pb2.NetParameter()
        out.CopyFrom(param)
        return prototxt.upgrade_net(out)

    def _locate(self, error):
        """Prefix an error with file:line of the layer it names, when the net came from a file."""
        message = str(error)
        if not self.source or message.startswith(f"{self.source}:"):
            return error
        mentions = [(message.find(f"layer '{name}'"), line)
                    for name, line in prototxt.layer_lines(self.source).items()
                    if f"layer '{name}'" in message]
        if mentions:   # the layer the message names first
            return type(error)(f"{self.source}:{min(mentions)[1]}: {message}")
        return type(error)(f"{self.source}: {message}")

    # ----- construction ----------------------------------------------------------------------
    def _build(self):
        self.layers, self.layer_names = [], []
        self.bottom_vecs, self.top_vecs, self.bottom_names, self.top_names = [], [], [], []
        self.blobs = collections.OrderedDict()
        self.blob_loss_weights = {}
        self.inputs = []
        consumed = set()
        self.learnable_params, self.learnable_param_specs = [], []
        self.param_owner = {}        # ParamSpec name -> (layer index, blob index)
        self.params = collections.OrderedDict()
        self.layer_param_specs = []  # per layer: list of ParamSpec (one per blob)

        for li, lp in enumerate(self.param.layer):
            if lp.name in self.layer_names:
                raise ModelError(f"layer '{lp.name}': two layers share this name; names must be unique")
            layer = create_layer(lp, self.phase, self.dtype, self.xp)
            layer.shard = self.shard
            bottoms, tops = self._connect(lp, consumed)
            layer.setup(bottoms, tops)
            self._load_inline_blobs(layer, lp)
            self.layers.append(layer)
            self.layer_names.append(lp.name)
            self.bottom_vecs.append(bottoms)
            self.top_vecs.append(tops)
            self.bottom_names.append(list(lp.bottom))
            self.top_names.append(list(lp.top))
            for name, weight in zip(lp.top, layer.loss_weights):
                if weight:
                    self.blob_loss_weights[name] = weight
            self._append_params(li, layer, lp)
        self.output_names = sorted(n for n in self.blobs if n not in consumed)
        self.outputs = self.output_names
        self.layer_dict = collections.OrderedDict(zip(self.layer_names, self.layers))
        self._loss_tops = [(li, ti, w) for li, layer in enumerate(self.layers)
                           for ti, w in enumerate(layer.loss_weights) if w]
        self._plan_backward()
        for li, layer in enumerate(self.layers):
            needs = self.layer_need_backward[li]
            layer.plan_backward(needs and any(layer.param_propagate_down),
                                needs and any(self.bottom_need_backward[li]))
        self._pairs = {}   # BatchNorm index -> its BatchNormScalePair (_pair_batchnorm_scale)
        self._pair_batchnorm_scale()
        self.fused_relus = absorb_relus(self)   # (layer, ReLU) pairs: engine/layers/fusion.py
        users = collections.Counter(spec.name for specs in self.layer_param_specs for spec in specs)
        self._sole_params = {id(blob) for blob, spec in zip(self.learnable_params,
                                                             self.learnable_param_specs)
                             if users[spec.name] == 1}

    def _connect(self, lp, consumed):
        """The bottom and top blobs of layer lp: every bottom made by an earlier layer (its name
        joins `consumed`); each top a new blob, or its bottom's own when computed in place."""
        bottoms = []
        for name in lp.bottom:
            if name not in self.blobs:
                raise ModelError(f"layer '{lp.name}': bottom '{name}' is not produced by any "
                                 f"earlier layer")
            bottoms.append(self.blobs[name])
            consumed.add(name)
        tops = []
        for ti, name in enumerate(lp.top):
            if ti < len(lp.bottom) and lp.bottom[ti] == name:
                tops.append(self.blobs[name])          # in place
            elif name in self.blobs:
                raise ModelError(f"layer '{lp.name}': top '{name}' is produced by multiple "
                                 f"sources; give it a new name (in place needs top i == bottom i)")
            else:
                blob = Blob((), self.dtype, self.xp)
                self.blobs[name] = blob
                tops.append(blob)
                if lp.type == "Input":
                    self.inputs.append(name)
        return bottoms, tops

    def _load_inline_blobs(self, layer, lp):
        if not len(lp.blobs):
            return
        from .io.caffemodel import proto_to_array
        if len(lp.blobs) != len(layer.blobs):
            raise ModelError(f"layer '{lp.name}': gives {len(lp.blobs)} blobs, the layer has "
                             f"{len(layer.blobs)}")
        for blob, proto in zip(layer.blobs, lp.blobs):
            array = proto_to_array(proto)
            if array.size != blob.count:
                raise ModelError(f"layer '{lp.name}': inline blob of shape {array.shape} does not "
                                 f"fit parameter of shape {blob.shape}")
            blob.data[...] = backend.to_xp(array.reshape(blob.shape), self.xp)

    def _append_params(self, li, layer, lp):
        specs = []
        for bi, blob in enumerate(layer.blobs):
            given = lp.param[bi] if bi < len(lp.param) else None
            frozen = not layer.param_propagate_down[bi]
            lr = given.lr_mult if given is not None and given.HasField("lr_mult") else (0.0 if frozen else 1.0)
            decay = (given.decay_mult if given is not None and given.HasField("decay_mult")
                     else (0.0 if frozen else 1.0))
            share_name = given.name if given is not None else ""
            spec = ParamSpec(share_name or f"{lp.name}[{bi}]", lr, decay, li, bi)
            if share_name and share_name in self.param_owner:
                oli, obi = self.param_owner[share_name]
                owner = self.layers[oli].blobs[obi] if oli < len(self.layers) else None
                strict = given.share_mode == caffe_pb2.ParamSpec.STRICT
                if (strict and owner.shape != blob.shape) or owner.count != blob.count:
                    raise ModelError(f"layer '{lp.name}': shared parameter '{share_name}' has shape "
                                     f"{blob.shape} here but {owner.shape} in layer "
                                     f"'{self.layer_names[oli]}'")
                layer.blobs[bi] = owner if strict else self._view_of(owner, blob.shape)
            else:
                if share_name:
                    self.param_owner[share_name] = (li, bi)
                self.learnable_params.append(blob)
                self.learnable_param_specs.append(spec)
            layer.param_propagate_down[bi] = lr != 0
            specs.append(spec)
        self.layer_param_specs.append(specs)
        if layer.blobs:
            self.params[lp.name] = layer.blobs

    @staticmethod
    def _view_of(owner, shape):
        view = Blob.__new__(Blob)
        view.xp, view.dtype = owner.xp, owner.dtype
        view._flat_data, view._flat_diff = owner._flat_data, owner._flat_diff
        view._data = owner._data.reshape(shape)
        view._diff = owner._diff.reshape(shape)
        return view

    def _plan_backward(self):
        """Which layers and bottoms need gradients (engine/backward_plan.py)."""
        self.layer_need_backward, self.bottom_need_backward = plan_backward(
            self.layers, self.param.layer, self.bottom_names, self.top_names,
            self.blob_loss_weights, self.force_backward)
        self.layers_with_params = [li for li, layer in enumerate(self.layers) if layer.blobs]

    # ----- running -----------------------------------------------------------------------------
    def ForwardLayer(self, li, alone=True):
        """Reshape and run the forward of layer li. A BatchNorm whose Scale folds into it
        writes the Scale's output as well (BatchNormScalePair); run `alone` (the default: the
        caller may stop here and read the top) the pair then puts the BatchNorm's own output
        back, which the Scale's forward scales as usual. Forward, and the per-layer timers,
        which run the next layer right after, pass alone=False."""
        layer = self.layers[li]
        bottom, top = self.bottom_vecs[li], self.top_vecs[li]
        try:
            layer.reshape(bottom, top)
            layer.forward(bottom, top)
        except (ModelError, DataError) as e:   # e.g. a corrupt record met by a Data layer
            raise self._locate(e) from None
        if alone and li in self._pairs:
            self._pairs[li].unfold(top)

    def Forward(self, start=0, end=None):
        """Run layers start..end (inclusive); returns the weighted loss of the net."""
        end = len(self.layers) - 1 if end is None else end
        for li in range(start, end + 1):
            self.ForwardLayer(li, alone=li == end)
        return self.loss()

    def loss(self):
        """The weighted loss of the last forward (a float); seeds each loss top's diff with its
        weight."""
        loss = self.loss_on_device()
        return loss if self.xp is numpy else float(loss)

    def loss_on_device(self):
        """loss() left where it was computed: on numpy the float itself; on a GPU a new 0-d
        device array, which the host waits for only when something reads it (the display), so
        a training step needs no host round-trip for its loss."""
        if self.xp is numpy:
            loss = 0.0
            for li, ti, w in self._loss_tops:
                top = self.top_vecs[li][ti]
                top.diff[...] = w
                loss += float(w * top.data.sum())
            return loss
        loss = None
        for li, ti, w in self._loss_tops:
            top = self.top_vecs[li][ti]
            top.diff[...] = w
            value = top.data.reshape(()) if top.count == 1 else top.data.sum()
            term = value * w                                # a new array: the top is reused
            loss = term if loss is None else loss + term
        return self.xp.zeros((), self.dtype) if loss is None else loss

    def check_deferred(self):
        """Raise what layers found on the device and left to be read later (a GPU step's label
        check, engine/layers/loss.py): one host read per such layer, at a display."""
        for layer in self.layers:
            check = getattr(layer, "check_deferred", None)
            if check is not None:
                try:
                    check()
                except (ModelError, DataError) as e:
                    raise self._locate(e) from None

    def BackwardThrough(self, l, factored=False):
        """The backward of layer l alone (no-op when it needs none). `factored`: the layer leaves
        its weight gradient to the caller, who makes it from the layer's sufficient factors (only
        for layers that have them). Each run is counted in backward_passes[l], so a caller that
        uses one pass's factors can check that exactly one ran."""
        if self.layer_need_backward[l]:
            layer = self.layers[l]
            args = (self.top_vecs[l], self.bottom_need_backward[l], self.bottom_vecs[l])
            if factored:
                layer.backward(*args, weight_grad=False)
            else:
                layer.backward(*args)
            self.backward_passes[l] += 1
            for blob in layer.blobs:               # whatever it wrote, its diffs are not zeros now
                blob.diff_fresh = False

    def Backward(self, start=None, end=0, factored=(), after_layer=None):
        """Backward of layers start..end (descending); `factored`: layer indices that leave their
        weight gradient to the caller (BackwardThrough); `after_layer(l)`, when given, runs
        right after layer l's backward (Caffe's Backward() is the call with no arguments)."""
        start = len(self.layers) - 1 if start is None else start
        for li in range(start, end - 1, -1):
            self.BackwardThrough(li, li in factored)
            if after_layer is not None:
                after_layer(li)

    def ForwardBackward(self):
        loss = self.Forward()
        self.Backward()
        return loss

    def sole_params(self):
        """ids of the learnable parameters that one layer alone uses (not shared by name)."""
        return self._sole_params

    def ClearParamDiffs(self):
        self.clear_diffs()

    def clear_diffs(self, blobs=None):
        """Zero the diffs of `blobs` (default: every learnable parameter) and let the layer that
        alone owns a parameter write its gradient over them (Blob.diff_fresh). A parameter shared
        by several layers is never marked: the second writer must add to the first."""
        if self.flat is not None:
            self.flat.clear_diffs(blobs)              # one fill per contiguous range
        for blob in self.learnable_params if blobs is None else blobs:
            if self.flat is None:
                blob.diff[...] = 0
            if id(blob) in self._sole_params:
                blob.diff_fresh = True

    def Reshape(self):
        for li in range(len(self.layers)):
            self.layers[li].reshape(self.bottom_vecs[li], self.top_vecs[li])

    # ----- pycaffe-style API --------------------------------------------------------------------
    def forward(self, blobs=None, start=None, end=None, **inputs):
        """Set named inputs, run forward, return {output name: array} (plus any `blobs` asked for)."""
        for name, value in inputs.items():
            if name not in self.blobs:
                raise PoseidonError(f"net '{self.name}' has no blob '{name}' (inputs: {self.inputs})")
            value = backend.to_xp(numpy.asarray(value) if not hasattr(value, "shape") else value, self.xp)
            if self.blobs[name].shape != value.shape:
                self.blobs[name].reshape(value.shape)
            self.blobs[name].data[...] = value
        s = 0 if start is None else self.layer_names.index(start)
        e = len(self.layers) - 1 if end is None else self.layer_names.index(end)
        self.Forward(s, e)
        names = list(self.output_names if end is None else self.top_names[e]) + list(blobs or [])
        return {n: self.blobs[n].data for n in names}

    def backward(self, diffs=None, start=None, end=None, **top_diffs):
        for name, value in top_diffs.items():
            self.blobs[name].diff[...] = backend.to_xp(numpy.asarray(value), self.xp)
        s = len(self.layers) - 1 if start is None else self.layer_names.index(start)
        e = 0 if end is None else self.layer_names.index(end)
        self.Backward(s, e)
        names = list(self.inputs) + list(diffs or [])
        return {n: self.blobs[n].diff for n in names}

    def reshape(self):
        self.Reshape()

    def share_with(self, other):
        """Use other's parameter blobs for layers of the same name (test nets share the train net's)."""
        for li, layer in enumerate(self.layers):
            theirs = other.layer_dict.get(self.layer_names[li])
            if theirs is None or not layer.blobs:
                continue
            if len(theirs.blobs) != len(layer.blobs):
                raise ModelError(f"layer '{self.layer_names[li]}': {len(layer.blobs)} blobs here, "
                                 f"{len(theirs.blobs)} in net '{other.name}'")
            for bi, blob in enumerate(theirs.blobs):
                if blob.shape != layer.blobs[bi].shape:
                    raise self._locate(ModelError(
                        f"layer '{self.layer_names[li]}': parameter {bi} has shape "
                        f"{layer.blobs[bi].shape} in this {_PHASES[self.phase]} net but "
                        f"{blob.shape} in net '{other.name}' whose weights it shares: give both "
                        f"phases data of the same shape (check the data sources and crop_size)"))
                layer.blobs[bi] = blob
            self.params[self.layer_names[li]] = layer.blobs

    # ----- data cursors (exact resume) ----------------------------------------------------------
    def data_cursors(self):
        return {name: layer.get_cursor() for name, layer in self.layer_dict.items()
                if hasattr(layer, "get_cursor")}

    def set_data_cursors(self, cursors):
        for name, cursor in (cursors or {}).items():
            layer = self.layer_dict.get(name)
            if layer is not None and hasattr(layer, "set_cursor"):
                layer.set_cursor(cursor)

    # ----- convolution routes (the same routes on every rank, and after a resume) -----------------
    def conv_routes(self):
        """{layer name: route} of the convolution layers, as this process runs them at their
        current input sizes ('im2col', 'fourier' or 'winograd'; a layer that has not chosen yet
        measures now). Give it to set_conv_routes of another process to run the same routes
        there: one rank measures and the others take its choice, and a snapshot that keeps it
        resumes on the same routes."""
        return {name: layer.algorithm for name, layer in self.layer_dict.items()
                if hasattr(layer, "pin_route")}

    def set_conv_routes(self, routes):
        """Pin convolution layers to routes ({layer name: route}, as conv_routes gives): a pinned
        layer never measures, and POSEIDON_CONV no longer moves it. A route that does not apply
        to a layer's input runs as im2col there. Call it before a forward, not between a forward
        and its backward (which needs the core that ran the forward)."""
        convs = [name for name, layer in self.layer_dict.items() if hasattr(layer, "pin_route")]
        for name, route in (routes or {}).items():
            layer = self.layer_dict.get(name)
            if layer is None or not hasattr(layer, "pin_route"):
                known = ", ".join(convs) or "none"
                raise ModelError(f"net '{self.name}': set_conv_routes names layer '{name}', "
                                 f"which is not one of its convolution layers ({known}); give "
                                 f"the routes of a net built from the same model")
            layer.pin_route(route)

    def shutdown(self):
        for layer in self.layers:
            if hasattr(layer, "shutdown"):
                layer.shutdown()

    # ----- weights (engine/net_weights.py) ----------------------------------------------------
    def to_proto(self, write_diff=False):
        return net_weights.to_proto(self, write_diff)

    def save(self, path):
        """Binary .caffemodel (Caffe's NetParameter with blobs), written atomically."""
        net_weights.save(self, path)

    def save_hdf5(self, path):
        net_weights.save_hdf5(self, path)

    def copy_from(self, path, report_missing=True):
        """Load weights by layer name from a .caffemodel (binary) or .h5 file, as Caffe does;
        returns the names of the layers with parameters that the file gave nothing, which a
        warning lists unless `report_missing` is False (net_weights.copy_from says why)."""
        return net_weights.copy_from(self, path, report_missing)

    # ----- inspection ---------------------------------------------------------------------------
    def param_counts(self):
        """(learnable parameter count, stored statistics count) over unique blobs."""
        learnable = stats = 0
        seen = set()
        for layer in self.layers:
            for blob in layer.blobs:
                if id(blob) in seen:
                    continue
                seen.add(id(blob))
                if layer.stores_statistics:
                    stats += blob.count
                else:
                    learnable += blob.count
        return learnable, stats


_PHASES = {TRAIN: "TRAIN", TEST: "TEST"}

