"""The BatchNorm + Scale pair (engine/layers/batchnorm_scale.py): the two layers stay independent,
the pair holds the fold's state, and a forward that stops at the BatchNorm still gives x-hat.

The numbers of a folded net against the same net unpaired are in tests/engine/test_net.py."""
import numpy

from poseidon.engine.blob import Blob
from poseidon.engine.layer import Layer
from poseidon.engine.layers.batchnorm_scale import BatchNormScalePair, PairedBatchNorm, PairedScale
from poseidon.engine.layers.normalization import BatchNormLayer
from poseidon.engine.layers.scale_bias import ScaleLayer
from tests.engine.harness import make_layer
from tests.engine.test_net import _bn_scale_net

SCALE = ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
         'bias_filler { type: "gaussian" } }')
EPS = 1e-5          # BatchNorm's default


def _x_hat(x):
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    var = ((x - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True)
    return (x - mean) / numpy.sqrt(var + EPS), var


def _run_in_place(norm, scale, x, dy):
    """BatchNorm then Scale on one blob (both in place), forward and backward: (y, dx)."""
    blob = Blob(x.shape, numpy.float64)
    blob.data[...] = x
    for layer in (norm, scale):
        layer.reshape([blob], [blob])
        layer.forward([blob], [blob])
    y = blob.data.copy()
    blob.diff[...] = dy
    for layer in (scale, norm):
        layer.backward([blob], [True], [blob])
    return y, blob.diff.copy()


def _layers(x):
    norm, scale = make_layer('type: "BatchNorm"'), make_layer(SCALE)
    blob = Blob(x.shape, numpy.float64)
    for layer in (norm, scale):
        layer.setup([blob], [blob])
    return norm, scale


def test_a_batchnorm_and_a_scale_in_place_work_alone_and_as_a_pair():
    """Unpaired, the two plain layers run in place one after the other give Caffe's numbers
    (the Scale keeping its own copy of its input), and the pair made of two such layers gives
    the same to float rounding, its members run as a Net runs them."""
    rs = numpy.random.RandomState(3)
    x = rs.standard_normal((4, 3, 5, 2)) * 2 + 0.5
    dy = rs.standard_normal(x.shape)
    norm, scale = _layers(x)
    gamma, beta = (b.data.reshape(1, -1, 1, 1).copy() for b in scale.blobs)
    y, dx = _run_in_place(norm, scale, x, dy)

    x_hat, var = _x_hat(x)
    numpy.testing.assert_allclose(y, gamma * x_hat + beta, rtol=1e-12, atol=1e-13)
    d_hat = dy * gamma
    expected_dx = (d_hat - d_hat.mean(axis=(0, 2, 3), keepdims=True)
                   - x_hat * (d_hat * x_hat).mean(axis=(0, 2, 3), keepdims=True)) \
        / numpy.sqrt(var + EPS)
    numpy.testing.assert_allclose(dx, expected_dx, rtol=1e-9, atol=1e-12)
    numpy.testing.assert_allclose(scale.blobs[0].diff, (dy * x_hat).sum(axis=(0, 2, 3)),
                                  rtol=1e-10)
    numpy.testing.assert_allclose(scale.blobs[1].diff, dy.sum(axis=(0, 2, 3)), rtol=1e-10)
    assert scale._temp is not None            # alone, it keeps its input itself

    norm2, scale2 = _layers(x)
    for mine, theirs in zip(scale2.blobs, scale.blobs):
        mine.data[...] = theirs.data
    pair = BatchNormScalePair(norm2, scale2)
    members = pair.members
    assert isinstance(members[0], PairedBatchNorm) and isinstance(members[1], PairedScale)
    y2, dx2 = _run_in_place(*members, x, dy)
    assert pair.folds and scale2._temp is None
    numpy.testing.assert_allclose(y2, y, rtol=1e-12, atol=1e-13)
    numpy.testing.assert_allclose(dx2, dx, rtol=1e-10, atol=1e-12)
    for mine, theirs in zip(scale2.blobs, scale.blobs):
        numpy.testing.assert_allclose(mine.diff, theirs.diff, rtol=1e-12)


def test_the_layers_of_a_pair_hold_nothing_of_each_other(monkeypatch):
    """A paired net's two layer indices run the pair's members, which show the layers' own
    names, parameters and statistics; the plain layers under them hold no reference to each
    other or to the pair, and carry no attribute that the same layers unpaired lack: the fold's
    state lives on the pair, and nothing else writes the layers' fields."""
    net = _bn_scale_net(monkeypatch, paired=True)
    for _ in range(2):
        net.ClearParamDiffs()
        net.Forward()
        net.Backward()
    bn, scale = net.layer_names.index("bn"), net.layer_names.index("scale")
    pair = net.layers[bn].pair
    assert isinstance(pair, BatchNormScalePair) and net.layers[scale].pair is pair
    assert net.layer_dict["bn"] is net.layers[bn] and net.layer_dict["scale"] is net.layers[scale]
    assert type(pair.norm) is BatchNormLayer and type(pair.scale) is ScaleLayer
    assert (net.layers[bn].name, net.layers[bn].type) == ("bn", "BatchNorm")
    assert (net.layers[scale].name, net.layers[scale].type) == ("scale", "Scale")
    assert net.params["scale"] is pair.scale.blobs is net.layers[scale].blobs
    assert net.layers[bn].blobs is pair.norm.blobs and not net.layers[bn].use_global_stats
    assert not hasattr(net.layer_dict["bn2"], "pair") and not hasattr(net.layer_dict["scale2"], "pair")

    for layer, other in ((pair.norm, pair.scale), (pair.scale, pair.norm)):
        held = list(vars(layer).values())
        assert not any(value is ref for value in held for ref in (other, pair) + pair.members)
    for gone in ("scale_after", "input_from", "prescaled", "take_scale", "folds_into",
                 "normalized_parts", "unfold"):
        assert not hasattr(BatchNormLayer, gone) and not hasattr(ScaleLayer, gone), gone
    assert not hasattr(Layer, "unfold")

    plain = _bn_scale_net(monkeypatch, paired=False)
    for _ in range(2):
        plain.ClearParamDiffs()
        plain.Forward()
        plain.Backward()
    assert set(vars(pair.norm)) <= set(vars(plain.layer_dict["bn"]))
    assert set(vars(pair.scale)) <= set(vars(plain.layer_dict["scale"]))


def test_a_forward_to_the_batchnorm_of_a_pair_gives_x_hat(monkeypatch):
    """net.forward(end=the BatchNorm) and ForwardLayer(the BatchNorm, alone=True) give x-hat
    of the BatchNorm's input; alone=False (Forward's inner layers, the per-layer timers) leaves
    the pair's output there, which the Scale's step then keeps."""
    net = _bn_scale_net(monkeypatch, paired=True)
    bn, scale = net.layer_names.index("bn"), net.layer_names.index("scale")
    assert net.layers[bn].pair.folds
    x = net.forward(end="conv")["conv"].copy()
    x_hat, _ = _x_hat(x)
    gamma, beta = (b.data.reshape(1, -1, 1, 1) for b in net.layers[scale].blobs)
    numpy.testing.assert_allclose(net.forward(end="bn")["conv"], x_hat, rtol=1e-12, atol=1e-13)

    net.forward(end="conv")
    net.ForwardLayer(bn, alone=True)
    numpy.testing.assert_allclose(net.blobs["conv"].data, x_hat, rtol=1e-12, atol=1e-13)
    net.ForwardLayer(scale)
    numpy.testing.assert_allclose(net.blobs["conv"].data, gamma * x_hat + beta, rtol=1e-12,
                                  atol=1e-13)

    net.forward(end="conv")
    net.ForwardLayer(bn, alone=False)
    folded = net.blobs["conv"].data.copy()
    numpy.testing.assert_allclose(folded, gamma * x_hat + beta, rtol=1e-12, atol=1e-13)
    net.ForwardLayer(scale)
    numpy.testing.assert_array_equal(net.blobs["conv"].data, folded)


PAIR_NET = """
name: "pair"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 12 } shape { dim: 8 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "ip1" top: "ip1" }
layer { name: "sc1" type: "Scale" bottom: "ip1" top: "ip1"
        scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 2 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def test_the_pairs_input_gradient_uses_the_scale_of_its_own_forward():
    """A caller acting right after the Scale's backward (a distributed sync writing the layer's
    new values in place) must not change the gradient the BatchNorm's step then makes below."""
    from google.protobuf import text_format
    from poseidon.engine import rng
    from poseidon.engine.net import Net
    from poseidon.engine.proto import caffe_pb2
    rs = numpy.random.RandomState(4)
    data, label = rs.standard_normal((8, 12)), rs.randint(0, 4, 8).astype(numpy.float64)
    grads = []
    for bump in (False, True):
        rng.seed(11)                                   # the same weights both times
        net = Net(text_format.Parse(PAIR_NET, caffe_pb2.NetParameter()), dtype=numpy.float64)
        assert isinstance(net.layer_dict["bn1"], PairedBatchNorm)
        net.blobs["data"].data[...] = data
        net.blobs["label"].data[...] = label
        sc = net.layer_names.index("sc1")

        def bump_scale(li):   # the scale's new values arrive right after its backward
            if li == sc:
                net.params["sc1"][0].data[...] *= 3.0

        net.Forward()
        net.ClearParamDiffs()
        net.Backward(after_layer=bump_scale if bump else None)
        grads.append(numpy.array(net.params["ip1"][0].diff))
    numpy.testing.assert_array_equal(grads[1], grads[0])
