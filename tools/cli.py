"""`poseidon`: Caffe's command line for this engine, with distribution built in.

    poseidon train --solver S [--weights W | --snapshot SS] [--gpu N] [--workers P1 --servers P2]
    poseidon train --demo                 # the embedded digits demo, trained and tested end to end
    poseidon test --model M --weights W --iterations N
    poseidon time --model M --iterations N
    poseidon summary --model M [--phase TRAIN|TEST]
    poseidon data digits|cifar10|images ...   (LMDB shards)
    poseidon mean SOURCE OUT.binaryproto
    poseidon keys FILE                    # the key file of a multi-host job (--keys FILE)
    poseidon simulate --model vgg19_22k --nodes 1,2,4,8,16,32 --bandwidth 40Gbit
    poseidon plot LOG [--out curve.png] [--csv rows.csv]   # a training log's curves (plot extra)

Errors a user can fix (bad files, missing data) print one line and exit with status 1; a
bad command-line value prints the usage line and exits with status 2 (argparse).
"""
import argparse
import sys

from poseidon.engine.errors import PoseidonError


def _add_commands(sub):
    from . import commands
    commands.register_all(sub)


def build_parser():
    parser = argparse.ArgumentParser(prog="poseidon", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_commands(sub)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except PoseidonError as e:
        print(f"poseidon {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"poseidon {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
