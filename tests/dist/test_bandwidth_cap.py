"""`--bandwidth`: the same transfer between two transports, capped and uncapped, end to end.

The cap must hold the transfer to the rate: no faster than bytes / rate, less what may go
unwaited (the bucket's one burst, and the last message, whose cost a bucket may charge to the
next send), and the uncapped transfer must be clearly faster, so that a cap that is never
applied, or a bucket that never waits, fails here. Only the transport's public names are used.

Run: python -m pytest tests/dist/test_bandwidth_cap.py -q
"""
import time

import numpy

from poseidon.dist.job.roles import Roles
from poseidon.dist.transport import Msg, TokenBucket, ZmqTransport, parse_bandwidth

RATE = parse_bandwidth("16Mbit")              # 2 MB/s
MESSAGES = 40
CHUNK = numpy.arange(12_500, dtype=numpy.float32)   # 50 kB a message, 2 MB in all


def transfer(bandwidth):
    """Seconds to send MESSAGES chunks from rank 0 to rank 2 and have them all received, and
    the bytes rank 0 put on the wire (payload and headers: what the bucket is charged)."""
    roles = Roles(2, 1)
    sender = ZmqTransport(0, namer=roles.name, timeout=30.0, bandwidth=bandwidth)
    receiver = ZmqTransport(2, namer=roles.name, timeout=30.0)
    try:
        for t in (sender, receiver):
            t.bind("127.0.0.1")
            t.start()
        sender.connect(2, receiver.address)
        t0 = time.monotonic()
        for i in range(MESSAGES):
            sender.send(2, Msg.KV_PUSH, iteration=i, key=1, arrays=[CHUNK])
        for i in range(MESSAGES):
            msg = receiver.receive(Msg.KV_PUSH, 1, i)[0]
            assert msg.payload_bytes == CHUNK.nbytes
        elapsed = time.monotonic() - t0
        counters = sender.counters()
        return elapsed, counters["sent_payload"] + counters["sent_header"]
    finally:
        sender.close(0)
        receiver.close(0)


def test_the_cap_holds_a_transfer_to_the_rate_and_uncapped_is_clearly_faster():
    capped, sent = transfer(RATE)
    uncapped, sent_again = transfer(None)
    assert sent == sent_again >= MESSAGES * CHUNK.nbytes
    burst = TokenBucket(RATE).capacity           # sent at once before the bucket makes anyone wait
    floor = (sent - burst - sent / MESSAGES) / RATE      # 0.94 s of the 1.0 s the bytes take
    print(f"\n{sent} bytes: capped at {RATE / 1e6:g} MB/s {capped:.3f} s (floor {floor:.3f} s), "
          f"uncapped {uncapped:.3f} s")
    assert capped >= 0.98 * floor, f"capped transfer took {capped:.3f} s, under {floor:.3f} s"
    assert uncapped < 0.5 * floor, f"uncapped {uncapped:.3f} s is not clearly faster than the cap"
