"""`poseidon data`: write LMDB shards of Caffe Datum records.

    poseidon data digits OUT [--shards N]                 the embedded demo set (scikit-learn digits)
    poseidon data cifar10 ARCHIVE OUT [--shards N]        a CIFAR-10 python or binary archive you have
    poseidon data images ROOT/ LIST OUT [--shards N] ...  an image folder and a list file
"""
from .common import out, positive_int


def add(sub):
    p = sub.add_parser("data", help="make LMDB shards (digits demo set, CIFAR-10, image folders)")
    kinds = p.add_subparsers(dest="kind", metavar="KIND")
    kinds.required = True

    d = kinds.add_parser("digits", help="the embedded demo set: scikit-learn digits at 32x32x3")
    d.add_argument("output", help="folder to create (gets train/ and test/)")
    d.add_argument("--shards", type=positive_int, default=1)
    d.set_defaults(run=run_digits)

    c = kinds.add_parser("cifar10", help="CIFAR-10 from the python or binary archive")
    c.add_argument("archive", help="cifar-10-python.tar.gz, cifar-10-binary.tar.gz or their folder")
    c.add_argument("output")
    c.add_argument("--shards", type=positive_int, default=1)
    c.set_defaults(run=run_cifar)

    i = kinds.add_parser("images", help="images listed in a file, as Caffe's convert_imageset")
    i.add_argument("root", help="root folder (prepended to each listed path)")
    i.add_argument("list_file", help="lines of 'relative/path label'")
    i.add_argument("output")
    i.add_argument("--shards", type=positive_int, default=1)
    i.add_argument("--resize-width", type=int, default=0)
    i.add_argument("--resize-height", type=int, default=0)
    i.add_argument("--gray", action="store_true")
    i.add_argument("--shuffle", action="store_true")
    i.add_argument("--encoded", action="store_true")
    i.set_defaults(run=run_images)


def run_digits(args):
    from poseidon.engine.io.datasets import make_digits_lmdb
    make_digits_lmdb(args.output, shards=args.shards)
    out(f"Wrote the digits demo set to {args.output}/train and {args.output}/test")


def run_cifar(args):
    from poseidon.engine.io.datasets import cifar10_to_lmdb
    cifar10_to_lmdb(args.archive, args.output, shards=args.shards)
    out(f"Wrote CIFAR-10 to {args.output}/train and {args.output}/test")


def run_images(args):
    from poseidon.engine.io.datasets import images_to_lmdb
    images_to_lmdb(args.root, args.list_file, args.output, shards=args.shards,
                   resize=(args.resize_height, args.resize_width), gray=args.gray,
                   shuffle=args.shuffle, encoded=args.encoded)
    out(f"Wrote {args.output}")
