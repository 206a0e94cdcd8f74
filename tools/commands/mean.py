"""`poseidon mean SOURCE OUT`: the per-pixel mean of an LMDB as a Caffe .binaryproto."""
from .common import out


def add(sub):
    p = sub.add_parser("mean", help="compute the mean image of an LMDB (compute_image_mean)")
    p.add_argument("source", help="LMDB database or folder of shards")
    p.add_argument("output", help="output .binaryproto")
    p.set_defaults(run=run)


def run(args):
    from poseidon.engine.io.caffemodel import write_binaryproto
    from poseidon.engine.io.datasets import compute_mean
    mean = compute_mean(args.source)
    write_binaryproto(mean, args.output)
    for c in range(mean.shape[0]):
        out(f"mean_value channel [{c}]: {float(mean[c].mean()):g}")
    out(f"Wrote {args.output} ({'x'.join(map(str, mean.shape))})")
