"""Any deploy net's forward + backward beside PyTorch CPU: where a real network spends its time.

    python -m poseidon.tools.bench.model_ref [MODEL] [--batch N] [--iterations N] [--rounds N] [--profile]

MODEL is a folder of prototxt/ (resnet50, googlenet, inception_v3, alexnet, vgg19, ...) or the path
of a deploy file (one Input layer for the image; default resnet50, batch 8). The engine runs it as
in training: batch statistics in its BatchNorm layers, a random gradient on the last top and a
backward through every layer but none for the image. PyTorch, when installed, runs the same graph
(torch_graph.py) built from the same NetParameter (so the two cannot drift apart), the way a
PyTorch user writes it: a BatchNorm followed by the Scale that scales its output is one affine
`BatchNorm2d`, and a ReLU runs in place where the Caffe layer does (as torchvision's networks do).
The two sides take turns, ROUNDS times ITERATIONS iterations each, as part a of the bench does,
with a pause after each PyTorch run (its OpenMP threads spin for a while and would slow the
engine's next run). Prints each side's median and range, the median of the per-round speed
ratios, the engine's time per layer type and, with --profile, PyTorch's own profile of one
iteration by operator. A benchmark-only reference: nothing in the engine imports torch.
"""
import argparse
import time
from collections import defaultdict
from pathlib import Path

import numpy

from poseidon import prototxt as shipped_prototxt
from poseidon.engine import prototxt
from poseidon.engine.parallel import parallel
from poseidon.engine.net import Net
from poseidon.engine.proto import caffe_pb2

from .torch_graph import torch_graph

MODELS = shipped_prototxt.folder()
PAUSE_S = 0.5       # after each PyTorch run, before the engine's


def model_path(model):
    """The deploy file MODEL names: a folder of prototxt/ or a file."""
    path = Path(model)
    if not path.is_file():
        path = MODELS / model / "deploy.prototxt"
    if not path.is_file():
        known = sorted(p.parent.name for p in MODELS.glob("*/deploy.prototxt"))
        raise SystemExit(f"model_ref: no deploy file for '{model}': give a path or one of "
                         f"{', '.join(known)}")
    return path


def training_param(model, batch):
    """The deploy NetParameter with `batch` images, batch statistics and a backward through every
    layer but none into the image."""
    param = prototxt.read_net(str(model_path(model)))
    inputs = [lp for lp in param.layer if lp.type == "Input"]
    if len(inputs) != 1 or len(inputs[0].top) != 1:
        raise SystemExit(f"model_ref: {model} needs one Input layer with one top (a deploy file)")
    inputs[0].input_param.shape[0].dim[0] = batch
    image = inputs[0].top[0]
    param.force_backward = True
    for layer in param.layer:
        if layer.type == "BatchNorm":
            layer.batch_norm_param.use_global_stats = False
        if image in layer.bottom:
            del layer.propagate_down[:]
            layer.propagate_down.extend(b != image for b in layer.bottom)
    return param


class EngineSide:
    """The engine's training net, kept across rounds; `run` times some iterations of it."""

    def __init__(self, model, batch):
        self.param = training_param(model, batch)
        self.net = Net(self.param, phase=caffe_pb2.TRAIN)
        self.rs = numpy.random.RandomState(0)
        self.image = next(lp.top[0] for lp in self.param.layer if lp.type == "Input")
        data = self.net.blobs[self.image]
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
                net.ForwardLayer(li, alone=False)
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
                g = layer.geom
                key += f" {g.kh}x{g.kw}/{g.sh}"
            out[key][0] += forward[li]
            out[key][1] += backward[li]
        return dict(out)


def engine_times(model, batch, iterations):
    """(forward s, backward s, {layer type: [forward s, backward s]}) per iteration."""
    side = EngineSide(model, batch)
    fwd, bwd, per_f, per_b = side.run(iterations)
    return fwd, bwd, side.by_type(per_f, per_b)


def copy_weights(graph, net):
    """Give the torch graph the engine net's parameters (for checking that both compute the
    same function): convolutions and InnerProducts as they are, a BatchNorm's paired Scale as
    the affine BatchNorm2d's weight and bias."""
    import torch
    with torch.no_grad():
        for name, module in graph.by_layer.items():
            blobs = net.layers[net.layer_names.index(name)].blobs
            targets = list(module) if isinstance(module, torch.nn.ParameterList) else [
                p for p in (module.weight, module.bias) if p is not None]
            for target, blob in zip(targets, blobs):
                target.copy_(torch.from_numpy(blob.data.reshape(target.shape)))


