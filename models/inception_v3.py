"""Inception-v3 in the layout of soeaver/caffe-model's deploy_inception-v3.prototxt.

299x299 input; stem of five convolutions and two MAX pools; three A modules (5x5 and double 3x3
branches, 3x3 AVE pool pad 1), reduction A, four B modules with asymmetric 1x7/7x1 convolutions
(pad 0x3 / 3x0), reduction B, two C modules (1x3/3x1 splits; the second pools with MAX, as that file
does), global AVE pool, dropout 0.2, 1000-way classifier. Every convolution: bias_term false,
BatchNorm (eps 0.001) and Scale(bias_term: true), ReLU. 23,834,568 learnable parameters without
the auxiliary head (the generated files have none); ``aux_head=True`` adds the head of the Inception-v3
paper on the last 17x17 module (5x5/3 AVE pool, 1x1 conv 128, 5x5 conv 768, 1000-way classifier,
loss weight 0.4 in train_val), 27,161,264 in all, the size the Poseidon paper's TensorFlow runs trained.
The paper benchmarks it at batch 32 per node. train_val reads data/ilsvrc12 with inputs scaled to
[-1, 1] (mean 128, scale 1/128).
"""

from poseidon.models.builder import NetBuilder

XAVIER = {"type": "xavier", "std": 0.01}


class _Inception:
    def __init__(self, n, deploy):
        self.n, self.deploy = n, deploy

    def cbr(self, name, bottom, num, k, stride=1, pad=0, relu=None):
        """conv (no bias) + <name>_bn + <name>_scale + ReLU (<name>_relu unless given)."""
        n = self.n
        x = n.conv(name, bottom, num, k, stride=stride, pad=pad, bias=False, weight_filler=XAVIER)
        n.bn_scale(f"{name}_bn", f"{name}_scale", x, eps=0.001,
                   use_global_stats=True if self.deploy else None, freeze_stats=not self.deploy)
        return n.relu(relu or f"{name}_relu", x)

    def block_a(self, tag, x, pool_proj):
        p = f"inception_{tag}_"
        b1 = self.cbr(p + "1x1", x, 64, 1)
        b5 = self.cbr(p + "5x5_reduce", x, 48, 1)
        b5 = self.cbr(p + "5x5", b5, 64, 5, pad=2)
        b3 = self.cbr(p + "3x3_reduce", x, 64, 1)
        b3 = self.cbr(p + "3x3_1", b3, 96, 3, pad=1)
        b3 = self.cbr(p + "3x3_2", b3, 96, 3, pad=1)
        bp = self.n.pool(p + "pool", x, "AVE", 3, 1, pad=1)
        bp = self.cbr(p + "pool_proj", bp, pool_proj, 1)
        return self.n.concat(p + "output", [b1, b5, b3, bp])

    def reduction_a(self, x):
        p = "reduction_a_"
        b1 = self.cbr(p + "3x3", x, 384, 3, stride=2)
        b2 = self.cbr(p + "3x3_2_reduce", x, 64, 1)
        b2 = self.cbr(p + "3x3_2", b2, 96, 3, pad=1)
        b2 = self.cbr(p + "3x3_3", b2, 96, 3, stride=2)
        bp = self.n.pool(p + "pool", x, "MAX", 3, 2)
        return self.n.concat(p + "concat", [b1, b2, bp])

    def block_b(self, tag, x, c7):
        p = f"inception_{tag}_"
        h, v = (1, 7), (7, 1)
        ph, pv = (0, 3), (3, 0)
        b1 = self.cbr(p + "1x1_2", x, 192, 1)
        b2 = self.cbr(p + "1x7_reduce", x, c7, 1)
        b2 = self.cbr(p + "1x7", b2, c7, h, pad=ph)
        b2 = self.cbr(p + "7x1", b2, 192, v, pad=pv)
        b3 = self.cbr(p + "7x1_reduce", x, c7, 1)
        b3 = self.cbr(p + "7x1_2", b3, c7, v, pad=pv)
        b3 = self.cbr(p + "1x7_2", b3, c7, h, pad=ph)
        b3 = self.cbr(p + "7x1_3", b3, c7, v, pad=pv)
        b3 = self.cbr(p + "1x7_3", b3, 192, h, pad=ph)
        bp = self.n.pool(p + "pool_ave", x, "AVE", 3, 1, pad=1)
        bp = self.cbr(p + "1x1", bp, 192, 1)
        return self.n.concat(p + "concat", [b1, b2, b3, bp])

    def reduction_b(self, x):
        p = "reduction_b_"
        b1 = self.cbr(p + "3x3_reduce", x, 192, 1)
        b1 = self.cbr(p + "3x3", b1, 320, 3, stride=2)
        b2 = self.cbr(p + "1x7_reduce", x, 192, 1)
        b2 = self.cbr(p + "1x7", b2, 192, (1, 7), pad=(0, 3))
        b2 = self.cbr(p + "7x1", b2, 192, (7, 1), pad=(3, 0))
        b2 = self.cbr(p + "3x3_2", b2, 192, 3, stride=2)
        bp = self.n.pool(p + "pool", x, "MAX", 3, 2)
        return self.n.concat(p + "concat", [b1, b2, bp])

    def block_c(self, tag, x, pool):
        p = f"inception_{tag}_"
        b1 = self.cbr(p + "1x1_2", x, 320, 1)
        r = self.cbr(p + "1x3_reduce", x, 384, 1)
        b2a = self.cbr(p + "1x3", r, 384, (1, 3), pad=(0, 1))
        b2b = self.cbr(p + "3x1", r, 384, (3, 1), pad=(1, 0))
        r = self.cbr(p + "3x3_reduce", x, 448, 1)
        r = self.cbr(p + "3x3", r, 384, 3, pad=1)
        b3a = self.cbr(p + "1x3_2", r, 384, (1, 3), pad=(0, 1))
        b3b = self.cbr(p + "3x1_2", r, 384, (3, 1), pad=(1, 0))
        bp = self.n.pool(p + "pool", x, pool, 3, 1, pad=1)
        bp = self.cbr(p + "1x1", bp, 192, 1)
        return self.n.concat(p + "concat", [b1, b2a, b2b, b3a, b3b, bp])

    def aux_head(self, x, num_classes):
        """The auxiliary classifier on a 17x17 module's output (its own loss, weight 0.4)."""
        n = self.n
        a = n.pool("aux_pool_5x5_s3", x, "AVE", 5, 3)
        a = self.cbr("aux_conv_1x1", a, 128, 1)
        a = self.cbr("aux_conv_5x5", a, 768, 5)
        a = n.fc("aux_classifier", a, num_classes, weight_filler={"type": "xavier"},
                 bias_filler={"type": "constant", "value": 0})
        if self.deploy:
            n.softmax("aux_prob", a)
        else:
            n.softmax_loss("aux_loss", a, loss_weight=0.4)


