"""`poseidon test --model M --weights W --iterations N`: score a trained model (Caffe's `caffe test`)."""
import numpy

from poseidon.engine import backend
from poseidon.engine.net import Net

from .common import add_gpu_option, apply_gpu, out, positive_int


def add(sub):
    p = sub.add_parser("test", help="score a model on its TEST data")
    p.add_argument("--model", required=True)
    p.add_argument("--weights", required=True, help=".caffemodel or .h5 weights")
    p.add_argument("--iterations", type=positive_int, default=50)
    p.add_argument("--phase", default="TEST")
    add_gpu_option(p)
    p.set_defaults(run=run)


def run(args):
    apply_gpu(args)
    net = Net(args.model, args.phase, weights=args.weights)
    totals = {}
    loss_sum = 0.0
    for i in range(args.iterations):
        loss_sum += net.Forward()
        for name in net.output_names:
            values = backend.to_numpy(net.blobs[name].data).reshape(-1)
            totals.setdefault(name, numpy.zeros(values.size))
            totals[name] += values
            for k, v in enumerate(values):
                out(f"Batch {i}, {name} = {v:g}")
    out(f"Loss: {loss_sum / args.iterations:g}")
    for name in net.output_names:
        for v in totals[name] / args.iterations:
            weight = net.blob_loss_weights.get(name, 0)
            suffix = f" (* {weight:g} = {weight * v:g} loss)" if weight else ""
            out(f"{name} = {v:g}{suffix}")
    net.shutdown()
