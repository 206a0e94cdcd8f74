"""GoogLeNet (Inception v1) as in BVLC's models/bvlc_googlenet.

Nine inception modules (1x1 | 1x1->3x3 | 1x1->5x5 | 3x3 MAX pool->1x1, concatenated), LRN after the
stem, 7x7 AVE pool, dropout 0.4, 1000-way classifier. deploy: 6,998,552 learnable parameters;
train_val adds the two auxiliary classifiers after inception_4a and 4d (loss weight 0.3 each;
13,378,280 parameters in all). The paper benchmarks it at batch 128 per node.
"""

from poseidon.models.builder import NetBuilder

# name: (#1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj)
MODULES = (
    ("3a", (64, 96, 128, 16, 32, 32)),
    ("3b", (128, 128, 192, 32, 96, 64)),
    ("4a", (192, 96, 208, 16, 48, 64)),
    ("4b", (160, 112, 224, 24, 64, 64)),
    ("4c", (128, 128, 256, 24, 64, 64)),
    ("4d", (112, 144, 288, 32, 64, 64)),
    ("4e", (256, 160, 320, 32, 128, 128)),
    ("5a", (256, 160, 320, 32, 128, 128)),
    ("5b", (384, 192, 384, 48, 128, 128)),
)
POOL_AFTER = {"3b": "pool3/3x3_s2", "4e": "pool4/3x3_s2"}
AUX_AFTER = {"4a": "loss1", "4d": "loss2"}
XAVIER = {"type": "xavier"}
MEAN_BGR = (104, 117, 123)


def _conv_relu(n, name, bottom, num, k, relu_name, stride=1, pad=0):
    x = n.conv(name, bottom, num, k, stride=stride, pad=pad, weight_filler=XAVIER,
               bias_filler={"type": "constant", "value": 0.2})
    return n.relu(relu_name, x)


def _inception(n, tag, x, cfg):
    c1, r3, c3, r5, c5, pp = cfg
    p = f"inception_{tag}/"
    b1 = _conv_relu(n, p + "1x1", x, c1, 1, p + "relu_1x1")
    b3 = _conv_relu(n, p + "3x3_reduce", x, r3, 1, p + "relu_3x3_reduce")
    b3 = _conv_relu(n, p + "3x3", b3, c3, 3, p + "relu_3x3", pad=1)
    b5 = _conv_relu(n, p + "5x5_reduce", x, r5, 1, p + "relu_5x5_reduce")
    b5 = _conv_relu(n, p + "5x5", b5, c5, 5, p + "relu_5x5", pad=2)
    bp = n.pool(p + "pool", x, "MAX", 3, 1, pad=1)
    bp = _conv_relu(n, p + "pool_proj", bp, pp, 1, p + "relu_pool_proj")
    return n.concat(p + "output", [b1, b3, b5, bp])


def _aux(n, tag, x):
    x = n.pool(f"{tag}/ave_pool", x, "AVE", 5, 3)
    x = _conv_relu(n, f"{tag}/conv", x, 128, 1, f"{tag}/relu_conv")
    x = n.fc(f"{tag}/fc", x, 1024, weight_filler=XAVIER,
             bias_filler={"type": "constant", "value": 0.2})
    x = n.relu(f"{tag}/relu_fc", x)
    x = n.dropout(f"{tag}/drop_fc", x, 0.7)
    x = n.fc(f"{tag}/classifier", x, 1000, weight_filler=XAVIER,
             bias_filler={"type": "constant", "value": 0})
    n.softmax_loss(f"{tag}/loss", x, loss_weight=0.3, top=f"{tag}/{tag}")
    n.accuracy(f"{tag}/top-1", x)
    n.accuracy(f"{tag}/top-5", x, top_k=5)


def googlenet(deploy=False, batch=128):
    n = NetBuilder("GoogleNet")
    if deploy:
        x = n.input("data", (batch, 3, 224, 224))
    else:
        x = n.data_pair("ilsvrc12", batch, 50, mirror=True, crop_size=224, mean_value=MEAN_BGR)
    x = _conv_relu(n, "conv1/7x7_s2", x, 64, 7, "conv1/relu_7x7", stride=2, pad=3)
    x = n.pool("pool1/3x3_s2", x, "MAX", 3, 2)
    x = n.lrn("pool1/norm1", x)
    x = _conv_relu(n, "conv2/3x3_reduce", x, 64, 1, "conv2/relu_3x3_reduce")
    x = _conv_relu(n, "conv2/3x3", x, 192, 3, "conv2/relu_3x3", pad=1)
    x = n.lrn("conv2/norm2", x)
    x = n.pool("pool2/3x3_s2", x, "MAX", 3, 2)
    for tag, cfg in MODULES:
        x = _inception(n, tag, x, cfg)
        if tag in AUX_AFTER and not deploy:
            _aux(n, AUX_AFTER[tag], x)
        if tag in POOL_AFTER:
            x = n.pool(POOL_AFTER[tag], x, "MAX", 3, 2)
    x = n.pool("pool5/7x7_s1", x, "AVE", 7, 1)
    x = n.dropout("pool5/drop_7x7_s1", x, 0.4)
    x = n.fc("loss3/classifier", x, 1000, weight_filler=XAVIER,
             bias_filler={"type": "constant", "value": 0})
    if deploy:
        n.softmax("prob", x)
    else:
        n.softmax_loss("loss3/loss3", x, loss_weight=1, top="loss3/loss3")
        n.accuracy("loss3/top-1", x)
        n.accuracy("loss3/top-5", x, top_k=5)
    return n.net
