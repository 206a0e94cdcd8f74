"""AlexNet as in BVLC's models/bvlc_alexnet (two-group conv2/4/5, LRN after conv1/conv2).

227x227 crops, 60,965,224 learnable parameters (58.6 M of them in fc6-fc8). train_val reads
data/ilsvrc12/{train,test} (LMDB), batch 256 / 50, mean values (104, 117, 123) in BGR order.
"""

from poseidon.models.builder import NetBuilder

MEAN_BGR = (104, 117, 123)


def alexnet(deploy=False, num_classes=1000, batch=256):
    n = NetBuilder("AlexNet")
    if deploy:
        x = n.input("data", (batch, 3, 227, 227))
    else:
        x = n.data_pair("ilsvrc12", batch, 50, mirror=True, crop_size=227, mean_value=MEAN_BGR)
    g = lambda std: {"type": "gaussian", "std": std}  # noqa: E731
    c = lambda v: {"type": "constant", "value": v}  # noqa: E731
    x = n.conv("conv1", x, 96, 11, stride=4, weight_filler=g(0.01), bias_filler=c(0))
    x = n.relu("relu1", x)
    x = n.lrn("norm1", x)
    x = n.pool("pool1", x, "MAX", 3, 2)
    x = n.conv("conv2", x, 256, 5, pad=2, group=2, weight_filler=g(0.01), bias_filler=c(0.1))
    x = n.relu("relu2", x)
    x = n.lrn("norm2", x)
    x = n.pool("pool2", x, "MAX", 3, 2)
    x = n.conv("conv3", x, 384, 3, pad=1, weight_filler=g(0.01), bias_filler=c(0))
    x = n.relu("relu3", x)
    x = n.conv("conv4", x, 384, 3, pad=1, group=2, weight_filler=g(0.01), bias_filler=c(0.1))
    x = n.relu("relu4", x)
    x = n.conv("conv5", x, 256, 3, pad=1, group=2, weight_filler=g(0.01), bias_filler=c(0.1))
    x = n.relu("relu5", x)
    x = n.pool("pool5", x, "MAX", 3, 2)
    for i in (6, 7):
        x = n.fc(f"fc{i}", x, 4096, weight_filler=g(0.005), bias_filler=c(0.1))
        x = n.relu(f"relu{i}", x)
        x = n.dropout(f"drop{i}", x, 0.5)
    x = n.fc("fc8", x, num_classes, weight_filler=g(0.01), bias_filler=c(0))
    n.classifier_tail(x, deploy)
    return n.net