class TorchSide:
    """PyTorch's version of the engine side's net, kept across rounds."""

    def __init__(self, engine, threads):
        import torch
        self.torch = torch
        shapes = {name: blob.shape for name, blob in engine.net.blobs.items()}
        self.model = torch_graph(engine.param, shapes, threads)
        self.image = engine.image
        self.x = torch.rand(*shapes[self.image])
        self.run(1)                                     # warm-up

    def run(self, iterations):
        """(forward s, backward s) per iteration."""
        forward = backward = 0.0
        for _ in range(iterations):
            t0 = time.perf_counter()
            y = self.model({self.image: self.x})
            t1 = time.perf_counter()
            y.backward(self.torch.rand_like(y))
            t2 = time.perf_counter()
            forward += t1 - t0
            backward += t2 - t1
        return forward / iterations, backward / iterations

    def profile(self, rows=15):
        """PyTorch's profile of one iteration, by operator (its own table)."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.run(1)
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def torch_side(engine, threads):
    """A TorchSide, or None where torch cannot be imported."""
    try:
        import torch  # noqa: F401
    except Exception:
        return None
    return TorchSide(engine, threads)


def compare(engine, ref, rounds, iterations):
    """The two sides taking turns, `rounds` times `iterations` iterations each, so both see the
    same moments of the machine. Returns {"engine": [(forward s, backward s) per round],
    "PyTorch": [...] (empty without a reference)} and the engine's {layer type: [forward s,
    backward s]}, means over the rounds."""
    splits = {"engine": [], "PyTorch": []}
    per_f = per_b = 0.0
    for _ in range(rounds):
        fwd, bwd, layer_f, layer_b = engine.run(iterations)
        splits["engine"].append((fwd, bwd))
        per_f, per_b = per_f + layer_f / rounds, per_b + layer_b / rounds
        if ref is not None:
            splits["PyTorch"].append(ref.run(iterations))
            time.sleep(PAUSE_S)             # PyTorch's OpenMP threads spin a while after a run
    return splits, engine.by_type(per_f, per_b)


def _summary(splits):
    """Per side: total ms per round; and the per-round PyTorch / engine time ratios."""
    totals = {side: [(f + b) * 1e3 for f, b in rounds_] for side, rounds_ in splits.items()}
    ratios = [t / e for e, t in zip(totals["engine"], totals["PyTorch"])]
    return totals, ratios


def parse_models(text):
    """"resnet50:8,googlenet:16" -> [("resnet50", 8), ("googlenet", 16)] (batch 8 if none),
    each model's deploy file found (SystemExit naming the bad item otherwise)."""
    models = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, batch = item.rpartition(":") if ":" in item else (item, "", "8")
        if not batch.isdigit() or int(batch) < 1:
            raise SystemExit(f"model_ref: '{item}': give MODEL:BATCH with a positive batch, "
                             f"e.g. resnet50:8")
        model_path(name)
        models.append((name, int(batch)))
    return models


def measure(models, threads, rounds=3, iterations=2, with_torch=True, log=print):
    """Part f of `poseidon bench`: each (model, batch) beside PyTorch, the sides taking turns.
    Rows with the engine's and PyTorch's forward + backward ms (median, min-max over the
    rounds), the median of the per-round speed ratios and the engine's ms per layer type."""
    from .env import stats
    rows = []
    for model, batch in models:
        engine = EngineSide(model, batch)
        ref = torch_side(engine, threads) if with_torch else None
        splits, by_type = compare(engine, ref, rounds, iterations)
        totals, ratios = _summary(splits)
        row = {"model": model, "batch": batch, "engine_ms": stats(totals["engine"]),
               "torch_ms": stats(totals["PyTorch"]) if ratios else None,
               "ratio": float(numpy.median(ratios)) if ratios else None,
               "ratio_rounds": ratios,
               "by_type_ms": {k: [f * 1e3, b * 1e3] for k, (f, b) in by_type.items()}}
        if ref is None:
            row["torch_note"] = "--no-torch" if not with_torch else "torch is not importable"
        rows.append(row)
        log(f"  {model}, batch {batch}: engine {row['engine_ms']['median']:.0f} ms"
            + (f", PyTorch {row['torch_ms']['median']:.0f} ms, engine / PyTorch speed "
               f"{row['ratio']:.2f}x" if ratios else ""))
        del engine, ref
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m poseidon.tools.bench.model_ref",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="resnet50",
                        help="a folder of prototxt/ or a deploy file (default resnet50)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="print PyTorch's profile of one iteration by operator")
    args = parser.parse_args(argv)
    threads = parallel().workers
    engine = EngineSide(args.model, args.batch)
    ref = torch_side(engine, threads)
    splits, by_type = compare(engine, ref, args.rounds, args.iterations)
    totals, ratios = _summary(splits)
    print(f"{model_path(args.model)}, batch {args.batch}, {threads} threads, {args.rounds} rounds "
          f"of {args.iterations} iterations each side, taking turns; ms per iteration, median "
          f"(min-max)")
    for side, values in totals.items():
        if not values:
            print(f"{side:7s}: not installed (pip install torch==2.13.0 for the reference)")
            continue
        f = numpy.median([v[0] for v in splits[side]])
        b = numpy.median([v[1] for v in splits[side]])
        print(f"{side:7s}: total {numpy.median(values):6.0f} ({min(values):.0f}-"
              f"{max(values):.0f})  forward {f * 1e3:6.0f}  backward {b * 1e3:6.0f}")
    if ratios:
        print(f"engine/PyTorch speed: {numpy.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}x over the rounds)")
    print("engine by layer type (ms per iteration, forward / backward, mean of the rounds):")
    for key, (f, b) in sorted(by_type.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {key:22s} {f * 1e3:8.1f} {b * 1e3:8.1f}")
    if args.profile and ref is not None:
        print("PyTorch, one iteration, by operator:")
        print(ref.profile())


if __name__ == "__main__":
    main()
