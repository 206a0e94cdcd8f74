"""Solver definitions (caffe.SolverParameter) for every model in prototxt/.

Paths in the generated ``solver.prototxt`` files:

* ``net: "train_val.prototxt"`` is relative to the solver file's own folder. Caffe resolves
  ``net`` relative to the working directory only; this project's engine first tries the working
  directory and, when the file is not found there, resolves ``net`` relative to the directory
  holding the solver file, so ``poseidon train --solver prototxt/<model>/solver.prototxt`` works
  from the repository root and from inside the model's folder.
* ``snapshot_prefix`` is ``snapshots/<model>`` (relative to the working directory, as in Caffe).
* Data sources in the train_val files are ``data/<dataset>/{train,test}`` relative to the working
  directory.

Settings are Caffe's reference ones (cifar10_quick, AlexNet, GoogLeNet quick solver) or those of the
model's paper translated to Caffe policies (VGG, ResNet, Inception-v3). The ImageNet schedules
count iterations of a global batch of 256 (AlexNet: one process at 256; VGG, ResNet and
Inception-v3: e.g. 8 workers x the per-node batch 32 of the train_val files); GoogLeNet's quick
schedule is rescaled from batch 32 to the per-node 128 the Poseidon paper uses. digits_quick is
tuned to pass 95% test accuracy on the embedded demo set within ~1,000 iterations; fc_heavy is a
benchmark net with no test phase.
"""

from poseidon.engine.proto import caffe_pb2


def _solver(model, **fields):
    stepvalues = fields.pop("stepvalue", ())
    sp = caffe_pb2.SolverParameter(net="train_val.prototxt", snapshot_prefix=f"snapshots/{model}",
                                   **fields)
    sp.stepvalue.extend(stepvalues)
    return sp


def cifar10_quick():
    return _solver("cifar10_quick", test_iter=[100], test_interval=500, base_lr=0.001,
                   momentum=0.9, weight_decay=0.004, lr_policy="fixed", display=100,
                   max_iter=4000, snapshot=4000)


def digits_quick():
    # ~360 test images at batch 100 -> 4 test iterations cover the split.
    return _solver("digits_quick", test_iter=[4], test_interval=250, base_lr=0.01, momentum=0.9,
                   weight_decay=0.004, lr_policy="step", gamma=0.1, stepsize=800, display=50,
                   max_iter=1000, snapshot=500, random_seed=1)


def alexnet():
    return _solver("alexnet", test_iter=[1000], test_interval=1000, base_lr=0.01,
                   lr_policy="step", gamma=0.1, stepsize=100000, display=20, max_iter=450000,
                   momentum=0.9, weight_decay=0.0005, snapshot=10000)


def _vgg(model):
    # VGG paper: SGD, momentum 0.9, weight decay 5e-4, lr 0.01 divided by 10 three times,
    # 370k iterations of batch 256 (74 epochs).
    return _solver(model, test_iter=[1000], test_interval=10000, base_lr=0.01, lr_policy="step",
                   gamma=0.1, stepsize=100000, display=20, max_iter=370000, momentum=0.9,
                   weight_decay=0.0005, snapshot=10000)


def vgg19():
    return _vgg("vgg19")


def vgg19_22k():
    return _vgg("vgg19_22k")


def googlenet():
    # BVLC quick_solver (batch 32, 2.4 M iterations) rescaled to batch 128 per node.
    return _solver("googlenet", test_iter=[1000], test_interval=4000, test_initialization=False,
                   display=40, average_loss=40, base_lr=0.01, lr_policy="poly", power=0.5,
                   max_iter=600000, momentum=0.9, weight_decay=0.0002, snapshot=40000)


def inception_v3():
    # Inception-v3 paper: RMSProp (decay 0.9, epsilon 1.0), lr 0.045 x 0.94 every two epochs
    # (10k iterations of batch 256), 100 epochs; Caffe's RMSProp takes no momentum.
    return _solver("inception_v3", test_iter=[1000], test_interval=10000, base_lr=0.045,
                   lr_policy="step", gamma=0.94, stepsize=10000, display=20, max_iter=500000,
                   weight_decay=0.00004, type="RMSProp", rms_decay=0.9, delta=1.0,
                   snapshot=10000)


def _resnet(model):
    # He et al.: SGD, momentum 0.9, weight decay 1e-4, lr 0.1 divided by 10 at 150k and 300k.
    return _solver(model, test_iter=[1000], test_interval=10000, base_lr=0.1,
                   lr_policy="multistep", gamma=0.1, stepvalue=[150000, 300000], display=20,
                   max_iter=600000, momentum=0.9, weight_decay=0.0001, snapshot=10000)


def resnet50():
    return _resnet("resnet50")


def resnet101():
    return _resnet("resnet101")


def resnet152():
    return _resnet("resnet152")


def fc_heavy():
    return _solver("fc_heavy", base_lr=0.01, lr_policy="fixed", momentum=0.9,
                   weight_decay=0.0005, display=10, max_iter=100)
