"""VGG19 (the VGG team's 19-layer ILSVRC net) and VGG19-22K (same, 21,841-way classifier).

Sixteen 3x3 convolutions (pad 1) in five blocks of 2, 2, 4, 4, 4 with a 2x2/2 MAX pool after each
block, then fc6/fc7 (4096, ReLU, dropout 0.5) and the classifier. Learnable parameters: VGG19
143,667,240; VGG19-22K 229,052,817 (91% in the three FC layers). The paper benchmarks both at batch
32 per node, which is the deploy batch here. train_val reads data/ilsvrc12 or data/imagenet22k.
"""

from poseidon.models.builder import NetBuilder

BLOCKS = ((64, 2), (128, 2), (256, 4), (512, 4), (512, 4))
MEAN_BGR = (104, 117, 123)


def vgg19(deploy=False, num_classes=1000, batch=32, name="VGG_ILSVRC_19_layers",
          dataset="ilsvrc12"):
    n = NetBuilder(name)
    if deploy:
        x = n.input("data", (batch, 3, 224, 224))
    else:
        x = n.data_pair(dataset, batch, 50, mirror=True, crop_size=224, mean_value=MEAN_BGR)
    wf = {"type": "gaussian", "std": 0.01}
    bf = {"type": "constant", "value": 0}
    for b, (width, convs) in enumerate(BLOCKS, start=1):
        for i in range(1, convs + 1):
            x = n.conv(f"conv{b}_{i}", x, width, 3, pad=1, weight_filler=wf, bias_filler=bf)
            x = n.relu(f"relu{b}_{i}", x)
        x = n.pool(f"pool{b}", x, "MAX", 2, 2)
    for i in (6, 7):
        x = n.fc(f"fc{i}", x, 4096, weight_filler={"type": "gaussian", "std": 0.005},
                 bias_filler={"type": "constant", "value": 0.1})
        x = n.relu(f"relu{i}", x)
        x = n.dropout(f"drop{i}", x, 0.5)
    x = n.fc("fc8", x, num_classes, weight_filler=wf, bias_filler=bf)
    n.classifier_tail(x, deploy)
    return n.net


def vgg19_22k(deploy=False, batch=32):
    """VGG19 with a 21,841-way classifier (full ImageNet-22K), data under data/imagenet22k/."""
    return vgg19(deploy, num_classes=21841, batch=batch, name="VGG19_22K", dataset="imagenet22k")
