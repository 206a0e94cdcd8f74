"""ResNet-50 forward + backward beside PyTorch CPU: where a BatchNorm network spends its time.

    python -m tools.bench.resnet_ref [BATCH] [ITERATIONS] [ROUNDS]     (defaults: 8 3 3)

The engine runs prototxt/resnet50/deploy.prototxt with the batch set, batch statistics in its
BatchNorm layers (as in training), a random gradient on the top and none for the image (PyTorch's
input needs none either). PyTorch, when installed, runs the same architecture built here (the
MSRA ResNet-50 that the Caffe files describe: a block's stride on its first 1x1 convolution,
BatchNorm and a learned scale after every convolution) on as many threads as the engine uses.
The two sides take turns, ROUNDS times ITERATIONS iterations each, as part a of the bench does,
with a pause after each PyTorch run (its OpenMP threads spin for a while and would slow the
engine's next run). Prints each side's median and range, the median of the per-round speed
ratios and the engine's time per layer type. A benchmark-only reference: nothing in the engine
imports torch.
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
PAUSE_S = 0.5       # after each PyTorch run, before the engine's


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


class EngineSide:
    """The engine's training net, kept across rounds; `run` times some iterations of it."""

    def __init__(self, batch):
        self.net = training_net(batch)
        self.rs = numpy.random.RandomState(0)
        data = self.net.blobs["data"]
        data.data[...] = self.rs.random_sample(data.shape)
        self.run(1)                                     # warm-up: buffers, caches

    def run(self, iterations):
        """(forward s, backward s, per-layer forward s, per-layer backward s) per iteration."""
        net = self.net
        top = net.top_vecs[-1][0]
        n = len(net.layers)
        forward, backward = numpy.zeros(n), numpy.zeros(n)
        for _ in range(iterations):
            for li in range(n):
                t = time.perf_counter()
                net.ForwardLayer(li)
                forward[li] += time.perf_counter() - t
            top.diff[...] = self.rs.random_sample(top.shape)
            for li in range(n - 1, -1, -1):
                t = time.perf_counter()
                net.BackwardThrough(li)
                backward[li] += time.perf_counter() - t
        forward /= iterations
        backward /= iterations
        return forward.sum(), backward.sum(), forward, backward

    def by_type(self, forward, backward):
        """{layer type: [forward s, backward s]} (convolutions by kernel and stride)."""
        out = defaultdict(lambda: [0.0, 0.0])
        for li, layer in enumerate(self.net.layers):
            key = layer.type
            if key == "Convolution":
                key += f" {layer.geom.kh}x{layer.geom.kw}/{layer.geom.sh}"
            out[key][0] += forward[li]
            out[key][1] += backward[li]
        return dict(out)


def engine_times(batch, iterations):
    """(forward s, backward s, {layer type: [forward s, backward s]}) per iteration."""
    side = EngineSide(batch)
    fwd, bwd, per_f, per_b = side.run(iterations)
    return fwd, bwd, side.by_type(per_f, per_b)


class TorchSide:
    """PyTorch's ResNet-50 (see the module docstring), kept across rounds."""

    def __init__(self, batch, threads):
        import torch
        from torch import nn
        self.torch = torch
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
        self.model = nn.Sequential(*mods)
        self.x = torch.rand(batch, 3, 224, 224)
        self.run(1)                                     # warm-up

    def run(self, iterations):
        """(forward s, backward s) per iteration."""
        forward = backward = 0.0
        for _ in range(iterations):
            t0 = time.perf_counter()
            y = self.model(self.x)
            t1 = time.perf_counter()
            y.backward(self.torch.rand_like(y))
            t2 = time.perf_counter()
            forward += t1 - t0
            backward += t2 - t1
        return forward / iterations, backward / iterations


def torch_side(batch, threads):
    """A TorchSide, or None where torch cannot be imported."""
    try:
        import torch  # noqa: F401
    except Exception:
        return None
    return TorchSide(batch, threads)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    batch = int(argv[0]) if argv else 8
    iterations = int(argv[1]) if len(argv) > 1 else 3
    rounds = int(argv[2]) if len(argv) > 2 else 3
    threads = parallel().workers
    engine = EngineSide(batch)
    ref = torch_side(batch, threads)
    splits = {"engine": [], "PyTorch": []}     # (forward s, backward s) of each round
    per_f = per_b = 0.0
    for _ in range(rounds):                 # the sides take turns, so both see the same moments
        fwd, bwd, layer_f, layer_b = engine.run(iterations)
        splits["engine"].append((fwd, bwd))
        per_f, per_b = per_f + layer_f / rounds, per_b + layer_b / rounds
        if ref is not None:
            tf, tb = ref.run(iterations)
            splits["PyTorch"].append((tf, tb))
            time.sleep(PAUSE_S)             # PyTorch's OpenMP threads spin a while after a run
    print(f"ResNet-50, batch {batch}, {threads} threads, {rounds} rounds of {iterations} "
          f"iterations each side, taking turns; ms per iteration, median (min-max)")
    totals = {side: [f + b for f, b in rounds_] for side, rounds_ in splits.items()}
    for side, values in totals.items():
        if not values:
            print(f"{side:7s}: not installed (pip install torch==2.13.0 for the reference)")
            continue
        f = numpy.median([v[0] for v in splits[side]])
        b = numpy.median([v[1] for v in splits[side]])
        print(f"{side:7s}: total {numpy.median(values) * 1e3:6.0f} ({min(values) * 1e3:.0f}-"
              f"{max(values) * 1e3:.0f})  forward {f * 1e3:6.0f}  backward {b * 1e3:6.0f}")
    if totals["PyTorch"]:
        ratios = [t / e for e, t in zip(totals["engine"], totals["PyTorch"])]
        print(f"engine/PyTorch speed: {numpy.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}x over the rounds)")
    print("engine by layer type (ms per iteration, forward / backward, mean of the rounds):")
    for key, (f, b) in sorted(engine.by_type(per_f, per_b).items(), key=lambda kv: -sum(kv[1])):
        print(f"  {key:22s} {f * 1e3:8.1f} {b * 1e3:8.1f}")


if __name__ == "__main__":
    main()
