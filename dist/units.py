"""Rates and durations written by people: the one reading of `--bandwidth`, `--pcie`, `--latency`
and every other flag that takes one (docs/configuration.md, "Rates and durations").

Why one module: the transport's send cap and the simulator's network read the same words, so
'10GbE' must mean the same bytes per second in both, and a mistake must read the same way.

A rate is a number, a decimal prefix and a unit, optionally per second:

    40Gbit  10GbE  1.5gbps  100Mbit/s     bits (a lower-case b, or the word bit)
    125MB   1.25GB/s  5GBps   2Mbyte      bytes (an upper-case B, or the word byte)
    inf                                   unlimited, only where the flag says so

Prefixes k, M, G, T (either case) are powers of 1000, as link speeds are quoted. A number without
a unit is refused: whether '1000' meant bits or bytes is a factor of eight nobody can guess.
"""
import math
import re

RATE_EXAMPLES = "1Gbit, 100Mbit, 1.5Gbps or 125MB/s"
INFINITE_WORDS = ("inf", "infinite", "unlimited")
_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE = re.compile(r"(?P<number>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*"
                   r"(?P<prefix>[kKmMgGtT]?)"
                   r"(?P<unit>[bB][iI][tT][sS]?|[bB][yY][tT][eE][sS]?|b[eE]?|B)"
                   r"(?:/s|ps)?")
_DURATION = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(ns|us|ms|s)?")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}


def _is_bytes(unit):
    return unit == "B" or unit.lower().startswith("byte")


def parse_rate(text, flag="the rate", infinite=False):
    """Bytes per second of a rate written as the module's docstring says; math.inf for 'inf'
    when `infinite`. A ValueError names `flag` and shows what to write."""
    s = str(text).strip()
    examples = RATE_EXAMPLES.replace(" or ", ", ") + ", or inf" if infinite else RATE_EXAMPLES
    if s.lower() in INFINITE_WORDS:
        if infinite:
            return math.inf
        raise ValueError(f"{flag} cannot be infinite: give a number and a unit, e.g. {examples}")
    m = _RATE.fullmatch(s)
    if not m:
        hint = (f" ('{s}' has no unit: {s}bit means bits, {s}B bytes)"
                if re.fullmatch(r"[0-9.eE+-]+", s) else "")
        raise ValueError(f"cannot read {flag} '{text}': give a number and a unit, e.g. "
                         f"{examples}{hint}")
    value = float(m.group("number")) * _PREFIXES[m.group("prefix").lower()]
    if value <= 0:
        raise ValueError(f"{flag} must be positive, got '{text}'")
    return value if _is_bytes(m.group("unit")) else value / 8


def parse_latency(text, flag="the latency"):
    """Seconds of a duration: '5us', '0.1ms', '20ns', '1e-6s'; a bare number is seconds (a
    delay has one unit, so nothing is ambiguous), and '0' is no delay."""
    s = str(text).strip().lower().replace(" ", "").replace("µ", "u")
    m = _DURATION.fullmatch(s)
    if not m:
        raise ValueError(f"cannot read {flag} '{text}': give e.g. 5us, 0.1ms or 0")
    return float(m.group(1)) * _SECONDS[m.group(2)]
