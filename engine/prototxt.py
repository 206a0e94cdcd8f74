"""Reading Caffe model and solver files: protobuf text format, legacy upgrades, phase filtering, splits.

Text goes through protobuf's own text-format parser against the project's Caffe-compatible schema, so
every file Caffe reads parses the same way here. On top of parsing, this module does what Caffe's
upgrade_proto.cpp, Net::FilterNet and insert_splits.cpp do, each as one function on a NetParameter.
"""
import os
import re

from google.protobuf import text_format

from .errors import ModelError
from .proto import caffe_pb2

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


# What a file given in the wrong place looks like, and where it belongs.
_OTHER_KIND = {"net": ("solver", "SolverParameter", "give it to `poseidon train --solver`"),
               "solver": ("net", "NetParameter", "name it in a solver file (net: \"...\") or "
                                                 "give it to --model")}


def _field_names(full_name):
    """Field names of a caffe message type ("caffe.InnerProductParameter"), or []."""
    from google.protobuf import descriptor_pool
    try:
        return [f.name for f in descriptor_pool.Default().FindMessageTypeByName(full_name).fields]
    except KeyError:
        return []


def _explain_parse_error(msg, what):
    """protobuf's parse message, shortened, with the likely fix."""
    import difflib
    unknown = re.match(r'Message type "([\w.]+)" has no field named "(\w+)"', msg)
    if unknown:
        message_type, field = unknown.groups()
        other, other_type, where_to = _OTHER_KIND[what]
        top_level = message_type == f"caffe.{_OTHER_KIND[other][1]}"
        if top_level and field in _field_names(f"caffe.{other_type}"):
            return (f"unknown field '{field}': this looks like a {other} file, not a {what} file: "
                    f"{where_to}")
        close = difflib.get_close_matches(field, _field_names(message_type), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "check the spelling in caffe.proto"
        return f"{message_type} has no field '{field}': {hint}"
    enum = re.search(r'Enum type "([\w.]+)" has no value named (\w+)', msg)
    if enum:
        return f"{enum.group(1)} has no value {enum.group(2)}: check the spelling in caffe.proto"
    msg = re.sub(r"^'.*?': ", "", msg, flags=re.S)   # protobuf repeats the line; we name it
    return f"{msg.rstrip('.')}: fix the text there"


def _read_text(path, message, what):
    if not os.path.exists(path):
        raise ModelError(f"{path}: {what} file does not exist; check the path")
    if os.path.isdir(path):
        raise ModelError(f"{path}: is a folder; give the {what} prototxt file")
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        # protobuf's message starts with "line:col : ..." (1-based line).
        detail = str(e)
        m = re.match(r"(\d+):(\d+) ?: ?(.*)", detail, re.S)
        where = f"{path}:{m.group(1)}:{m.group(2)}" if m else path
        msg = _explain_parse_error((m.group(3) if m else detail).strip(), what)
        raise ModelError(f"{where}: not a valid {what} file: {msg}") from None
    return message


def parse_net_text(text, source="<text>"):
    """A NetParameter from prototxt text (upgraded), for tests and Python-built nets."""
    param = caffe_pb2.NetParameter()
    try:
        text_format.Parse(text, param)
    except text_format.ParseError as e:
        raise ModelError(f"{source}: not a valid net file: {e}") from None
    return upgrade_net(param)


def read_net(path):
    """NetParameter from a prototxt file, upgraded from the V1 `layers` and net-level input forms."""
    return upgrade_net(_read_text(path, caffe_pb2.NetParameter(), "net"))


def read_solver(path):
    return _read_text(path, caffe_pb2.SolverParameter(), "solver")


def field_line(path, field):
    """Line number of the first `field:` at the start of a line of a text file (solver keys), or
    None."""
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if re.match(rf"\s*{re.escape(field)}\s*:", line):
                    return number
    except OSError:
        pass
    return None


def layer_lines(path):
    """Map layer name -> line number in a prototxt file, so errors can name file:line."""
    lines = {}
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return lines
    for m in re.finditer(r"\blayers?\s*\{\s*name\s*:\s*[\"']([^\"']*)[\"']", text):
        lines.setdefault(m.group(1), text.count("\n", 0, m.start()) + 1)
    return lines


# ----- upgrades --------------------------------------------------------------------------------
_V1_TYPES = {
    1: "Accuracy", 2: "BNLL", 3: "Concat", 4: "Convolution", 5: "Data", 6: "Dropout",
    7: "EuclideanLoss", 8: "Flatten", 9: "HDF5Data", 10: "HDF5Output", 11: "Im2col",
    12: "ImageData", 13: "InfogainLoss", 14: "InnerProduct", 15: "LRN",
    16: "MultinomialLogisticLoss", 17: "Pooling", 18: "ReLU", 19: "Sigmoid", 20: "Softmax",
    21: "SoftmaxWithLoss", 22: "Split", 23: "TanH", 24: "WindowData", 25: "Eltwise", 26: "Power",
    27: "SigmoidCrossEntropyLoss", 28: "HingeLoss", 29: "MemoryData", 30: "ArgMax",
    31: "Threshold", 32: "DummyData", 33: "Slice", 34: "MVN", 35: "AbsVal", 36: "Silence",
    37: "ContrastiveLoss", 38: "Exp", 39: "Deconvolution",
}
_V2_FIELDS = {f.name for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields}


def _upgrade_v1_layer(v1):
    if v1.HasField("layer"):
        raise ModelError(f"layer '{v1.layer.name}': V0 net format (layers {{ layer {{ ... }} }}) is "
                         f"not supported; upgrade it with Caffe's upgrade_net_proto_text first")
    layer = caffe_pb2.LayerParameter()
    layer.name = v1.name
    if v1.type not in _V1_TYPES:
        raise ModelError(f"layer '{v1.name}': unknown V1 layer type number {v1.type}")
    layer.type = _V1_TYPES[v1.type]
    layer.bottom.extend(v1.bottom)
    layer.top.extend(v1.top)
    layer.blobs.extend(v1.blobs)
    layer.loss_weight.extend(v1.loss_weight)
    layer.include.extend(v1.include)
    layer.exclude.extend(v1.exclude)
    n_specs = max(len(v1.blobs_lr), len(v1.weight_decay), len(v1.param), len(v1.blob_share_mode))
    for i in range(n_specs):
        spec = layer.param.add()
        if i < len(v1.param):
            spec.name = v1.param[i]
        if i < len(v1.blob_share_mode):
            spec.share_mode = v1.blob_share_mode[i]
        if i < len(v1.blobs_lr):
            spec.lr_mult = v1.blobs_lr[i]
        if i < len(v1.weight_decay):
            spec.decay_mult = v1.weight_decay[i]
    for field, value in v1.ListFields():
        if field.name.endswith("_param") and field.name in _V2_FIELDS:
            getattr(layer, field.name).CopyFrom(value)
    return layer


def _move_data_transform(layer):
    # Old files put scale/mean_file/crop_size/mirror in data_param; Caffe moves them to transform_param.
    if not layer.HasField("data_param"):
        return
    dp, tp = layer.data_param, layer.transform_param
    for name in ("scale", "mean_file", "crop_size", "mirror"):
        if dp.HasField(name):
            setattr(tp, name, getattr(dp, name))
            dp.ClearField(name)


def upgrade_net(param):
    """Upgrade in place (and return) V1 layers, data transforms, net-level inputs, BatchNorm specs."""
    if len(param.layers):
        if len(param.layer):
            raise ModelError(f"net '{param.name}': uses both `layer` and the legacy `layers`; "
                             f"use one form")
        upgraded = [_upgrade_v1_layer(v1) for v1 in param.layers]
        param.ClearField("layers")
        param.layer.extend(upgraded)
    for layer in param.layer:
        _move_data_transform(layer)
        if layer.type == "BatchNorm" and len(layer.param) == 3:
            for spec in layer.param:
                spec.lr_mult = 0
                spec.decay_mult = 0
    if len(param.input):
        shapes = list(param.input_shape)
        dims = list(param.input_dim)
        if not shapes:
            if len(dims) != 4 * len(param.input):
                raise ModelError(f"net '{param.name}': {len(param.input)} net inputs need "
                                 f"{4 * len(param.input)} input_dim values, got {len(dims)}")
            for i in range(len(param.input)):
                shapes.append(caffe_pb2.BlobShape(dim=dims[4 * i:4 * i + 4]))
        if len(shapes) not in (1, len(param.input)):
            raise ModelError(f"net '{param.name}': {len(param.input)} net inputs but "
                             f"{len(shapes)} input_shape entries")
        layer = caffe_pb2.LayerParameter(name="input", type="Input")
        layer.top.extend(param.input)
        for s in shapes:
            layer.input_param.shape.add().CopyFrom(s)
        rest = list(param.layer)
        param.ClearField("layer")
        param.layer.extend([layer] + rest)
        for name in ("input", "input_shape", "input_dim"):
            param.ClearField(name)
    return param


# ----- filtering by NetState -------------------------------------------------------------------
def state_meets_rule(state, rule):
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def filter_net(param, state):
    """A copy of the net with only the layers that the NetState (phase, level, stages) selects."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    out.ClearField("layer")
    for layer in param.layer:
        if len(layer.include) and len(layer.exclude):
            raise ModelError(f"layer '{layer.name}': give include or exclude rules, not both")
        if len(layer.include):
            keep = any(state_meets_rule(state, r) for r in layer.include)
        else:
            keep = not any(state_meets_rule(state, r) for r in layer.exclude)
        if keep:
            out.layer.add().CopyFrom(layer)
    return out


# ----- automatic Split insertion ---------------------------------------------------------------
def split_layer_name(blob, layer, index):
    return f"{blob}_{layer}_{index}_split"


def split_blob_name(blob, layer, index, k):
    return f"{blob}_{layer}_{index}_split_{k}"


def _missing_bottom(param, li, bottom):
    """Why layer li's bottom has no producer before it: a later layer makes it (a cycle or a
    misordered file), the layer itself does, or nothing does."""
    layer = param.layer[li]
    if bottom in layer.top:
        return (f"layer '{layer.name}': bottom '{bottom}' is its own top but no earlier layer "
                f"produces it (a layer cannot feed itself; in place needs an earlier producer): "
                f"rename the top or add the layer that makes '{bottom}'")
    later = [other.name for other in param.layer[li + 1:] if bottom in other.top]
    if later:
        return (f"layer '{layer.name}': bottom '{bottom}' is produced only later, by layer "
                f"'{later[0]}': a net runs top to bottom and cannot have cycles: move "
                f"'{later[0]}' above '{layer.name}' (or fix the name)")
    return (f"layer '{layer.name}': bottom '{bottom}' is not produced by any earlier layer: "
            f"check the name, the layer order, and include/exclude phases")


def insert_splits(param):
    """Insert Split layers where one top feeds several bottoms (Caffe's names and order)."""
    producer = {}         # blob name -> (layer index, top index)
    consumers = {}        # (layer index, top index) -> count
    for li, layer in enumerate(param.layer):
        for bottom in layer.bottom:
            if bottom not in producer:
                raise ModelError(_missing_bottom(param, li, bottom))
            key = producer[bottom]
            consumers[key] = consumers.get(key, 0) + 1
        for ti, top in enumerate(layer.top):
            producer[top] = (li, ti)
    # loss weights count as a consumer
    for li, layer in enumerate(param.layer):
        for ti, w in enumerate(layer.loss_weight):
            if w != 0 and ti < len(layer.top):
                key = (li, ti)
                consumers[key] = consumers.get(key, 0) + 1
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    out.ClearField("layer")
    producer = {}
    used = {}
    for li, layer in enumerate(param.layer):
        new = caffe_pb2.LayerParameter()
        new.CopyFrom(layer)
        for bi, bottom in enumerate(layer.bottom):
            key = producer[bottom]
            if consumers.get(key, 0) > 1:
                k = used.get(key, 0)
                used[key] = k + 1
                plname = param.layer[key[0]].name
                new.bottom[bi] = split_blob_name(bottom, plname, key[1], k)
        added = out.layer.add()
        added.CopyFrom(new)
        for ti, top in enumerate(layer.top):
            producer[top] = (li, ti)
            n = consumers.get((li, ti), 0)
            if n > 1:
                split = out.layer.add()
                split.name = split_layer_name(top, layer.name, ti)
                split.type = "Split"
                split.bottom.append(top)
                for k in range(n):
                    split.top.append(split_blob_name(top, layer.name, ti, k))
                if ti < len(layer.loss_weight) and layer.loss_weight[ti] != 0:
                    split.loss_weight.append(layer.loss_weight[ti])
                    split.loss_weight.extend([0.0] * (n - 1))
                    added.loss_weight[ti] = 0
                    used[(li, ti)] = 1  # split top 0 carries the loss
    return out
