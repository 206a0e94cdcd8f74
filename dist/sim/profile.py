"""Profiles for `poseidon simulate`: per-layer compute times and the facts the book needs.

A profile is a JSON file that describes one training step of a model on one device:

    {"model": ..., "batch": K, "source": "how the times were obtained",
     "layers": [{"name", "type", "forward_ms", "backward_ms", "flops_forward", "flops_backward"}, ...],
     "description": <dist.book.describe_net format: synced layers with M, N, K, sfb, params>}

In memory the description's layers and parameters are records (dist/coord/records.py);
load_profile and write_profile convert them from and to the file's JSON objects.

Why a file: the paper's figures were taken on a Titan X we do not have, so the profiles shipped in
dist/sim/profiles/ take a measured single-GPU throughput (img/s: the paper's for its Caffe models, a
figure with its stated source for the others) and apportion the step time over the layers by their FLOPs. The shapes come from walking the prototxt (no arrays are allocated, so
VGG19-22K costs nothing to describe); a profile measured with the engine on this machine
(`poseidon simulate --measure`) uses the real Net and `describe_net` instead.
"""
import json
import math
import os
from importlib import resources

from poseidon.engine import prototxt
from poseidon.engine.errors import PoseidonError

from ..coord.records import LayerRecord, ParamRecord, description_from_wire, description_to_wire

PROFILE_DIR = str(resources.files(__package__) / "profiles")   # package data; wheels install unzipped

# The paper's single-GPU Caffe figures (Titan X, as the Poseidon paper reports them):
# model -> (batch per node, img/s).
PAPER_SINGLE_GPU = {"vgg19": (32, 35.5), "vgg19_22k": (32, 34.2), "googlenet": (128, 257.0)}

# Models the paper did not time in Caffe: model -> (batch per node, img/s, where the rate is from).
# Each rate is a published single-GPU training figure taken as it is, not scaled to a Titan X or
# to Caffe (any such factor would be a guess); a slower device only makes the network matter less.
# ResNet-152: 16 images forward and backward in 366.97 ms on a Maxwell GTX Titan X (Torch with
# cuDNN 5; the cnn-benchmarks tables of J. Johnson), taken as the same rate at batch 32. The
# same tables have VGG19 at 49.5 img/s where the paper's Caffe had 35.5, so Caffe may have been
# slower here too. AlexNet: the 2015 paper's own Table 2, 0.96 s an iteration at batch 256 (the
# Caffe of its K20-era GPUs), since only that paper trained it.
# Inception-v3: the paper timed it under TensorFlow only, 43.2 img/s on its Titan X.
# cifar10_quick: no figure of its era was found; the rate is this project's engine on one H100.
OTHER_SINGLE_GPU = {
    "resnet152": (32, 16 / 0.36697, "GTX Titan X (Maxwell), Torch + cuDNN 5, 366.97 ms for "
                                    "forward and backward of 16 images (cnn-benchmarks)"),
    "alexnet": (256, 256 / 0.96, "the 2015 paper's own Table 2: 0.96 s an iteration at batch "
                                 "256, Caffe on the GPUs of its time"),
    "inception_v3": (32, 43.2, "the paper's own single-node figure: TensorFlow on its Titan X, "
                               "batch 32"),
    "cifar10_quick": (100, 9263.0, "this project's engine (CuPy) training on one H100 at batch "
                                   "100, docs/performance.md; no figure of the paper's era found"),
}

# Shipped profiles whose net is not prototxt/<name>/deploy.prototxt: the builder's variant, as the
# paper counted the model. Inception-v3 with its auxiliary head (27.2 M parameters, not 23.8 M).
BUILT_VARIANTS = {"inception_v3": {"aux_head": True}}

_SAME_SHAPE = {"ReLU", "Dropout", "LRN", "Softmax", "Sigmoid", "TanH", "BatchNorm", "Scale",
               "Split", "PReLU", "ELU", "Power", "AbsVal", "BNLL", "Exp", "Log"}


class ProfileError(PoseidonError):
    pass


def _pair(values, default):
    values = list(values)
    if not values:
        return default, default
    return (values[0], values[-1]) if len(values) > 1 else (values[0], values[0])


def _conv_out(size, k, pad, stride, dil=1):
    return (size + 2 * pad - (dil * (k - 1) + 1)) // stride + 1


