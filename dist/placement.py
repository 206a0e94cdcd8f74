"""Cutting parameters into KV pairs and spreading the pairs over the servers.

Why: one huge FC matrix on one server makes that server the bottleneck of every iteration (the
paper's motivation for its KV store). Each tensor is cut into pairs of at most `pair_bytes` (2 MB by
default), of equal length within the tensor, and the pairs go to servers by greedy longest-
processing-time: biggest pair first, each to the server holding the fewest bytes so far. With many
pairs of bounded size the most loaded server holds at most one pair more than the least loaded.
Placement is deterministic (ties broken by pair id and by server index), so every process that
computes it from the same book gets the same answer.
"""
import math

DEFAULT_PAIR_BYTES = 2 * 1024 * 1024


def parse_bytes(text):
    """'2MB', '512KB', '2MiB', '1048576' -> bytes (k/m/g are powers of 1024, as memory sizes)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace("IB", "B")
    mult = 1
    for suffix, m in (("KB", 1024), ("MB", 1024 ** 2), ("GB", 1024 ** 3), ("K", 1024),
                      ("M", 1024 ** 2), ("G", 1024 ** 3), ("B", 1)):
        if s.endswith(suffix):
            s, mult = s[:-len(suffix)], m
            break
    try:
        value = int(float(s) * mult)
    except ValueError:
        raise ValueError(f"cannot read the size '{text}': give bytes, or e.g. 2MB, 512KB") from None
    if value <= 0:
        raise ValueError(f"the KV pair size must be positive, got '{text}'")
    return value


def cut_pairs(param_counts, itemsize, pair_bytes=DEFAULT_PAIR_BYTES):
    """[(param id, element count)] -> [(pair id, param id, offset, length)], in param order.

    A tensor of C elements is cut into ceil(C*itemsize / pair_bytes) pairs of near-equal length."""
    per_pair = max(1, pair_bytes // itemsize)
    pairs = []
    for pid, count in param_counts:
        if count <= 0:
            continue
        n = max(1, math.ceil(count / per_pair))
        base, extra = divmod(count, n)
        offset = 0
        for i in range(n):
            length = base + (1 if i < extra else 0)
            pairs.append((len(pairs), pid, offset, length))
            offset += length
    return pairs


def place_pairs(pair_sizes, servers):
    """Greedy LPT: [size of pair i] -> [server index of pair i] (sizes in any unit)."""
    if servers < 1:
        if pair_sizes:
            raise ValueError("there are KV pairs to place but no servers")
        return []
    loads = [0] * servers
    where = [0] * len(pair_sizes)
    for i in sorted(range(len(pair_sizes)), key=lambda i: (-pair_sizes[i], i)):
        s = min(range(servers), key=lambda j: (loads[j], j))
        where[i] = s
        loads[s] += pair_sizes[i]
    return where


def server_loads(pair_sizes, where, servers):
    loads = [0] * servers
    for size, s in zip(pair_sizes, where):
        loads[s] += size
    return loads
