"""Cutting parameters into KV pairs and spreading the pairs over the servers.

Why: one huge FC matrix on one server makes that server the bottleneck of every iteration (the
paper's motivation for its KV store). Each tensor is cut into pairs of at most `pair_bytes` (2 MB by
default), of equal length within the tensor, and the bundles of pairs (below) go to servers by
greedy longest-processing-time: biggest first, each to the server holding the fewest bytes so far.
With many units of bounded size the most loaded server holds at most one unit more than the least.
Placement is deterministic (ties broken by pair id and by server index), so every process that
computes it from the same book gets the same answer.

Messages: consecutive pairs of one layer travel together, as the arrays of one message (a
bundle), while the bundle stays within `fusion_bytes` (by default the pair size, 2 MB). A bundle is
placed as one unit, so a small layer's weight and bias go to one server in one push and come back
in one reply, instead of one message per parameter. A 16-byte round trip costs about as much as
100 kB of payload on loopback, and each message costs Python and CURVE work on both sides, so for
small layers the count of messages, not their bytes, is the price. Bundles span layers only inside
a --bucket-bytes bucket (dist/coord/book.sync_groups; otherwise WFBP sends a layer as soon as its
backward is done), and at the default size a big parameter keeps its 2 MB messages, which the
server sums while the next ones arrive.
"""
import math
from dataclasses import replace

from .records import Bundle

DEFAULT_PAIR_BYTES = 2 * 1024 * 1024
MAX_BUNDLE_ARRAYS = 64            # arrays one KV message may carry (dist/coord/checks.py)


def parse_bytes(text, allow_zero=False, what="the KV pair size"):
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
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'0 or more' if allow_zero else 'positive'}, got "
                         f"'{text}'")
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


def bundle_pairs(pairs, fusion_bytes, itemsize):
    """[(pair id, length)] of ONE layer, in pair order -> [[pair id, ...], ...]: consecutive pairs
    packed into bundles of at most fusion_bytes (and MAX_BUNDLE_ARRAYS pairs); a pair alone is a
    bundle of one whatever its size; fusion_bytes 0: one pair each. The bundles are then placed
    as units (place_pairs), so each is one message to one server."""
    bundles = []
    size = 0
    for pid, length in pairs:
        nbytes = length * itemsize
        if (not bundles or not fusion_bytes or size + nbytes > fusion_bytes
                or len(bundles[-1]) >= MAX_BUNDLE_ARRAYS):
            bundles.append([])
            size = 0
        bundles[-1].append(pid)
        size += nbytes
    return bundles


def make_bundles(layers, cut, itemsize, fusion):
    """The KV messages of every PS sync of `layers` (those a scheme with servers may sync):
    [Bundle], from the cut [(pair id, param id, offset,
    length)] (bundle_pairs); a bundle's id is its first pair's id, which keys
    its push and its reply, and its layer is the one its sync is started after (rec.group, the
    layer itself unless --bucket-bytes joins it to the ones below it). The server is added by
    placement."""
    by_param = {}
    for pair_id, pid, _, length in cut:
        by_param.setdefault(pid, []).append((pair_id, length))
    members = {}
    for rec in layers:
        members.setdefault(rec.group, []).append(rec)
    bundles = []
    for trigger in sorted(members):
        own = [pair for rec in members[trigger] for pid in rec.params
               for pair in by_param.get(pid, [])]
        for ids in bundle_pairs(own, fusion, itemsize):
            bundles.append(Bundle(id=ids[0], layer=trigger, pairs=tuple(ids)))
    return bundles


def merge_on_servers(bundles):
    """The placed bundles of one sync that went to the same server, merged into one message (in
    order, up to MAX_BUNDLE_ARRAYS pairs). Why: a message in shared memory carries no bytes, so
    the fusion size that lets a big layer's answers stream back while its later pairs go out buys
    nothing there, and every message costs its Python on both sides (a large layer's hundred-odd
    pairs go as a few messages instead; docs/performance.md, "The distributed path on one host").
    Placement is unchanged: the pairs stay spread over the servers as the fusion size placed
    them."""
    merged, last = [], {}
    for bundle in bundles:
        key = (bundle.layer, bundle.server)
        at = last.get(key)
        if at is not None and len(merged[at].pairs) + len(bundle.pairs) <= MAX_BUNDLE_ARRAYS:
            merged[at] = replace(merged[at], pairs=merged[at].pairs + bundle.pairs)
            continue
        last[key] = len(merged)
        merged.append(bundle)
    return merged
