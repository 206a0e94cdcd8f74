"""`poseidon time --model M --iterations N`: per-layer forward/backward times, as `caffe time` prints.

Backward is timed for every layer (as if force_backward were set), so a deploy file with no loss
still reports its backward cost; but, as in training (and in `caffe time`), no gradient is made for
what no learnable parameter feeds: the data and the labels (`skip_input_gradients`). A first
convolution's backward is then its weight gradient alone, as training runs it (the image gradient
it never needs would cost more than the weight gradient on a first layer with 3 input channels).
"""
import time

import numpy

from poseidon.engine import backend
from poseidon.engine.net import Net

from .common import add_gpu_option, apply_gpu, out, positive_int


def add(sub):
    p = sub.add_parser("time", help="benchmark forward and backward of a model, layer by layer")
    p.add_argument("--model", required=True)
    p.add_argument("--iterations", type=positive_int, default=50)
    p.add_argument("--phase", default="TRAIN")
    add_gpu_option(p)
    p.set_defaults(run=run)


def skip_input_gradients(net):
    """Clear the backward flags of the bottoms that no learnable parameter feeds (the net's
    inputs, labels and whatever is computed from them alone): training never asks for their
    gradient, so timing it would report a cost that training does not pay."""
    fed = set()
    for li, layer in enumerate(net.layers):
        learns = any(layer.param_propagate_down[i] for i in range(len(layer.blobs)))
        if learns or any(b in fed for b in net.bottom_names[li]):
            fed.update(net.top_names[li])
    for li, flags in enumerate(net.bottom_need_backward):
        for bi, name in enumerate(net.bottom_names[li]):
            if name not in fed:
                flags[bi] = False


def _sync(net):
    if net.xp is not numpy:
        net.xp.cuda.Stream.null.synchronize()


def timing_net(param, phase, source=None):
    """The Net as `poseidon time` (and `poseidon simulate --measure`) times it: every layer's
    backward runs (force_backward), but no gradient is made for what no parameter feeds."""
    param.force_backward = True
    net = Net(param, phase, source=source)
    skip_input_gradients(net)
    return net


def time_layers(net, iterations, on_iteration=None):
    """(forward, backward) seconds per layer, summed over `iterations` passes after one warm-up
    pass (which allocates the buffers); on_iteration(i, forward_s, backward_s) after each."""
    n = len(net.layers)
    fwd, bwd = numpy.zeros(n), numpy.zeros(n)
    net.Forward()
    net.Backward()
    for it in range(iterations):
        t0 = time.perf_counter()
        for li in range(n):
            t = time.perf_counter()
            net.ForwardLayer(li, alone=False)
            _sync(net)
            fwd[li] += time.perf_counter() - t
        t1 = time.perf_counter()
        for li in reversed(range(n)):
            t = time.perf_counter()
            net.BackwardThrough(li)
            _sync(net)
            bwd[li] += time.perf_counter() - t
        if on_iteration is not None:
            on_iteration(it, t1 - t0, time.perf_counter() - t1)
    return fwd, bwd


def run(args):
    apply_gpu(args)
    from poseidon.engine import prototxt
    net = timing_net(prototxt.read_net(args.model), args.phase, source=args.model)
    out(f"Performing Forward-Backward on {args.model} for {args.iterations} iterations "
        f"({'GPU' if net.xp is not numpy else 'CPU'})")
    start_all = time.perf_counter()
    totals = [0.0, 0.0]

    def report(it, forward_s, backward_s):
        totals[0] += forward_s
        totals[1] += backward_s
        out(f"Iteration: {it + 1} forward-backward time: {(forward_s + backward_s) * 1e3:.3f} ms.")

    fwd, bwd = time_layers(net, args.iterations, report)
    fwd_total, bwd_total = totals
    n = args.iterations
    out("Average time per layer: ")
    for li, name in enumerate(net.layer_names):
        out(f"{name:>20s}\tforward: {fwd[li] / n * 1e3:.4f} ms.")
        out(f"{name:>20s}\tbackward: {bwd[li] / n * 1e3:.4f} ms.")
    algorithms = [f"{name} {layer.algorithm}" for name, layer in zip(net.layer_names, net.layers)
                  if getattr(layer, "algorithm", None)]
    if algorithms:   # which convolution route each layer took (POSEIDON_CONV)
        out(f"Convolution algorithms: {', '.join(algorithms)}")
    out(f"Average Forward pass: {fwd_total / n * 1e3:.4f} ms.")
    out(f"Average Backward pass: {bwd_total / n * 1e3:.4f} ms.")
    out(f"Average Forward-Backward: {(fwd_total + bwd_total) / n * 1e3:.4f} ms.")
    out(f"Total Time: {(time.perf_counter() - start_all) * 1e3:.4f} ms.")
    out("*** Benchmark ends ***")
    net.shutdown()
    backend.set_mode_cpu()
