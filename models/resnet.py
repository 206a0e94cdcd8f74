"""ResNet-50/101/152 (bottleneck) in the layout of KaimingHe/deep-residual-networks.

Every convolution has ``bias_term: false`` and is followed by BatchNorm and Scale(bias_term: true);
each stage's first block has a projection shortcut (branch1, 1x1) and puts the stride on branch2a,
as Kaiming's files do; blocks end with an Eltwise SUM and a ReLU. Depths differ only in block
counts: 50 = (3, 4, 6, 3), 101 = (3, 4, 23, 3), 152 = (3, 8, 36, 3). Learnable parameters (conv
weights + Scale gamma/beta + fc; BatchNorm statistics not counted): 25,557,032 / 44,549,160 /
60,192,808.
Deploy nets use ``use_global_stats: true``; train_val leaves it out (Caffe then uses batch
statistics in TRAIN and the stored ones in TEST) and pins the statistics' lr_mult to 0.
"""

import string

from poseidon.models.builder import NetBuilder

BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
MSRA = {"type": "msra"}
MEAN_BGR = (104, 117, 123)


def _block_names(depth, stage, count):
    """Kaiming's suffixes: a, b, c, ... for ResNet-50 and stages 2/5; a, b1, b2, ... otherwise."""
    if depth == 50 or stage in (2, 5):
        return list(string.ascii_lowercase[:count])
    return ["a"] + [f"b{i}" for i in range(1, count)]


class _ResNet:
    def __init__(self, n, deploy):
        self.n, self.deploy = n, deploy

    def conv_bn(self, conv, bn, scale, bottom, num, k, stride=1, pad=0, relu=None):
        n = self.n
        x = n.conv(conv, bottom, num, k, stride=stride, pad=pad, bias=False, weight_filler=MSRA)
        n.bn_scale(bn, scale, x, use_global_stats=True if self.deploy else None,
                   freeze_stats=not self.deploy)
        return n.relu(relu, x) if relu else x

    def bottleneck(self, tag, x, width, stride, project):
        """res<tag>: 1x1 (width, stride) -> 3x3 (width) -> 1x1 (4*width), plus the shortcut."""
        out = 4 * width
        shortcut = x
        if project:
            shortcut = self.conv_bn(f"res{tag}_branch1", f"bn{tag}_branch1",
                                    f"scale{tag}_branch1", x, out, 1, stride)
        y = self.conv_bn(f"res{tag}_branch2a", f"bn{tag}_branch2a", f"scale{tag}_branch2a", x,
                         width, 1, stride, relu=f"res{tag}_branch2a_relu")
        y = self.conv_bn(f"res{tag}_branch2b", f"bn{tag}_branch2b", f"scale{tag}_branch2b", y,
                         width, 3, 1, pad=1, relu=f"res{tag}_branch2b_relu")
        y = self.conv_bn(f"res{tag}_branch2c", f"bn{tag}_branch2c", f"scale{tag}_branch2c", y,
                         out, 1)
        s = self.n.eltwise(f"res{tag}", [shortcut, y])
        return self.n.relu(f"res{tag}_relu", s)


def resnet(depth=152, deploy=False, batch=32, num_classes=1000):
    if depth not in BLOCKS:
        raise ValueError(f"ResNet depth {depth} is not one of {sorted(BLOCKS)}")
    n = NetBuilder(f"ResNet-{depth}")
    if deploy:
        x = n.input("data", (batch, 3, 224, 224))
    else:
        x = n.data_pair("ilsvrc12", batch, 50, mirror=True, crop_size=224, mean_value=MEAN_BGR)
    r = _ResNet(n, deploy)
    x = r.conv_bn("conv1", "bn_conv1", "scale_conv1", x, 64, 7, 2, pad=3, relu="conv1_relu")
    x = n.pool("pool1", x, "MAX", 3, 2)
    for stage, (count, width) in enumerate(zip(BLOCKS[depth], (64, 128, 256, 512)), start=2):
        for i, suffix in enumerate(_block_names(depth, stage, count)):
            stride = 2 if (i == 0 and stage > 2) else 1
            x = r.bottleneck(f"{stage}{suffix}", x, width, stride, project=(i == 0))
    x = n.pool("pool5", x, "AVE", 7, 1)
    x = n.fc(f"fc{num_classes}", x, num_classes, weight_filler=MSRA,
             bias_filler={"type": "constant", "value": 0})
    n.classifier_tail(x, deploy)
    return n.net
