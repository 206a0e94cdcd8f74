"""Net construction: upgrades, filtering, splits, in-place layers, sharing, weights, clear errors."""
import numpy
import pytest

from poseidon.engine import TEST, TRAIN, ModelError
from poseidon.engine.net import Net
from poseidon.engine.prototxt import parse_net_text

from tests.conftest import CAFFE_MODELS, needs_caffe_models

SMALL = """
name: "small"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 6 } shape { dim: 4 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc"
        include { phase: TEST } }
"""


def small_net(phase=TRAIN, text=SMALL, **kw):
    return Net(parse_net_text(text), phase, dtype=numpy.float64, **kw)


def test_phase_filtering_and_outputs():
    train, test = small_net(TRAIN), small_net(TEST)
    assert "acc" not in train.layer_names and "acc" in test.layer_names
    assert train.output_names == ["loss"]
    assert test.output_names == ["acc", "loss"]          # alphabetical, as Caffe numbers them
    assert small_net("TRAIN").phase == TRAIN


def test_split_inserted_with_caffe_names():
    net = small_net(TEST)
    assert "ip2_ip2_0_split" in net.layer_names
    assert "ip2_ip2_0_split_0" in net.blobs and "ip2_ip2_0_split_1" in net.blobs
    assert "label_data_1_split" in net.layer_names


def test_in_place_shares_blob():
    net = small_net()
    i = net.layer_names.index("relu1")
    assert net.top_vecs[i][0] is net.bottom_vecs[i][0]


def test_gradients_of_whole_net_match_finite_differences():
    net = small_net()
    rs = numpy.random.RandomState(0)
    net.blobs["data"].data[...] = rs.standard_normal((4, 6))
    net.blobs["label"].data[...] = [0, 1, 2, 1]
    net.ClearParamDiffs()
    net.Forward()
    net.Backward()
    w = net.params["ip1"][0]
    analytic = w.diff.copy()
    eps = 1e-6
    for idx in [(0, 0), (2, 3), (4, 5)]:
        keep = w.data[idx]
        w.data[idx] = keep + eps
        plus = net.Forward()
        w.data[idx] = keep - eps
        minus = net.Forward()
        w.data[idx] = keep
        assert abs((plus - minus) / (2 * eps) - analytic[idx]) < 1e-6


def test_backward_through_calls_each_layer_once_and_hooks_fire():
    net = small_net()
    seen = []
    net.Forward()
    net.Backward(after_layer=seen.append)
    assert seen == list(reversed(range(len(net.layers))))


# SMALL with a second InnerProduct sharing ip1's weight (by the name "w")
SHARED = SMALL.replace('top: "ip1"\n        inner_product_param',
                       'top: "ip1"\n        param { name: "w" } inner_product_param') + """
layer { name: "ip1b" type: "InnerProduct" bottom: "data" top: "ip1b" param { name: "w" }
        inner_product_param { num_output: 5 bias_term: false } }
layer { name: "sil" type: "EuclideanLoss" bottom: "ip1b" bottom: "ip1" top: "l2" }
"""


def test_param_sharing_by_name():
    net = small_net(TRAIN, SHARED)
    assert net.params["ip1"][0] is net.params["ip1b"][0]
    assert sum(b is net.params["ip1"][0] for b in net.learnable_params) == 1


def _filled(net, seed=0):
    rs = numpy.random.RandomState(seed)
    net.blobs["data"].data[...] = rs.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rs.randint(0, 3, net.blobs["label"].shape)
    net.Forward()
    return net


def _ip_grad(net, name):
    """G^T X of an InnerProduct from its top diff and bottom data, by numpy (the reference)."""
    li = net.layer_names.index(name)
    g, x = net.layers[li].sufficient_factors(net.bottom_vecs[li], net.top_vecs[li])
    return g.T @ x


def test_cleared_diffs_are_written_over_once_then_added_to():
    """After ClearParamDiffs the one layer owning a weight writes its gradient over the zeros;
    a second backward (iter_size 2) and a diff nobody cleared are added to, as Caffe does."""
    net = _filled(small_net())
    w = net.params["ip2"][0]
    net.ClearParamDiffs()
    assert w.diff_fresh
    net.Backward()
    assert not w.diff_fresh
    once = w.diff.copy()
    numpy.testing.assert_allclose(once, _ip_grad(net, "ip2"), rtol=1e-12)
    net.Backward()                                     # the second pass of iter_size 2
    numpy.testing.assert_allclose(w.diff, 2 * once, rtol=1e-12)
    w.diff[...] = 1.0                                  # not cleared: the gradient adds to it
    net.Backward()
    numpy.testing.assert_allclose(w.diff, 1.0 + once, rtol=1e-12)


