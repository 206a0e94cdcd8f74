"""A userspace link between two tap devices that drops, delays and reorders Ethernet frames.

Why: this kernel has no netem, and loss below TCP is what a lossy link does to a job: the kernel's
TCP sees its segments vanish and overtake each other and recovers (duplicate ACKs, SACK, fast
retransmit, timeouts). A relay above TCP could only delay bytes.

Run by network.py (beside it) in the bridge's namespace, as a script (it imports nothing of
the package, so it starts fast and needs no install):
    python forwarder.py --outer PORT --inner DEV --loss 0.03 --delay-ms 3 --jitter-ms 1 \
        --reorder 0.05 --hold-ms 6 --seconds 300 --seed 1
It creates both taps (they vanish when it exits), prints `ready`, and copies frames both ways:
the harness moves the inner tap into the host's namespace as its eth0 and puts the outer one on
the bridge. An IPv4 frame is dropped with probability --loss (ARP is never dropped: a lost ARP
only stalls the link for a second, which tests nothing); every frame waits --delay-ms plus up to
--jitter-ms, and with probability --reorder --hold-ms more, so frames behind it overtake it.

Bounded: at most MAX_QUEUED frames wait (more are dropped and counted), it exits at --seconds or
when its standard input closes, and then prints its counts as one JSON line.
"""
import argparse
import fcntl
import heapq
import json
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MAX_FRAME = 65536
MAX_QUEUED = 4096
MAX_READS = 64                 # frames taken from one device before looking at the other
ETHERTYPE_IPV4 = b"\x08\x00"


def open_tap(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Link:
    """Frames in flight between the two taps, each due at its time."""

    def __init__(self, args, fds):
        self.args = args
        self.fds = fds                           # {fd: the fd its frames go out on}
        self.random = random.Random(args.seed)
        self.queue = []                          # (due, sequence, out fd, frame)
        self.sequence = 0
        self.delivered = {fd: -1 for fd in fds}  # out fd -> highest sequence written
        self.counts = {"frames": 0, "dropped": 0, "overflow": 0, "held": 0, "reordered": 0,
                       "bytes": 0}

    def take(self, frame, out, now):
        self.counts["frames"] += 1
        self.counts["bytes"] += len(frame)
        a = self.args
        if frame[12:14] == ETHERTYPE_IPV4 and self.random.random() < a.loss:
            self.counts["dropped"] += 1
            return
        if len(self.queue) >= MAX_QUEUED:
            self.counts["overflow"] += 1
            return
        wait = a.delay_ms + self.random.random() * a.jitter_ms
        if self.random.random() < a.reorder:
            wait += a.hold_ms
            self.counts["held"] += 1
        self.sequence += 1
        heapq.heappush(self.queue, (now + wait / 1000.0, self.sequence, out, frame))

    def deliver(self, now):
        while self.queue and self.queue[0][0] <= now:
            _, seq, out, frame = heapq.heappop(self.queue)
            if seq < self.delivered[out]:
                self.counts["reordered"] += 1
            self.delivered[out] = max(self.delivered[out], seq)
            try:
                os.write(out, frame)
            except OSError:                      # the device is down or gone: a lost frame
                self.counts["dropped"] += 1

    def next_wait(self, now, longest=0.05):
        return longest if not self.queue else max(0.0, min(longest, self.queue[0][0] - now))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outer", required=True)
    ap.add_argument("--inner", required=True)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--reorder", type=float, default=0.0)
    ap.add_argument("--hold-ms", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    outer, inner = open_tap(args.outer), open_tap(args.inner)
    link = Link(args, {outer: inner, inner: outer})
    print("ready", flush=True)
    stdin = sys.stdin.fileno()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        now = time.monotonic()
        readable, _, _ = select.select([outer, inner, stdin], [], [], link.next_wait(now))
        if stdin in readable and not os.read(stdin, 4096):
            break                                # the harness closed our input: stop
        now = time.monotonic()
        for fd in (outer, inner):
            if fd not in readable:
                continue
            for _ in range(MAX_READS):
                try:
                    frame = os.read(fd, MAX_FRAME)
                except (BlockingIOError, OSError):
                    break
                link.take(frame, link.fds[fd], now)
        link.deliver(time.monotonic())
    print(json.dumps(link.counts), flush=True)


if __name__ == "__main__":
    main()
