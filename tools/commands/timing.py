"""`poseidon time --model M --iterations N`: per-layer forward/backward times, as `caffe time` prints.

Backward is timed for every layer (as if force_backward were set), so a deploy file with no loss
still reports its backward cost.
"""
import time

import numpy

from engine import backend
from engine.net import Net

from .common import add_gpu_option, apply_gpu, out, positive_int


def add(sub):
    p = sub.add_parser("time", help="benchmark forward and backward of a model, layer by layer")
    p.add_argument("--model", required=True)
    p.add_argument("--iterations", type=positive_int, default=50)
    p.add_argument("--phase", default="TRAIN")
    add_gpu_option(p)
    p.set_defaults(run=run)


def _sync(net):
    if net.xp is not numpy:
        net.xp.cuda.Stream.null.synchronize()


def run(args):
    apply_gpu(args)
    from engine import prototxt
    param = prototxt.read_net(args.model)
    param.force_backward = True
    net = Net(param, args.phase, source=args.model)
    n_layers = len(net.layers)
    fwd = numpy.zeros(n_layers)
    bwd = numpy.zeros(n_layers)
    out(f"Performing Forward-Backward on {args.model} for {args.iterations} iterations "
        f"({'GPU' if net.xp is not numpy else 'CPU'})")
    net.Forward()  # warm-up: allocates buffers
    net.Backward()
    start_all = time.perf_counter()
    fwd_total = bwd_total = 0.0
    for it in range(args.iterations):
        t0 = time.perf_counter()
        for li in range(n_layers):
            t = time.perf_counter()
            net.ForwardLayer(li)
            _sync(net)
            fwd[li] += time.perf_counter() - t
        t1 = time.perf_counter()
        for li in reversed(range(n_layers)):
            t = time.perf_counter()
            net.BackwardThrough(li)
            _sync(net)
            bwd[li] += time.perf_counter() - t
        t2 = time.perf_counter()
        fwd_total += t1 - t0
        bwd_total += t2 - t1
        out(f"Iteration: {it + 1} forward-backward time: {(t2 - t0) * 1e3:.3f} ms.")
    n = args.iterations
    out("Average time per layer: ")
    for li, name in enumerate(net.layer_names):
        out(f"{name:>20s}\tforward: {fwd[li] / n * 1e3:.4f} ms.")
        out(f"{name:>20s}\tbackward: {bwd[li] / n * 1e3:.4f} ms.")
    algorithms = [f"{name} {layer.algorithm}" for name, layer in zip(net.layer_names, net.layers)
                  if getattr(layer, "algorithm", None)]
    if algorithms:   # which convolution route each layer took (POSEIDON_CONV, conv_fourier)
        out(f"Convolution algorithms: {', '.join(algorithms)}")
    out(f"Average Forward pass: {fwd_total / n * 1e3:.4f} ms.")
    out(f"Average Backward pass: {bwd_total / n * 1e3:.4f} ms.")
    out(f"Average Forward-Backward: {(fwd_total + bwd_total) / n * 1e3:.4f} ms.")
    out(f"Total Time: {(time.perf_counter() - start_all) * 1e3:.4f} ms.")
    out("*** Benchmark ends ***")
    net.shutdown()
    backend.set_mode_cpu()
