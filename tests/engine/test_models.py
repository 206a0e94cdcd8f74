"""Tests of models/ and the generated prototxt/ tree.

* prototxt/ holds exactly what ``models.write_all`` writes (byte for byte), and every file parses.
* Learnable-parameter totals, counted by an independent walker written here (not the builders):
  it follows blob shapes through the graph (conv floor / pooling ceil output sizes, Concat channels,
  flattened InnerProduct inputs) and counts the weights and biases of Convolution, InnerProduct,
  Scale, Bias and PReLU; BatchNorm's stored statistics are not learnable and are not counted.
* The same walker counts the real Caffe files (POSEIDON_CAFFE_MODELS, see tests/conftest.py; the
  legacy V1 VGG file included) and they must agree with the generated nets, layer by layer.
"""

import math
import re
from pathlib import Path

import pytest
from google.protobuf import text_format

from poseidon.engine.proto import caffe_pb2
from poseidon.models import MODELS
from poseidon.models.write_all import write_all

from tests.conftest import CAFFE_MODELS, require_caffe_models

ROOT = Path(__file__).resolve().parents[2]
PROTOTXT = ROOT / "prototxt"
REAL = CAFFE_MODELS
NET_FILES = ("train_val.prototxt", "deploy.prototxt")

DEPLOY_TOTALS = {
    "cifar10_quick": 145_578,
    "digits_quick": 145_578,
    "alexnet": 60_965_224,
    "vgg19": 143_667_240,
    "vgg19_22k": 229_052_817,
    "googlenet": 6_998_552,
    "inception_v3": 23_834_568,
    "resnet50": 25_557_032,     # same as torchvision's resnet50 (BN gamma/beta as Scale)
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "fc_heavy": 58_631_144,     # 9216*4096+4096 + 4096*4096+4096 + 4096*1000+1000
}
# train_val differs from deploy only for GoogLeNet's two auxiliary classifiers.
TRAIN_VAL_TOTALS = dict(DEPLOY_TOTALS, googlenet=13_378_280)
IMAGENET = {"alexnet", "vgg19", "vgg19_22k", "googlenet", "inception_v3", "resnet50", "resnet101",
            "resnet152"}
DATASET = {"cifar10_quick": "cifar10", "digits_quick": "digits", "vgg19_22k": "imagenet22k"}

# (our model, real file, phase, image size for Data layers without crop_size)
REAL_FILES = [
    ("resnet152", "resnet/ResNet-152-deploy.prototxt"),
    ("inception_v3", "inception/deploy_inception-v3.prototxt"),
    ("googlenet", "bvlc_googlenet/deploy.prototxt"),
    ("alexnet", "bvlc_alexnet/deploy.prototxt"),
    ("vgg19", "vgg/VGG_ILSVRC_19_layers_deploy.prototxt"),
    ("cifar10_quick", "cifar10/cifar10_quick.prototxt"),
]


# ---------------------------------------------------------------------------------------------
# Independent parameter counter
# ---------------------------------------------------------------------------------------------
V1_TYPES = {  # legacy V1LayerParameter.LayerType names -> layer type strings (what VGG needs)
    "CONVOLUTION": "Convolution", "POOLING": "Pooling", "INNER_PRODUCT": "InnerProduct",
    "RELU": "ReLU", "DROPOUT": "Dropout", "SOFTMAX": "Softmax", "LRN": "LRN", "CONCAT": "Concat",
    "SOFTMAX_LOSS": "SoftmaxWithLoss", "ACCURACY": "Accuracy", "DATA": "Data",
    "ELTWISE": "Eltwise", "SPLIT": "Split", "FLATTEN": "Flatten",
}
PASS_THROUGH = {"ReLU", "Dropout", "LRN", "Softmax", "BatchNorm", "Sigmoid", "TanH", "Power",
                "Split", "ELU", "AbsVal", "BNLL", "Exp", "Log"}
SCALAR_TOPS = {"SoftmaxWithLoss", "Accuracy", "EuclideanLoss", "SigmoidCrossEntropyLoss"}


def parse_net(path):
    net = caffe_pb2.NetParameter()
    text_format.Parse(Path(path).read_text(), net)
    return net


def _layers(net):
    if net.layer:
        return [(lp.type, lp) for lp in net.layer]
    names = caffe_pb2.V1LayerParameter.LayerType.Name
    return [(V1_TYPES[names(lp.type)], lp) for lp in net.layers]


