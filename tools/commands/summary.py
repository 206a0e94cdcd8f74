"""`poseidon summary --model M [--phase P]`: each layer's top shapes and parameter count."""
from poseidon.engine.net import Net

from .common import out


def add(sub):
    p = sub.add_parser("summary", help="layer-by-layer shapes and parameter counts of a model")
    p.add_argument("--model", required=True, help="model prototxt")
    p.add_argument("--phase", default="TEST", help="TRAIN or TEST (default TEST)")
    p.add_argument("--level", type=int, default=0)
    p.add_argument("--stage", action="append", default=[], help="net stage (repeatable)")
    p.set_defaults(run=run)


def run(args):
    net = Net(args.model, args.phase, level=args.level, stages=args.stage)
    out(f"Net: {net.name or args.model}  (phase {args.phase.upper()})")
    out(f"{'layer':32s} {'type':18s} {'top shapes':40s} {'params':>12s}")
    for name, layer, tops, top_names in zip(net.layer_names, net.layers, net.top_vecs, net.top_names):
        shapes = ", ".join(f"{n} {'x'.join(map(str, t.shape)) or 'scalar'}"
                           for n, t in zip(top_names, tops))
        count = sum(b.count for b in layer.blobs)
        tag = " (statistics)" if getattr(layer, "stores_statistics", False) and count else ""
        out(f"{name:32s} {layer.type:18s} {shapes:40s} {count:>12d}{tag}")
    learnable, stats = net.param_counts()
    if stats:
        out(f"Stored statistics (BatchNorm, not learned): {stats}")
    out(f"Total parameters: {learnable}")