def _pool_out(size, k, pad, stride):
    out = int(math.ceil((size + 2 * pad - k) / stride)) + 1   # Caffe rounds pooling up
    if pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def walk_shapes(param, source="<net>"):
    """[(layer proto, bottom shapes, top shapes, param shapes)] for a deploy NetParameter.

    Supports the layer types of the paper's models (Input, Convolution, Pooling, InnerProduct,
    Concat, Eltwise, Flatten and the shape-preserving ones); anything else is one clear error."""
    shapes, rows = {}, []
    for lp in param.layer:
        bottoms = []
        for b in lp.bottom:
            if b not in shapes:
                raise ProfileError(f"{source}: layer '{lp.name}' reads '{b}', which no layer "
                                   f"produced: give a deploy file whose input is an Input layer")
            bottoms.append(shapes[b])
        tops, params = layer_shapes(lp, bottoms, source)
        for name, shape in zip(lp.top, tops):
            shapes[name] = tuple(int(v) for v in shape)
        rows.append((lp, bottoms, tops, params))
    return rows


def layer_shapes(lp, bottoms, source="<net>"):
    """(top shapes, param shapes) of one layer whose inputs have the shapes `bottoms`."""
    t = lp.type
    params = []
    if t == "Input":
        tops = [tuple(s.dim) for s in lp.input_param.shape]
        if len(tops) == 1 and len(lp.top) > 1:
            tops = tops * len(lp.top)
    elif t == "Convolution":
        tops, params = _conv_shapes(lp.convolution_param, bottoms[0])
    elif t == "Pooling":
        tops = _pool_shapes(lp.pooling_param, bottoms[0])
    elif t == "InnerProduct":
        ip = lp.inner_product_param
        b = bottoms[0]
        axis = ip.axis if ip.HasField("axis") else 1
        n_in = int(math.prod(b[axis:]))
        tops = [tuple(b[:axis]) + (ip.num_output,)]
        params = [(ip.num_output, n_in)] + ([(ip.num_output,)] if ip.bias_term else [])
    elif t == "Concat":
        axis = lp.concat_param.axis if lp.concat_param.HasField("axis") else 1
        s = list(bottoms[0])
        s[axis] = sum(b[axis] for b in bottoms)
        tops = [tuple(s)]
    elif t == "Eltwise" or t in _SAME_SHAPE:
        tops = [bottoms[0]] * max(1, len(lp.top))
        if t == "Scale" and lp.scale_param.bias_term:
            params = [(bottoms[0][1],), (bottoms[0][1],)]
        elif t == "Scale":
            params = [(bottoms[0][1],)]
        elif t == "PReLU":
            params = [(bottoms[0][1],)]
    elif t == "Flatten":
        b = bottoms[0]
        tops = [(b[0], int(math.prod(b[1:])))]
    else:
        raise ProfileError(f"{source}: layer '{lp.name}' has type '{t}', which the simulator's "
                           f"shape walker does not know: measure it instead (--measure)")
    return tops, params