def inception_v3(deploy=False, batch=32, num_classes=1000, aux_head=False):
    n = NetBuilder("Inception-v3")
    if deploy:
        x = n.input("data", (batch, 3, 299, 299))
    else:
        x = n.data_pair("ilsvrc12", batch, 50, mirror=True, crop_size=299,
                        mean_value=(128, 128, 128), scale=0.0078125)
    m = _Inception(n, deploy)
    x = m.cbr("conv1_3x3_s2", x, 32, 3, stride=2)
    x = m.cbr("conv2_3x3_s1", x, 32, 3)
    x = m.cbr("conv3_3x3_s1", x, 64, 3, pad=1)
    x = n.pool("pool1_3x3_s2", x, "MAX", 3, 2)
    x = m.cbr("conv4_3x3_reduce", x, 80, 1)
    x = m.cbr("conv4_3x3", x, 192, 3)
    x = n.pool("pool2_3x3_s2", x, "MAX", 3, 2)
    for tag, proj in (("a1", 32), ("a2", 64), ("a3", 64)):
        x = m.block_a(tag, x, proj)
    x = m.reduction_a(x)
    for tag, c7 in (("b1", 128), ("b2", 160), ("b3", 160), ("b4", 192)):
        x = m.block_b(tag, x, c7)
    if aux_head:
        m.aux_head(x, num_classes)
    x = m.reduction_b(x)
    x = m.block_c("c1", x, "AVE")
    x = m.block_c("c2", x, "MAX")
    x = n.pool("pool_8x8_s1", x, "AVE", global_pooling=True)
    x = n.dropout("pool_8x8_s1_drop", x, 0.2)
    x = n.fc("classifier", x, num_classes, weight_filler={"type": "xavier"},
             bias_filler={"type": "constant", "value": 0})
    n.classifier_tail(x, deploy)
    return n.net