def _active(lp, phase):
    """Phase-only NetStateRule filtering (what these files use)."""
    if lp.include:
        return any(not r.HasField("phase") or r.phase == phase for r in lp.include)
    return not any(r.HasField("phase") and r.phase == phase for r in lp.exclude)


def _two(repeated, h, w, has_hw, default):
    if has_hw:
        return h, w
    vals = list(repeated)
    if not vals:
        return default, default
    return (vals[0], vals[0]) if len(vals) == 1 else (vals[0], vals[1])


def _conv(shape, cp):
    n, c, h, w = shape
    has = lambda a, b: cp.HasField(a) or cp.HasField(b)  # noqa: E731  (Caffe: either one)
    kh, kw = _two(cp.kernel_size, cp.kernel_h, cp.kernel_w, has("kernel_h", "kernel_w"), None)
    ph, pw = _two(cp.pad, cp.pad_h, cp.pad_w, has("pad_h", "pad_w"), 0)
    sh, sw = _two(cp.stride, cp.stride_h, cp.stride_w, has("stride_h", "stride_w"), 1)
    assert all(d == 1 for d in cp.dilation), "dilation is not handled by this counter"
    g = cp.group
    assert c % g == 0 and cp.num_output % g == 0
    params = cp.num_output * (c // g) * kh * kw + (cp.num_output if cp.bias_term else 0)
    out = (n, cp.num_output, (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1)
    return params, out


def _pool_size(size, k, p, s):
    out = int(math.ceil((size + 2 * p - k) / s)) + 1
    if p > 0 and (out - 1) * s >= size + p:   # the last window must start inside the image
        out -= 1
    return out


def _pool(shape, pp):
    n, c, h, w = shape
    if pp.global_pooling:
        return (n, c, 1, 1)
    has = lambda a, b: pp.HasField(a) or pp.HasField(b)  # noqa: E731
    kh, kw = (pp.kernel_h, pp.kernel_w) if has("kernel_h", "kernel_w") else (pp.kernel_size,) * 2
    ph, pw = (pp.pad_h, pp.pad_w) if has("pad_h", "pad_w") else (pp.pad,) * 2
    sh, sw = (pp.stride_h, pp.stride_w) if has("stride_h", "stride_w") else (pp.stride,) * 2
    return (n, c, _pool_size(h, kh, ph, sh), _pool_size(w, kw, pw, sw))


def count_params(net, phase=caffe_pb2.TEST, image_hw=None):
    """(total, {layer name: learnable count}) of a NetParameter, walking blob shapes.

    ``image_hw`` gives H, W for Data layers that have no crop_size (3 channels assumed).
    """
    shapes = {}
    names = list(net.input)
    if net.input_shape:
        for name, bs in zip(names, net.input_shape):
            shapes[name] = tuple(bs.dim)
    else:
        for i, name in enumerate(names):
            shapes[name] = tuple(net.input_dim[4 * i:4 * i + 4])
    per_layer = {}
    for type_, lp in _layers(net):
        if not _active(lp, phase):
            continue
        bottoms = [shapes[b] for b in lp.bottom]
        params = 0
        if type_ == "Input":
            dims = [tuple(s.dim) for s in lp.input_param.shape]
            outs = dims if len(dims) == len(lp.top) else dims * len(lp.top)
        elif type_ == "Data":
            bs = lp.data_param.batch_size
            crop = lp.transform_param.crop_size
            hw = (crop, crop) if crop else tuple(image_hw)
            outs = [(bs, 3) + hw, (bs,)]
        elif type_ == "Convolution":
            params, out = _conv(bottoms[0], lp.convolution_param)
            outs = [out]
        elif type_ == "Pooling":
            outs = [_pool(bottoms[0], lp.pooling_param)]
        elif type_ == "InnerProduct":
            ip = lp.inner_product_param
            axis = ip.axis % len(bottoms[0])
            k = math.prod(bottoms[0][axis:])
            params = ip.num_output * k + (ip.num_output if ip.bias_term else 0)
            outs = [bottoms[0][:axis] + (ip.num_output,)]
        elif type_ in ("Scale", "Bias"):
            sp = lp.scale_param if type_ == "Scale" else lp.bias_param
            axis = sp.axis % len(bottoms[0])
            end = len(bottoms[0]) if sp.num_axes == -1 else axis + sp.num_axes
            size = math.prod(bottoms[0][axis:end])
            if type_ == "Scale":
                params = (size if len(bottoms) == 1 else 0) + (size if sp.bias_term else 0)
            else:
                params = size if len(bottoms) == 1 else 0
            outs = [bottoms[0]]
        elif type_ == "PReLU":
            params = 1 if lp.prelu_param.channel_shared else bottoms[0][1]
            outs = [bottoms[0]]
        elif type_ == "Concat":
            axis = lp.concat_param.axis if lp.concat_param.HasField("axis") else \
                (lp.concat_param.concat_dim if lp.concat_param.HasField("concat_dim") else 1)
            ref = list(bottoms[0])
            for b in bottoms[1:]:
                assert b[:axis] == tuple(ref[:axis]) and b[axis + 1:] == tuple(ref[axis + 1:]), \
                    f"{lp.name}: Concat of mismatched shapes {bottoms}"
            ref[axis] = sum(b[axis] for b in bottoms)
            outs = [tuple(ref)]
        elif type_ == "Eltwise":
            assert all(b == bottoms[0] for b in bottoms), f"{lp.name}: Eltwise shapes {bottoms}"
            outs = [bottoms[0]]
        elif type_ == "Flatten":
            outs = [(bottoms[0][0], math.prod(bottoms[0][1:]))]
        elif type_ in PASS_THROUGH:
            outs = [bottoms[0]] * len(lp.top)
        elif type_ in SCALAR_TOPS:
            outs = [()] * len(lp.top)
        else:
            raise AssertionError(f"counter does not know layer type {type_!r} ({lp.name})")
        for top, shape in zip(lp.top, outs):
            shapes[top] = tuple(shape)
        if params:
            per_layer[lp.name] = per_layer.get(lp.name, 0) + params
    return sum(per_layer.values()), per_layer


def _file(model, fname):
    return PROTOTXT / model / fname


def _image_hw(model):
    return (32, 32) if model in ("cifar10_quick", "digits_quick") else None


# ---------------------------------------------------------------------------------------------
# The counter itself, on hand-checkable nets
# ---------------------------------------------------------------------------------------------
def test_counter_on_small_nets():
    net = caffe_pb2.NetParameter()
    text_format.Parse("""
        layer { name: "data" type: "Input" top: "data"
                input_param { shape { dim: 2 dim: 3 dim: 7 dim: 7 } } }
        layer { name: "c" type: "Convolution" bottom: "data" top: "c"
                convolution_param { num_output: 4 kernel_h: 1 kernel_w: 3 pad_w: 1 } }
        layer { name: "p" type: "Pooling" bottom: "c" top: "p"
                pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
        layer { name: "bn" type: "BatchNorm" bottom: "p" top: "p" }
        layer { name: "s" type: "Scale" bottom: "p" top: "p" scale_param { bias_term: true } }
        layer { name: "fc" type: "InnerProduct" bottom: "p" top: "fc"
                inner_product_param { num_output: 5 } }
    """, net)
    total, per = count_params(net)
    # conv 4*3*1*3 + 4 = 40; pool 7x7 -> ceil((7-3)/2)+1 = 3; scale 4+4; fc 4*3*3*5 + 5 = 185
    assert per == {"c": 40, "s": 8, "fc": 185}
    assert total == 233


def test_pool_output_size_rules():
    assert _pool_size(32, 3, 0, 2) == 16        # ceil, where floor would give 15
    assert _pool_size(35, 3, 1, 1) == 35        # Inception-v3's padded AVE pools keep the size
    assert _pool_size(5, 2, 1, 2) == 3          # ceil gives 4; that window starts in padding


# ---------------------------------------------------------------------------------------------
# Generated tree
# ---------------------------------------------------------------------------------------------
def test_prototxt_tree_is_what_write_all_writes(tmp_path):
    written = write_all(tmp_path)
    expected = {p.relative_to(tmp_path).as_posix() for p in written}
    actual = {p.relative_to(PROTOTXT).as_posix() for p in PROTOTXT.rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc")}   # the package's own module
    assert actual == expected, "run `python -m poseidon.models.write_all` to regenerate prototxt/"
    stale = [rel for rel in sorted(expected)
             if (PROTOTXT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"out of date (run `python -m poseidon.models.write_all`): {stale}"


def test_write_all_is_deterministic(tmp_path):
    a = write_all(tmp_path / "a")
    b = write_all(tmp_path / "b")
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_file_parses_and_has_header(model):
    for fname in NET_FILES + ("solver.prototxt",):
        text = _file(model, fname).read_text()
        first = text.splitlines()[0]
        assert re.fullmatch(r"# Generated by models/\w+\.py; edit the builder, not this file",
                            first)
        msg = caffe_pb2.SolverParameter() if fname == "solver.prototxt" \
            else caffe_pb2.NetParameter()
        text_format.Parse(text, msg)
        if fname != "solver.prototxt":
            names = [lp.name for lp in msg.layer]
            assert names and msg.name
            assert not msg.layers and not msg.input, "generated files use the current format"


# ---------------------------------------------------------------------------------------------
# Parameter totals
# ---------------------------------------------------------------------------------------------
def test_every_model_has_an_expected_total():
    assert set(DEPLOY_TOTALS) == set(MODELS)


@pytest.mark.parametrize("model", sorted(DEPLOY_TOTALS))
def test_deploy_totals(model):
    total, _ = count_params(parse_net(_file(model, "deploy.prototxt")))
    assert total == DEPLOY_TOTALS[model]


@pytest.mark.parametrize("model", sorted(TRAIN_VAL_TOTALS))
@pytest.mark.parametrize("phase", [caffe_pb2.TRAIN, caffe_pb2.TEST])
def test_train_val_totals(model, phase):
    net = parse_net(_file(model, "train_val.prototxt"))
    total, _ = count_params(net, phase, image_hw=_image_hw(model))
    assert total == TRAIN_VAL_TOTALS[model]


def test_builders_agree_with_files():
    for name, model in MODELS.items():
        assert model.build(True) == parse_net(_file(name, "deploy.prototxt")), name


# ---------------------------------------------------------------------------------------------
# Structure of deploy, train_val and solver files
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", sorted(set(MODELS) - {"fc_heavy"}))
def test_deploy_input(model):
    net = parse_net(_file(model, "deploy.prototxt"))
    first = net.layer[0]
    assert (first.name, first.type, list(first.top)) == ("data", "Input", ["data"])
    dims = list(first.input_param.shape[0].dim)
    assert len(dims) == 4 and dims[1] == 3 and dims[0] > 0
    assert dims[2:] == ([299, 299] if model == "inception_v3" else
                        [227, 227] if model == "alexnet" else
                        [32, 32] if model in ("cifar10_quick", "digits_quick") else [224, 224])
    assert not any(lp.type in ("Data", "SoftmaxWithLoss", "Accuracy") for lp in net.layer)
    assert net.layer[-1].type == "Softmax"


@pytest.mark.parametrize("model", sorted(set(MODELS) - {"fc_heavy"}))
def test_train_val_data_and_heads(model):
    net = parse_net(_file(model, "train_val.prototxt"))
    data = [lp for lp in net.layer if lp.type == "Data"]
    assert [lp.include[0].phase for lp in data] == [caffe_pb2.TRAIN, caffe_pb2.TEST]
    dataset = DATASET.get(model, "ilsvrc12" if model in IMAGENET else model)
    for lp, split in zip(data, ("train", "test")):
        assert lp.data_param.HasField("backend")
        assert lp.data_param.backend == caffe_pb2.DataParameter.LMDB
        assert lp.data_param.source == f"data/{dataset}/{split}"
        assert list(lp.top) == ["data", "label"]
    assert any(lp.type == "SoftmaxWithLoss" for lp in net.layer)
    acc = [lp for lp in net.layer if lp.type == "Accuracy"]
    assert acc and all([r.phase for r in lp.include] == [caffe_pb2.TEST] for lp in acc)
    top_k = {lp.accuracy_param.top_k for lp in acc}
    assert (5 in top_k) == (model in IMAGENET)
    assert not any(lp.type in ("Input", "Softmax") for lp in net.layer)


def test_digits_quick_data():
    train, test = [lp for lp in parse_net(_file("digits_quick", "train_val.prototxt")).layer
                   if lp.type == "Data"]
    assert (train.data_param.batch_size, test.data_param.batch_size) == (64, 100)
    assert train.transform_param.scale == test.transform_param.scale == 0.00390625
    # Same architecture as cifar10_quick: identical layers after the data layers.
    cifar = parse_net(_file("cifar10_quick", "train_val.prototxt")).layer[2:]
    digits = parse_net(_file("digits_quick", "train_val.prototxt")).layer[2:]
    assert list(cifar) == list(digits)


@pytest.mark.parametrize("fname", NET_FILES)
def test_fc_heavy(fname):
    net = parse_net(_file("fc_heavy", fname))
    assert [(lp.name, lp.type) for lp in net.layer] == [
        ("data", "Input"), ("label", "Input"), ("fc6", "InnerProduct"), ("relu6", "ReLU"),
        ("fc7", "InnerProduct"), ("relu7", "ReLU"), ("fc8", "InnerProduct"),
        ("loss", "SoftmaxWithLoss")]
    assert list(net.layer[0].input_param.shape[0].dim) == [32, 9216]
    assert list(net.layer[1].input_param.shape[0].dim) == [32]
    _, per = count_params(net)
    assert per == {"fc6": 9216 * 4096 + 4096, "fc7": 4096 * 4096 + 4096, "fc8": 4096 * 1000 + 1000}


def _solver(model):
    sp = caffe_pb2.SolverParameter()
    text_format.Parse(_file(model, "solver.prototxt").read_text(), sp)
    return sp


@pytest.mark.parametrize("model", sorted(MODELS))
def test_solver_paths(model):
    sp = _solver(model)
    assert sp.net == "train_val.prototxt"                   # relative to the solver's folder
    assert (_file(model, "solver.prototxt").parent / sp.net).is_file()
    assert sp.snapshot_prefix == f"snapshots/{model}"
    assert sp.base_lr > 0 and sp.max_iter > 0 and sp.lr_policy
    if model != "fc_heavy":
        assert list(sp.test_iter) and sp.test_interval > 0


def test_cifar10_quick_solver():
    sp = _solver("cifar10_quick")
    assert (sp.base_lr, sp.momentum, sp.weight_decay, sp.lr_policy) == \
        (pytest.approx(0.001), pytest.approx(0.9), pytest.approx(0.004), "fixed")
    assert (sp.max_iter, list(sp.test_iter), sp.test_interval, sp.display) == \
        (4000, [100], 500, 100)


def test_digits_quick_solver():
    sp = _solver("digits_quick")
    assert (sp.base_lr, sp.momentum, sp.weight_decay) == \
        (pytest.approx(0.01), pytest.approx(0.9), pytest.approx(0.004))
    assert (sp.lr_policy, sp.gamma, sp.stepsize) == ("step", pytest.approx(0.1), 800)
    assert (sp.max_iter, sp.test_interval, list(sp.test_iter)) == (1000, 250, [4])
    assert list(sp.test_iter)[0] * 100 >= 360           # covers the ~360-image test split
    assert (sp.display, sp.snapshot, sp.random_seed) == (50, 500, 1)


@pytest.mark.parametrize("depth,blocks", [(50, 16), (101, 33), (152, 50)])
def test_resnet_structure(depth, blocks):
    net = parse_net(_file(f"resnet{depth}", "deploy.prototxt"))
    types = [lp.type for lp in net.layer]
    assert types.count("Eltwise") == blocks
    convs = [lp for lp in net.layer if lp.type == "Convolution"]
    assert all(not lp.convolution_param.bias_term for lp in convs)
    # every convolution is followed by BatchNorm then Scale(bias_term) on the same blob
    for i, lp in enumerate(net.layer):
        if lp.type == "Convolution":
            bn, sc = net.layer[i + 1], net.layer[i + 2]
            assert (bn.type, sc.type) == ("BatchNorm", "Scale")
            assert list(bn.bottom) == list(bn.top) == list(sc.top) == list(lp.top)
            assert sc.scale_param.bias_term and bn.batch_norm_param.use_global_stats


# ---------------------------------------------------------------------------------------------
# Cross-check against the real Caffe files
# ---------------------------------------------------------------------------------------------
def _real(rel):
    require_caffe_models()                    # the folder first: its absence is the usual case
    return parse_net(require_caffe_models(REAL / rel))


@pytest.mark.parametrize("model,rel", REAL_FILES)
def test_real_deploy_files_match(model, rel):
    real_total, real_per = count_params(_real(rel))
    ours_total, ours_per = count_params(parse_net(_file(model, "deploy.prototxt")))
    assert real_total == DEPLOY_TOTALS[model]
    assert ours_total == real_total
    assert ours_per == real_per            # same learnable layers, same sizes, same names


def test_real_googlenet_train_val_matches():
    real = _real("bvlc_googlenet/train_val.prototxt")
    ours = parse_net(_file("googlenet", "train_val.prototxt"))
    for phase in (caffe_pb2.TRAIN, caffe_pb2.TEST):
        real_total, real_per = count_params(real, phase)
        ours_total, ours_per = count_params(ours, phase)
        assert real_total == ours_total == 13_378_280
        assert ours_per == real_per


def test_real_cifar10_quick_train_test_matches():
    real = _real("cifar10/cifar10_quick_train_test.prototxt")
    ours = parse_net(_file("cifar10_quick", "train_val.prototxt"))
    assert count_params(real, caffe_pb2.TRAIN, (32, 32)) == \
        count_params(ours, caffe_pb2.TRAIN, (32, 32))