def test_shared_weight_gets_every_sharers_gradient():
    net = _filled(small_net(TRAIN, SHARED))
    shared = net.params["ip1"][0]
    net.ClearParamDiffs()
    assert not shared.diff_fresh                       # two writers: the second must add
    assert net.params["ip2"][0].diff_fresh
    net.Backward()
    numpy.testing.assert_allclose(shared.diff, _ip_grad(net, "ip1") + _ip_grad(net, "ip1b"),
                                  rtol=1e-10)


def test_save_and_copy_from_roundtrip(tmp_path):
    a, b = small_net(), small_net()
    path = str(tmp_path / "w.caffemodel")
    a.save(path)
    b.copy_from(path)
    for name in a.params:
        for x, y in zip(a.params[name], b.params[name]):
            numpy.testing.assert_allclose(x.data, y.data, rtol=1e-7)


def test_weights_with_wrong_shape_name_the_layer(tmp_path):
    a = small_net()
    path = str(tmp_path / "w.caffemodel")
    a.save(path)
    other = small_net(TRAIN, SMALL.replace("num_output: 5", "num_output: 7"))
    with pytest.raises(ModelError, match="ip1"):
        other.copy_from(path)


@pytest.mark.parametrize("text, pattern", [
    ('layer { name: "a" type: "NoSuchType" top: "x" }', "unknown layer type 'NoSuchType'"),
    ('layer { name: "a" type: "ReLU" bottom: "nope" top: "x" }', "bottom 'nope'"),
    ('layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 2 } } }\n'
     'layer { name: "b" type: "Input" top: "x" input_param { shape { dim: 2 } } }',
     "multiple sources"),
])
def test_bad_nets_give_clear_errors(text, pattern):
    with pytest.raises(ModelError, match=pattern):
        small_net(TRAIN, text)


