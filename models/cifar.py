"""CIFAR-10 quick (Caffe's examples/cifar10 "quick" net) and its twin for the digits demo set.

cifar10_quick: conv(32,5x5,pad 2) -> MAX pool 3/2 -> ReLU -> conv(32) -> ReLU -> AVE pool 3/2 ->
conv(64) -> ReLU -> AVE pool 3/2 -> ip(64) -> ip(10); 145,578 learnable parameters. Note the first
block pools before its ReLU, as Caffe's file does.

digits_quick: the identical architecture for the embedded demo set (32x32x3 digit images, 10
classes) read from data/digits/{train,test} with pixel scale 1/256 instead of a mean file.
"""

from poseidon.models.builder import NetBuilder


def _quick_body(n, x):
    gauss = lambda std: {"type": "gaussian", "std": std}  # noqa: E731
    const = {"type": "constant"}
    x = n.conv("conv1", x, 32, 5, pad=2, weight_filler=gauss(0.0001), bias_filler=const)
    x = n.pool("pool1", x, "MAX", 3, 2)
    x = n.relu("relu1", x)
    x = n.conv("conv2", x, 32, 5, pad=2, weight_filler=gauss(0.01), bias_filler=const)
    x = n.relu("relu2", x)
    x = n.pool("pool2", x, "AVE", 3, 2)
    x = n.conv("conv3", x, 64, 5, pad=2, weight_filler=gauss(0.01), bias_filler=const)
    x = n.relu("relu3", x)
    x = n.pool("pool3", x, "AVE", 3, 2)
    x = n.fc("ip1", x, 64, weight_filler=gauss(0.1), bias_filler=const)
    return n.fc("ip2", x, 10, weight_filler=gauss(0.1), bias_filler=const)


def _quick(name, deploy, dataset, deploy_batch, train_batch, test_batch, **transform):
    n = NetBuilder(name, decay_mults=False)
    if deploy:
        x = n.input("data", (deploy_batch, 3, 32, 32))
    else:
        x = n.data_pair(dataset, train_batch, test_batch, **transform)
    logits = _quick_body(n, x)
    n.classifier_tail(logits, deploy, top5=False)
    return n.net


def cifar10_quick(deploy=False):
    """Caffe's CIFAR10_quick; train_val reads data/cifar10/{train,test} with the mean image
    data/cifar10/mean.binaryproto (as Caffe's example), batch 100."""
    return _quick("CIFAR10_quick", deploy, "cifar10", 100, 100, 100,
                  mean_file="data/cifar10/mean.binaryproto")


def digits_quick(deploy=False):
    """cifar10_quick's architecture on the demo digits (scale 1/256, batch 64 train, 100 test)."""
    return _quick("digits_quick", deploy, "digits", 100, 64, 100, scale=0.00390625)
