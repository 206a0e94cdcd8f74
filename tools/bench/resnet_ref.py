"""ResNet-50 forward + backward beside PyTorch CPU: where a BatchNorm network spends its time.

    python -m tools.bench.resnet_ref [BATCH] [ITERATIONS]     (defaults: 8 3)

The engine runs prototxt/resnet50/deploy.prototxt with the batch set, batch statistics in its
BatchNorm layers (as in training), a random gradient on the top and none for the image (PyTorch's
input needs none either). PyTorch, when installed, runs the same architecture built here (the
MSRA ResNet-50 that the Caffe files describe: a block's stride on its first 1x1 convolution,
BatchNorm and a learned scale after every convolution) on as many threads as the engine uses.
Prints both sides' forward and backward times and the engine's time per layer type. The engine
runs first, so PyTorch's spinning threads cannot slow it. A benchmark-only reference: nothing in
the engine imports torch.
"""
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy

from engine import prototxt
from engine.layers.im2col import parallel
from engine.net import Net
from engine.proto import caffe_pb2

MODEL = Path(__file__).resolve().parents[2] / "prototxt" / "resnet50" / "deploy.prototxt"


def training_net(batch):
    """The deploy net with `batch` images, batch statistics and a backward down to conv1."""
    param = prototxt.read_net(str(MODEL))
    param.layer[0].input_param.shape[0].dim[0] = batch
    param.force_backward = True
    for layer in param.layer:
        if layer.type == "BatchNorm":
            layer.batch_norm_param.use_global_stats = False
        if layer.name == "conv1":
            layer.propagate_down.append(False)          # no gradient for the image
    return Net(param, phase=caffe_pb2.TRAIN)


def engine_times(batch, iterations):
    """(forward s, backward s, {layer type: [forward s, backward s]}) per iteration."""
    net = training_net(batch)
    rs = numpy.random.RandomState(0)
    data = net.blobs["data"]
    data.data[...] = rs.random_sample(data.shape)
    top = net.top_vecs[-1][0]
    n = len(net.layers)
    forward, backward = numpy.zeros(n), numpy.zeros(n)
    for it in range(iterations + 1):                    # the first is a warm-up
        keep = it > 0
        for li in range(n):
            t = time.perf_counter()
            net.ForwardLayer(li)
            forward[li] += (time.perf_counter() - t) * keep
        top.diff[...] = rs.random_sample(top.shape)
        for li in range(n - 1, -1, -1):
            t = time.perf_counter()
            net.BackwardThrough(li)
            backward[li] += (time.perf_counter() - t) * keep
    by_type = defaultdict(lambda: [0.0, 0.0])
    for li, layer in enumerate(net.layers):
        key = layer.type
        if key == "Convolution":
            key += f" {layer.geom.kh}x{layer.geom.kw}/{layer.geom.sh}"
        by_type[key][0] += forward[li] / iterations
        by_type[key][1] += backward[li] / iterations
    return forward.sum() / iterations, backward.sum() / iterations, dict(by_type)


def torch_times(batch, iterations, threads):
    """(forward s, backward s) per iteration of PyTorch's ResNet-50, or None without torch."""
    try:
        import torch
        from torch import nn
    except Exception:
        return None
    torch.set_num_threads(threads)
    torch.manual_seed(0)

    def unit(cin, cout, k, stride, relu=True):
        mods = [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*(mods + [nn.ReLU(inplace=True)] if relu else mods))

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            self.body = nn.Sequential(unit(cin, mid, 1, stride), unit(mid, mid, 3, 1),
                                      unit(mid, 4 * mid, 1, 1, relu=False))
            self.proj = (unit(cin, 4 * mid, 1, stride, relu=False)
                         if cin != 4 * mid or stride != 1 else None)

        def forward(self, x):
            return torch.relu(self.body(x) + (x if self.proj is None else self.proj(x)))

    mods = [unit(3, 64, 7, 2), nn.MaxPool2d(3, 2, ceil_mode=True)]
    cin = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            mods.append(Bottleneck(cin, mid, stride if b == 0 else 1))
            cin = 4 * mid
    mods += [nn.AvgPool2d(7), nn.Flatten(), nn.Linear(2048, 1000)]
    model = nn.Sequential(*mods)
    x = torch.rand(batch, 3, 224, 224)
    forward = backward = 0.0
    for it in range(iterations + 1):
        t0 = time.perf_counter()
        y = model(x)
        t1 = time.perf_counter()
        y.backward(torch.rand_like(y))
        t2 = time.perf_counter()
        if it:
            forward += t1 - t0
            backward += t2 - t1
    return forward / iterations, backward / iterations


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    batch = int(argv[0]) if argv else 8
    iterations = int(argv[1]) if len(argv) > 1 else 3
    threads = parallel().workers
    fwd, bwd, by_type = engine_times(batch, iterations)
    print(f"ResNet-50, batch {batch}, {threads} threads, mean of {iterations} iterations")
    print(f"engine : forward {fwd * 1e3:7.0f} ms  backward {bwd * 1e3:7.0f} ms  "
          f"total {(fwd + bwd) * 1e3:7.0f} ms")
    ref = torch_times(batch, iterations, threads)
    if ref is None:
        print("PyTorch: not installed (pip install torch==2.13.0 for the reference)")
    else:
        tf, tb = ref
        print(f"PyTorch: forward {tf * 1e3:7.0f} ms  backward {tb * 1e3:7.0f} ms  "
              f"total {(tf + tb) * 1e3:7.0f} ms  (engine/PyTorch speed "
              f"{(tf + tb) / (fwd + bwd):.2f}x)")
    print("engine by layer type (ms per iteration, forward / backward):")
    for key, (f, b) in sorted(by_type.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {key:22s} {f * 1e3:8.1f} {b * 1e3:8.1f}")


if __name__ == "__main__":
    main()
