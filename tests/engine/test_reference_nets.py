"""Whole nets on fixed weights against the plain reference in tests/engine/reference.py (1e-4 relative)."""
import numpy as np

from poseidon.engine import TRAIN
from poseidon.engine.net import Net
from poseidon.engine.prototxt import parse_net_text

from tests.engine import reference as ref

CIFAR10_QUICK = """
name: "cifar10_quick_ref"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 32 dim: 32 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 32 pad: 2 kernel_size: 5 stride: 1
                            weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 32 pad: 2 kernel_size: 5 stride: 1
                            weight_filler { type: "gaussian" std: 0.05 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "pool2" top: "conv3"
        convolution_param { num_output: 64 pad: 2 kernel_size: 5 stride: 1
                            weight_filler { type: "gaussian" std: 0.05 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu3" type: "ReLU" bottom: "conv3" top: "conv3" }
layer { name: "pool3" type: "Pooling" bottom: "conv3" top: "pool3" pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool3" top: "ip1"
        inner_product_param { num_output: 64 weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 10 weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), 1e-12)
    err = np.abs(a - b).max() / scale
    assert err < 1e-4, f"{what}: max relative error {err:.3g}"


def test_cifar10_quick_forward_and_backward_match_plain_reference():
    net = Net(parse_net_text(CIFAR10_QUICK), TRAIN, dtype=np.float64)
    rs = np.random.RandomState(1)
    x = rs.standard_normal((2, 3, 32, 32))
    labels = np.array([3, 7])
    net.blobs["data"].data[...] = x
    net.blobs["label"].data[...] = labels
    net.ClearParamDiffs()
    loss = net.Forward()
    net.Backward()
    P = {name: [b.data for b in blobs] for name, blobs in net.params.items()}

    c1 = ref.conv_forward(x, P["conv1"][0], P["conv1"][1], 1, 2)
    p1, a1 = ref.pool_forward(c1, 3, 2, 0, "MAX")
    r1 = np.maximum(p1, 0)
    c2 = ref.conv_forward(r1, P["conv2"][0], P["conv2"][1], 1, 2)
    r2 = np.maximum(c2, 0)
    p2, a2 = ref.pool_forward(r2, 3, 2, 0, "AVE")
    c3 = ref.conv_forward(p2, P["conv3"][0], P["conv3"][1], 1, 2)
    r3 = np.maximum(c3, 0)
    p3, a3 = ref.pool_forward(r3, 3, 2, 0, "AVE")
    flat = p3.reshape(2, -1)
    i1 = flat @ P["ip1"][0].T + P["ip1"][1]
    i2 = i1 @ P["ip2"][0].T + P["ip2"][1]
    ref_loss, g = ref.softmax_loss(i2, labels)

    close(net.blobs["ip2"].data, i2, "ip2 forward")
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)

    d_ip2_w, d_ip2_b = g.T @ i1, g.sum(0)
    gi1 = g @ P["ip2"][0]
    d_ip1_w, d_ip1_b = gi1.T @ flat, gi1.sum(0)
    gp3 = (gi1 @ P["ip1"][0]).reshape(p3.shape)
    gr3 = ref.pool_backward(r3, gp3, a3, "AVE")
    gc3 = gr3 * (c3 > 0)
    gp2, d_c3_w, d_c3_b = ref.conv_backward(p2, P["conv3"][0], gc3, 1, 2)
    gr2 = ref.pool_backward(r2, gp2, a2, "AVE")
    gc2 = gr2 * (c2 > 0)
    gr1, d_c2_w, d_c2_b = ref.conv_backward(r1, P["conv2"][0], gc2, 1, 2)
    gp1 = gr1 * (p1 > 0)
    gc1 = ref.pool_backward(c1, gp1, a1, "MAX")
    _, d_c1_w, d_c1_b = ref.conv_backward(x, P["conv1"][0], gc1, 1, 2)

    for name, (dw, db) in {"ip2": (d_ip2_w, d_ip2_b), "ip1": (d_ip1_w, d_ip1_b),
                           "conv3": (d_c3_w, d_c3_b), "conv2": (d_c2_w, d_c2_b),
                           "conv1": (d_c1_w, d_c1_b)}.items():
        close(net.params[name][0].diff, dw, f"{name} weight gradient")
        close(net.params[name][1].diff, db, f"{name} bias gradient")


BOTTLENECK = """
name: "bottleneck_ref"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 8 dim: 6 dim: 6 } } }
layer { name: "proj" type: "Convolution" bottom: "data" top: "proj"
        convolution_param { num_output: 16 kernel_size: 1 bias_term: false weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn_proj" type: "BatchNorm" bottom: "proj" top: "proj" batch_norm_param { use_global_stats: false eps: 1e-5 } }
layer { name: "sc_proj" type: "Scale" bottom: "proj" top: "proj"
        scale_param { bias_term: true filler { type: "gaussian" std: 0.5 mean: 1 } bias_filler { type: "gaussian" std: 0.2 } } }
layer { name: "a" type: "Convolution" bottom: "data" top: "a"
        convolution_param { num_output: 4 kernel_size: 1 bias_term: false weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn_a" type: "BatchNorm" bottom: "a" top: "a" batch_norm_param { use_global_stats: false eps: 1e-5 } }
layer { name: "sc_a" type: "Scale" bottom: "a" top: "a"
        scale_param { bias_term: true filler { type: "gaussian" std: 0.5 mean: 1 } bias_filler { type: "gaussian" std: 0.2 } } }
layer { name: "relu_a" type: "ReLU" bottom: "a" top: "a" }
layer { name: "b" type: "Convolution" bottom: "a" top: "b"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 bias_term: false weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn_b" type: "BatchNorm" bottom: "b" top: "b" batch_norm_param { use_global_stats: false eps: 1e-5 } }
layer { name: "sc_b" type: "Scale" bottom: "b" top: "b"
        scale_param { bias_term: true filler { type: "gaussian" std: 0.5 mean: 1 } bias_filler { type: "gaussian" std: 0.2 } } }
layer { name: "relu_b" type: "ReLU" bottom: "b" top: "b" }
layer { name: "c" type: "Convolution" bottom: "b" top: "c"
        convolution_param { num_output: 16 kernel_size: 1 bias_term: false weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn_c" type: "BatchNorm" bottom: "c" top: "c" batch_norm_param { use_global_stats: false eps: 1e-5 } }
layer { name: "sc_c" type: "Scale" bottom: "c" top: "c"
        scale_param { bias_term: true filler { type: "gaussian" std: 0.5 mean: 1 } bias_filler { type: "gaussian" std: 0.2 } } }
layer { name: "sum" type: "Eltwise" bottom: "proj" bottom: "c" top: "sum" }
layer { name: "relu" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "loss" type: "EuclideanLoss" bottom: "sum" bottom: "target" top: "loss" }
layer { name: "target" type: "Input" top: "target" input_param { shape { dim: 2 dim: 16 dim: 6 dim: 6 } } }
"""


def test_resnet_bottleneck_forward_and_backward_match_plain_reference():
    # The target Input must come before the loss layer that reads it.
    text = BOTTLENECK.replace(
        'layer { name: "target" type: "Input" top: "target" input_param { shape { dim: 2 dim: 16 dim: 6 dim: 6 } } }\n', "")
    text = text.replace('layer { name: "proj"', 'layer { name: "target" type: "Input" top: "target" '
                        'input_param { shape { dim: 2 dim: 16 dim: 6 dim: 6 } } }\nlayer { name: "proj"', 1)
    net = Net(parse_net_text(text), TRAIN, dtype=np.float64)
    rs = np.random.RandomState(2)
    x = rs.standard_normal((2, 8, 6, 6))
    target = rs.standard_normal((2, 16, 6, 6))
    net.blobs["data"].data[...] = x
    net.blobs["target"].data[...] = target
    net.ClearParamDiffs()
    loss = net.Forward()
    net.Backward()
    P = {name: [b.data for b in blobs] for name, blobs in net.params.items()}
    eps = 1e-5

    def unit(inp, conv, scale, p):
        c = ref.conv_forward(inp, P[conv][0], None, 1, p)
        xhat, var = ref.batchnorm_train(c, eps)
        s = xhat * P[scale][0][None, :, None, None] + P[scale][1][None, :, None, None]
        return c, xhat, var, s

    cp, xp_, vp, sp = unit(x, "proj", "sc_proj", 0)
    ca, xa, va, sa = unit(x, "a", "sc_a", 0)
    ra = np.maximum(sa, 0)
    cb, xb, vb, sb = unit(ra, "b", "sc_b", 1)
    rb = np.maximum(sb, 0)
    cc, xc, vc, sc = unit(rb, "c", "sc_c", 0)
    total = sp + sc
    out = np.maximum(total, 0)
    ref_loss = ((out - target) ** 2).sum() / (2 * 2)
    close(net.blobs["sum"].data, out, "block output")
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)

    g = (out - target) / 2 * (total > 0)

    def unit_back(gs, inp, xhat, var, conv, scale, p):
        dscale = (gs * xhat).sum(axis=(0, 2, 3))
        dbias = gs.sum(axis=(0, 2, 3))
        gx = ref.batchnorm_backward(gs * P[scale][0][None, :, None, None], xhat, var, eps)
        gin, dw, _ = ref.conv_backward(inp, P[conv][0], gx, 1, p)
        close(net.params[scale][0].diff, dscale, f"{scale} scale gradient")
        close(net.params[scale][1].diff, dbias, f"{scale} bias gradient")
        close(net.params[conv][0].diff, dw, f"{conv} weight gradient")
        return gin

    unit_back(g, x, xp_, vp, "proj", "sc_proj", 0)
    grb = unit_back(g, rb, xc, vc, "c", "sc_c", 0)
    gra = unit_back(grb * (sb > 0), ra, xb, vb, "b", "sc_b", 1)
    unit_back(gra * (sa > 0), x, xa, va, "a", "sc_a", 0)
