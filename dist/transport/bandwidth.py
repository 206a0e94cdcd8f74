"""The send-rate cap of `--bandwidth`: its text read as bytes per second, and the token bucket senders
take from.

Why a cap at all: it is for experiments. Processes of one machine talk as fast as memory moves, so
the schemes (PS against SFB, how much of the sync hides behind the backward) can only be compared
at a network speed the machine does not have by capping what each process sends.
"""
import re
import threading
import time

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH = re.compile(r"^([0-9.]+(?:e[0-9]+)?)\s*([kKmMgGtT]?)(bit|bits|b|bps|bE|be|B|byte|bytes)?(?:/s|ps)?$")


def parse_bandwidth(text):
    """'1Gbit', '10GbE', '500Mbit/s', '1e9' (bits/s), '125MB' or '125MB/s' (bytes) -> bytes per second.

    A lower-case b (or 'bit') means bits, an upper-case B (or 'byte') bytes, as network people write."""
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        return float(text) / 8
    m = _BANDWIDTH.match(str(text).strip())
    if not m:
        raise ValueError(f"cannot read the bandwidth '{text}': give e.g. 1Gbit, 100Mbit, 10GbE or 125MB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    unit = m.group(3) or "bit"
    if value <= 0:
        raise ValueError(f"the bandwidth must be positive, got '{text}'")
    return value if unit in ("B", "byte", "bytes") else value / 8


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

