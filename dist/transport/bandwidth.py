"""The send-rate cap of `--bandwidth`: its text read as bytes per second, and the token bucket senders
take from.

Why a cap at all: it is for experiments. Processes of one machine talk as fast as memory moves, so
the schemes (PS against SFB, how much of the sync hides behind the backward) can only be compared
at a network speed the machine does not have by capping what each process sends.
"""
import threading
import time

from ..units import parse_rate


def parse_bandwidth(text):
    """`--bandwidth`'s text as bytes per second (dist/units.py: '1Gbit', '10GbE', '125MB/s'), or
    None when no cap is asked for. An infinite cap is refused: leaving the flag out is that."""
    if text is None or text == "":
        return None
    return parse_rate(text, "the bandwidth")


class TokenBucket:
    """A send-rate cap for experiments (`--bandwidth`): senders take tokens (bytes) before sending."""

    def __init__(self, bytes_per_second, burst=None):
        self.rate = float(bytes_per_second)
        self.capacity = float(burst or max(self.rate / 100, 64 * 1024))   # 10 ms worth
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def consume(self, n):
        with self.lock:       # one sender at a time keeps the order of who waits fair and simple
            while True:
                now = time.monotonic()
                self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= min(n, self.capacity):
                    self.tokens -= n     # may go negative for a big frame: the debt is waited off
                    return
                time.sleep((min(n, self.capacity) - self.tokens) / self.rate)