def _conv_shapes(cp, bottom):
    """(top shapes, param shapes) of a Convolution with settings `cp` on an NCHW `bottom`."""
    n, c, h, w = bottom
    kh, kw = (cp.kernel_h, cp.kernel_w) if cp.kernel_h else _pair(cp.kernel_size, 1)
    ph, pw = (cp.pad_h, cp.pad_w) if cp.pad_h or cp.pad_w else _pair(cp.pad, 0)
    sh, sw = (cp.stride_h, cp.stride_w) if cp.stride_h else _pair(cp.stride, 1)
    dh, dw = _pair(cp.dilation, 1)
    g = cp.group or 1
    tops = [(n, cp.num_output, _conv_out(h, kh, ph, sh, dh), _conv_out(w, kw, pw, sw, dw))]
    params = [(cp.num_output, c // g, kh, kw)] + ([(cp.num_output,)] if cp.bias_term else [])
    return tops, params


def _pool_shapes(pp, bottom):
    """The top shapes of a Pooling with settings `pp` on an NCHW `bottom`."""
    n, c, h, w = bottom
    if pp.global_pooling:
        return [(n, c, 1, 1)]
    kh, kw = (pp.kernel_h, pp.kernel_w) if pp.kernel_h else (pp.kernel_size,) * 2
    ph, pw = (pp.pad_h, pp.pad_w) if pp.pad_h or pp.pad_w else (pp.pad,) * 2
    sh, sw = (pp.stride_h, pp.stride_w) if pp.stride_h else (pp.stride or 1,) * 2
    return [(n, c, _pool_out(h, kh, ph, sh), _pool_out(w, kw, pw, sw))]


def layer_flops(lp, bottoms, tops, first_with_params):
    """(forward, backward) FLOPs of one layer; GEMM layers count 2 per multiply-add, the backward
    pass doing the weight gradient plus (except the first layer with parameters, whose input
    needs no gradient) the data gradient. Other layers count one FLOP per output element, so
    they get a small share of the time."""
    t = lp.type
    if t == "Convolution":
        n, cout, ho, wo = tops[0]
        cin = bottoms[0][1]
        cp = lp.convolution_param
        kh, kw = (cp.kernel_h, cp.kernel_w) if cp.kernel_h else _pair(cp.kernel_size, 1)
        fwd = 2.0 * n * cout * (cin // (cp.group or 1)) * kh * kw * ho * wo
        return fwd, fwd * (1 if first_with_params else 2)
    if t == "InnerProduct":
        fwd = 2.0 * math.prod(bottoms[0])
        fwd *= tops[0][-1]
        return fwd, fwd * (1 if first_with_params else 2)
    elems = float(sum(math.prod(s) for s in tops)) if tops else 0.0
    return elems, elems


def describe_from_shapes(param, source="<net>"):
    """(per-layer rows, a description in dist.book.describe_net's format, its layers and
    parameters as records) from a deploy file."""
    rows = walk_shapes(param, source)
    layers, params, out_layers = [], [], []
    seen_params = False
    for li, (lp, bottoms, tops, pshapes) in enumerate(rows):
        ff, bf = layer_flops(lp, bottoms, tops, first_with_params=bool(pshapes) and not seen_params)
        seen_params = seen_params or bool(pshapes)
        layers.append({"name": lp.name, "type": lp.type, "flops_forward": ff,
                       "flops_backward": bf})
        if not pshapes:
            continue
        specs = list(lp.param)
        pids = []
        for bi, shape in enumerate(pshapes):
            lr = specs[bi].lr_mult if bi < len(specs) and specs[bi].HasField("lr_mult") else 1.0
            dm = specs[bi].decay_mult if bi < len(specs) and specs[bi].HasField("decay_mult") \
                else 1.0
            pid = len(params)
            params.append(ParamRecord(id=pid, name=f"{lp.name}.{bi}", layer=li, owner=(li, bi),
                                      shape=tuple(shape), count=int(math.prod(shape)),
                                      lr_mult=float(lr), decay_mult=float(dm), shared=False,
                                      synced=lr != 0))
            if lr != 0:
                pids.append(pid)
        if not pids:
            continue
        M = pshapes[0][0]
        N = int(math.prod(pshapes[0][1:])) if len(pshapes[0]) > 1 else 1
        K = int(bottoms[0][0]) if bottoms else 1
        if lp.type == "InnerProduct":
            ip = lp.inner_product_param
            axis = ip.axis if ip.HasField("axis") else 1
            K = int(math.prod(bottoms[0][:axis]))
        out_layers.append(LayerRecord(
            index=li, name=lp.name, type=lp.type, M=int(M), N=N, K=K,
            sfb=lp.type == "InnerProduct" and any(params[p].owner[1] == 0 for p in pids),
            params=tuple(pids), shapes=tuple(params[p].shape for p in pids)))
    desc = {"net": param.name, "dtype": "float32", "iter_size": 1, "layers": out_layers,
            "params": params}
    return layers, desc


def profile_from_throughput(model_file, img_per_s, source_note, model=None):
    """A profile whose step time is batch / img_per_s, apportioned over the layers by FLOPs."""
    return profile_from_net(prototxt.read_net(model_file), img_per_s, source_note, model,
                            source=model_file)


def profile_from_net(param, img_per_s, source_note, model=None, source="<net>"):
    """profile_from_throughput for a NetParameter already in memory (a builder's net)."""
    layers, desc = describe_from_shapes(param, source)
    rows = walk_shapes(param, source)
    batch = rows[0][2][0][0] if rows and rows[0][2] else 1
    step_ms = 1e3 * batch / img_per_s
    total = sum(r["flops_forward"] + r["flops_backward"] for r in layers)
    for r in layers:
        r["forward_ms"] = step_ms * r["flops_forward"] / total
        r["backward_ms"] = step_ms * r["flops_backward"] / total
    return {"model": model or param.name, "batch": int(batch), "img_per_s": img_per_s,
            "step_ms": step_ms, "source": source_note, "layers": layers, "description": desc}


def paper_profile(name, prototxt_root):
    """The shipped profile for one of the paper's models, rebuilt from its deploy file."""
    batch, rate = PAPER_SINGLE_GPU[name]
    note = (f"paper's single-GPU Caffe figure ({rate} img/s at batch {batch}, Titan X); per-layer "
            f"times apportioned by FLOPs (GEMM layers 2 per multiply-add, others 1 per element)")
    path = os.path.join(prototxt_root, name, "deploy.prototxt")
    return profile_from_throughput(path, rate, note, model=name)


def shipped_profile(name, prototxt_root):
    """The shipped profile of `name`, rebuilt from its deploy file (or, for BUILT_VARIANTS, from
    the builder's variant): the paper's figure when the paper has one, else the rate
    OTHER_SINGLE_GPU states with its source."""
    if name in PAPER_SINGLE_GPU:
        return paper_profile(name, prototxt_root)
    batch, rate, where = OTHER_SINGLE_GPU[name]
    note = (f"{rate:.1f} img/s ({where}); per-layer times apportioned by FLOPs (GEMM layers 2 "
            f"per multiply-add, others 1 per element)")
    if name in BUILT_VARIANTS:
        from poseidon.models import MODELS
        net = MODELS[name].build(deploy=True, **BUILT_VARIANTS[name])
        prof = profile_from_net(net, rate, note, model=name, source=f"models: {name}")
    else:
        path = os.path.join(prototxt_root, name, "deploy.prototxt")
        prof = profile_from_throughput(path, rate, note, model=name)
    if prof["batch"] != batch:
        raise ProfileError(f"{name}: the net's batch is {prof['batch']}, the rate's {batch}")
    return prof


def load_profile(path_or_name):
    """A profile from a JSON file, or by model name from the shipped dist/sim/profiles/."""
    path = path_or_name
    if not os.path.exists(path):
        path = os.path.join(PROFILE_DIR, f"{path_or_name}.json")
    if not os.path.exists(path):
        known = ", ".join(shipped_profiles()) or "none"
        raise ProfileError(f"no profile '{path_or_name}': give a JSON file from "
                           f"`poseidon simulate --write-profile` or one of the shipped models "
                           f"({known})")
    try:
        with open(path) as f:
            prof = json.load(f)
    except (OSError, ValueError) as e:
        raise ProfileError(f"{path}: not a readable profile: {e}") from None
    for key in ("layers", "description"):
        if key not in prof:
            raise ProfileError(f"{path}: profile lacks '{key}': regenerate it with "
                               f"`poseidon simulate --write-profile`")
    n_layers = len(prof["layers"])
    for rec in prof["description"].get("layers", []):
        if not 0 <= rec.get("index", -1) < n_layers:
            raise ProfileError(f"{path}: synced layer '{rec.get('name')}' has index "
                               f"{rec.get('index')!r}, outside the {n_layers} timed layers: "
                               f"regenerate the profile")
    try:
        prof["description"] = description_from_wire(prof["description"])
    except (KeyError, TypeError) as e:
        raise ProfileError(f"{path}: a layer or parameter of its description is not readable "
                           f"({type(e).__name__}: {e}): regenerate the profile") from None
    for i, r in enumerate(prof["layers"]):
        for key in ("forward_ms", "backward_ms"):
            v = r.get(key)
            if not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v):
                raise ProfileError(f"{path}: layer {i} ('{r.get('name')}') has {key}={v!r}: "
                                   f"give a non-negative number of milliseconds")
    return prof


def shipped_profiles():
    if not os.path.isdir(PROFILE_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def write_profile(prof, path):
    with open(path, "w") as f:
        json.dump(dict(prof, description=description_to_wire(prof["description"])), f, indent=1)
        f.write("\n")
