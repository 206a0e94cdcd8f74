"""PyTorch DistributedDataParallel (gloo) on a bench net: the anchor users pick instead, one rank.

Run once per rank, each in its own emulated host (tools/bench/schemes_part.py starts them):

    python -m poseidon.tools.bench.ddp_ref --rank R --world W --master ADDR:PORT \
        --net fc_heavy --batch 32 --iterations N --threads 1 --out FILE.json

The model is tools/bench/torch_ref's TorchNet, built from the same NetParameter as the engine's
side, wrapped in DDP over gloo (its ring all-reduce in 25 MB buckets, overlapped with backward).
Every rank trains on its own synthetic batch of `--batch` samples; rank 0 writes the wall time of
each iteration (an iteration ends when the optimizer step returns, which is after DDP's
all-reduce of every bucket), and the options it ran with. A benchmark-only reference: nothing in
the engine or dist imports torch.
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta

from . import nets
from .torch_ref import TorchNet

NETS = {"fc_heavy": nets.fc_heavy, "cifar10_quick": nets.cifar10_quick,
        "vgg_block": nets.vgg_block, "vgg_mini": nets.vgg_mini}
INIT_TIMEOUT_S = 120          # every rank must have joined by then


def parse(argv=None):
    p = argparse.ArgumentParser(prog="ddp_ref", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="ADDR:PORT of rank 0's rendezvous")
    p.add_argument("--net", choices=sorted(NETS), default="fc_heavy")
    p.add_argument("--batch", type=int, default=None, help="samples a rank (the net's default)")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--interface", default=None,
                   help="the network interface gloo binds (GLOO_SOCKET_IFNAME), e.g. eth0")
    p.add_argument("--out", default=None, help="rank 0 writes its timings here (JSON)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.interface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.interface
    try:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
    except Exception as e:
        print(f"ddp_ref: torch is not importable ({type(e).__name__}: {e}); install the CPU "
              f"build (pip install torch) to run the DDP reference", file=sys.stderr)
        return 2
    bench_net = NETS[args.net](args.batch) if args.batch else NETS[args.net]()
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=INIT_TIMEOUT_S))
    try:
        ref = TorchNet(bench_net, args.threads)
        ref.model = DistributedDataParallel(ref.model)
        ref.opt = torch.optim.SGD(ref.model.parameters(), lr=bench_net.solver["base_lr"],
                                  momentum=bench_net.solver["momentum"],
                                  weight_decay=bench_net.solver["weight_decay"])
        data, label = nets.synthetic_batch(bench_net, seed=args.rank)
        ref.set_batch(data, label)
        dist.barrier()
        marks = [time.perf_counter()]
        for _ in range(args.iterations):
            ref.step()
            marks.append(time.perf_counter())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if args.rank == 0 and args.out:
        seconds = [b - a for a, b in zip(marks, marks[1:])]
        with open(args.out, "w") as f:
            json.dump({"net": args.net, "batch": bench_net.batch, "world": args.world,
                       "threads": args.threads, "torch": torch.__version__,
                       "iteration_s": seconds}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