def test_errors_from_files_name_file_and_line(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text('name: "x"\nlayer { name: "in" type: "Input" top: "d" '
                    'input_param { shape { dim: 2 dim: 3 } } }\n'
                    'layer { name: "odd" type: "Bogus" bottom: "d" top: "e" }\n')
    with pytest.raises(ModelError, match=r"bad.prototxt:3: .*odd.*Bogus"):
        Net(str(path), TEST)
    path.write_text('name: "x"\nlayer { name: "in" type: "Input" top: "d"\n  input_parm { } }\n')
    with pytest.raises(ModelError, match=r"bad.prototxt:3:\d+: .*input_parm"):
        Net(str(path), TEST)


def test_v1_upgrade_and_net_level_input():
    text = """
name: "v1"
input: "data"
input_dim: 2 input_dim: 3 input_dim: 4 input_dim: 4
layers { name: "conv" type: CONVOLUTION bottom: "data" top: "conv" blobs_lr: 2 weight_decay: 0
         convolution_param { num_output: 2 kernel_size: 3 } }
layers { name: "relu" type: RELU bottom: "conv" top: "conv" }
"""
    net = Net(parse_net_text(text), TEST)
    assert net.layer_names[0] == "input" and net.blobs["data"].shape == (2, 3, 4, 4)
    assert net.blobs["conv"].shape == (2, 2, 2, 2)
    spec = net.learnable_param_specs[0]
    assert spec.lr_mult == 2 and spec.decay_mult == 0


def test_stage_and_level_rules():
    text = """
layer { name: "in" type: "Input" top: "d" input_param { shape { dim: 1 dim: 2 } } }
layer { name: "a" type: "ReLU" bottom: "d" top: "a" include { stage: "deploy" } }
layer { name: "b" type: "ReLU" bottom: "d" top: "b" include { min_level: 2 } }
layer { name: "c" type: "ReLU" bottom: "d" top: "c" exclude { phase: TEST } }
"""
    def names(*args, **kw):
        return [n for n in Net(parse_net_text(text), *args, **kw).layer_names if "split" not in n]

    assert names(TEST) == ["in"]
    assert names(TEST, stages=["deploy"], level=3) == ["in", "a", "b"]
    assert names(TRAIN) == ["in", "c"]


DEPLOYS = ["cifar10/cifar10_quick.prototxt", "bvlc_alexnet/deploy.prototxt",
           "bvlc_googlenet/deploy.prototxt", "vgg/VGG_ILSVRC_19_layers_deploy.prototxt",
           "resnet/ResNet-152-deploy.prototxt", "inception/deploy_inception-v3.prototxt"]
TOTALS = {"cifar10/cifar10_quick.prototxt": 145578, "bvlc_alexnet/deploy.prototxt": 60965224,
          "bvlc_googlenet/deploy.prototxt": 6998552,
          "vgg/VGG_ILSVRC_19_layers_deploy.prototxt": 143667240,
          "resnet/ResNet-152-deploy.prototxt": 60192808,
          "inception/deploy_inception-v3.prototxt": 23834568}


@needs_caffe_models
@pytest.mark.parametrize("name", DEPLOYS)
def test_real_deploy_files_build_with_caffe_parameter_counts(name):
    net = Net(str(CAFFE_MODELS / name), TEST)
    learnable, _ = net.param_counts()
    assert learnable == TOTALS[name]
    net.shutdown()


BN_SCALE = """
name: "bn_scale"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 5 dim: 5 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: 3 weight_filler { type: "gaussian" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv"
        scale_param { bias_term: true filler { type: "gaussian" } bias_filler { type: "gaussian" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "bn2" type: "BatchNorm" bottom: "conv" top: "bn2" }
layer { name: "scale2" type: "Scale" bottom: "bn2" top: "scale2"
        scale_param { filler { type: "gaussian" } } }
layer { name: "ip" type: "InnerProduct" bottom: "scale2" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _bn_scale_net(monkeypatch, paired, text=BN_SCALE):
    """The net of `text` with the same weights and data every time; its BatchNorm + Scale pairs
    made (as Net does) or not (the two layers apart)."""
    from poseidon.engine import rng
    with monkeypatch.context() as patch:
        if not paired:
            patch.setattr(Net, "_pair_batchnorm_scale", lambda self: None)
        rng.seed(5)
        net = small_net(text=text)
    rs = numpy.random.RandomState(2)
    net.blobs["data"].data[...] = rs.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rs.randint(0, 3, 4)
    return net


def _bn_scale_run(monkeypatch, paired, text=BN_SCALE):
    net = _bn_scale_net(monkeypatch, paired, text)
    out = []
    for _ in range(2):
        net.ClearParamDiffs()
        out.append(net.Forward())
        net.Backward()
        out.append([b.diff.copy() for b in net.learnable_params])
        out.append(net.blobs["conv"].diff.copy())
    return net, out


BN_SCALE_VARIANTS = {
    "batch statistics": BN_SCALE,
    "global statistics": BN_SCALE.replace('type: "BatchNorm" bottom: "conv" top: "conv" }',
                                          'type: "BatchNorm" bottom: "conv" top: "conv" '
                                          'batch_norm_param { use_global_stats: true } }'),
    "frozen scale": BN_SCALE.replace('top: "conv"\n        scale_param { bias_term: true',
                                     'top: "conv" param { lr_mult: 0 } param { lr_mult: 0 }\n'
                                     '        scale_param { bias_term: true'),
}


@pytest.mark.parametrize("variant", sorted(BN_SCALE_VARIANTS))
def test_scale_in_place_after_batchnorm_pairs_with_it(monkeypatch, variant):
    """A Scale run in place on a BatchNorm's output (itself in place) folds into it: the
    BatchNorm's forward writes the pair's output in one pass (keeping x - mean, not x-hat) and
    the Scale's forward does nothing; in backward the Scale leaves its input gradient to the
    BatchNorm, handing over the per-channel sums of its own gradients (one formula for both).
    Against the two layers apart, each computing Caffe's formulas: the losses and every
    gradient equal to float rounding (the same formulas, factored). A Scale not in place is
    left alone."""
    text = BN_SCALE_VARIANTS[variant]
    net, paired = _bn_scale_run(monkeypatch, True, text)
    pair = net.layer_dict["scale"].pair
    assert pair is net.layer_dict["bn"].pair and pair.scale._temp is None
    assert pair.folds and pair.holds_centred and not pair.prescaled   # folded, and consumed
    assert not hasattr(net.layer_dict["scale2"], "pair")  # not in place: it reads its bottom
    plain_net, plain = _bn_scale_run(monkeypatch, False, text)
    assert not hasattr(plain_net.layer_dict["scale"], "pair")
    assert plain_net.layer_dict["scale"]._temp is not None
    if variant == "frozen scale":
        assert not any(plain_net.layer_dict["scale"].param_propagate_down)
    owner = {id(blob): name for name, layer in zip(net.layer_names, net.layers)
             for blob in layer.blobs}
    names = [owner[id(blob)] for blob in net.learnable_params]
    assert len(paired) == len(plain) == 6
    assert not hasattr(plain_net.layer_dict["bn"], "pair")
    for k in range(0, 6, 3):
        numpy.testing.assert_allclose(paired[k], plain[k], rtol=1e-12)   # the loss
        for name, a, b in zip(names, paired[k + 1], plain[k + 1]):
            numpy.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-13, err_msg=name)
        numpy.testing.assert_allclose(paired[k + 2], plain[k + 2], rtol=1e-9, atol=1e-13)
        assert numpy.abs(plain[k + 2]).max() > 1e-3          # a gradient reached below the pair


def test_batchnorm_after_a_folded_forward_gives_xhat_and_its_own_gradient(monkeypatch):
    """After a folded forward the BatchNorm keeps x - mean, not x-hat: normalized() still gives
    x-hat, and its own backward (run without the Scale's sums, as when the Scale passes no
    gradient down) still gives Caffe's input gradient for its top gradient."""
    nets = [_bn_scale_net(monkeypatch, paired) for paired in (True, False)]
    for net in nets:
        net.Forward()
    folded, plain = nets[0].layer_dict["bn"].pair, nets[1].layer_dict["bn"]
    assert folded.holds_centred and not hasattr(plain, "pair")
    numpy.testing.assert_allclose(folded.normalized(), plain.normalized(), rtol=1e-12,
                                  atol=1e-14)
    dy = numpy.random.RandomState(7).standard_normal(nets[0].blobs["conv"].shape)
    grads = []
    for net in nets:
        li = net.layer_names.index("bn")
        blob = net.top_vecs[li][0]
        blob.diff[...] = dy
        net.layers[li].backward(net.top_vecs[li], [True], net.bottom_vecs[li])
        grads.append(blob.diff.copy())
    numpy.testing.assert_allclose(grads[0], grads[1], rtol=1e-10, atol=1e-13)
    assert numpy.abs(grads[1]).max() > 1e-3


def test_a_forward_that_stops_at_a_folding_batchnorm_leaves_its_own_output(monkeypatch):
    """Net.Forward(end=the BatchNorm) and ForwardLayer(the BatchNorm) alone leave x-hat in the
    blob, as the two layers apart do, and a forward resumed at the Scale then gives the pair's
    output; the whole forward folds (the Scale's forward has nothing left to do)."""
    folded, plain = nets = [_bn_scale_net(monkeypatch, paired) for paired in (True, False)]
    bn, scale = folded.layer_names.index("bn"), folded.layer_names.index("scale")
    pair = folded.layers[bn].pair
    assert scale == bn + 1 and folded.layers[scale].pair is pair and pair.folds
    for net in nets:
        net.Forward(end=bn)
    numpy.testing.assert_allclose(folded.blobs["conv"].data, plain.blobs["conv"].data,
                                  rtol=1e-12, atol=1e-14)
    assert not pair.prescaled
    for net in nets:
        net.Forward(start=scale)
    numpy.testing.assert_allclose(folded.blobs["conv"].data, plain.blobs["conv"].data,
                                  rtol=1e-12, atol=1e-14)
    for net in nets:                     # one layer at a time, as a user stepping through
        for li in range(len(net.layers)):
            net.ForwardLayer(li)
            if li == bn:
                expected = plain.layers[bn].normalized()
                numpy.testing.assert_allclose(net.blobs["conv"].data.reshape(expected.shape),
                                              expected, rtol=1e-12, atol=1e-14)
    numpy.testing.assert_allclose(folded.blobs["conv"].data, plain.blobs["conv"].data,
                                  rtol=1e-12, atol=1e-14)
    folded.Forward()
    assert pair.holds_centred and not pair.prescaled
