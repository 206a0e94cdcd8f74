"""The arithmetic of a ring all-reduce: which chunk each worker sends and receives at each step,
how a chunk is cut into pieces, how a piece is named on the wire, and what each worker moves.

Why apart from the scheme (allreduce.py): the receiving side's checks (dist/coord/checks.py) must know
the length of every piece a worker may be sent before the scheme sees it, and the cost model must
count the same pieces; both read this plan, which needs nothing but the layer's float count, the
number of workers and the piece size.

The layout: the layer's flat gradient of F floats is cut into P chunks (chunk c is floats
[c·F//P, (c+1)·F//P)), each cut into the same number of pieces. Worker at ring position r sends
to r + 1 and receives from r − 1. Reduce-scatter, steps s = 0 .. P − 2: r sends chunk r − 1 − s
(its own gradient at s = 0, then the partial sum it has just made) and receives chunk r − 2 − s,
to which it adds its own gradient; after the last step it holds the full sum of chunk r. All-gather,
steps s = 0 .. P − 2: r sends chunk r − s (its own full sum at s = 0, then what it has just
received) and receives chunk r − 1 − s, the full sum made by worker r − 1 − s. So each chunk is
summed once, in one order (starting at worker c + 1, ending at worker c), and every worker gets
those same bytes: the replicas stay bitwise identical.
"""
import functools
import math

REDUCE_SCATTER, ALL_GATHER = 0, 1
LAYER_BITS = 15                     # a piece's key: (slot << LAYER_BITS) | layer index
MAX_LAYERS = 1 << LAYER_BITS
MAX_SLOTS = 1 << 16                 # slots of one layer and iteration (the key is an int32)


def ring_key(layer, slot):
    """The message key of piece `slot` of a layer's ring (the mailbox files by type, key and
    iteration, so every piece of an iteration needs its own key)."""
    return (slot << LAYER_BITS) | layer


def ring_address(key):
    """(layer index, slot) of a piece's key (ring_key's inverse); a negative key gives a negative
    slot, which no plan has."""
    return key & (MAX_LAYERS - 1), key >> LAYER_BITS


def layer_floats(rec):
    """Floats of the layer's flat gradient: every synced learnable blob of it (weight and bias).
    A record without shapes (BestScheme asked with M, N, K alone) is taken to have a bias of M,
    Caffe's default, so that it is costed as the book would cost the layer."""
    if rec.shapes is None:
        return rec.M * rec.N + rec.M
    return sum(math.prod(s) for s in rec.shapes)


class RingPlan:
    """The chunks, pieces and slots of one layer's ring for `workers` workers."""

    def __init__(self, floats, workers, piece_floats):
        self.floats, self.workers = int(floats), int(workers)
        P = self.workers
        self.bounds = [c * self.floats // P for c in range(P + 1)]
        widest = max(b - a for a, b in zip(self.bounds, self.bounds[1:]))
        steps = 2 * max(P - 1, 1)
        self.pieces = max(1, min(-(-widest // max(1, int(piece_floats))), MAX_SLOTS // steps))
        self.slots = 2 * (P - 1) * self.pieces

    # ----- where a piece is --------------------------------------------------------------------
    def piece(self, chunk, j):
        """(start, end) in the flat gradient of piece j of chunk `chunk`."""
        lo, hi = self.bounds[chunk], self.bounds[chunk + 1]
        n = hi - lo
        return lo + j * n // self.pieces, lo + (j + 1) * n // self.pieces

    def slot(self, phase, step, j):
        return (phase * (self.workers - 1) + step) * self.pieces + j

    def sent_chunk(self, phase, step, position):
        """The chunk the worker at `position` sends at this step."""
        shift = 1 if phase == REDUCE_SCATTER else 0
        return (position - shift - step) % self.workers

    def received_chunk(self, phase, step, position):
        """The chunk the worker at `position` receives at this step (its left neighbour's
        sent_chunk)."""
        return self.sent_chunk(phase, step, position - 1)

    def expected_length(self, slot, position):
        """Floats of the piece `slot` the worker at `position` may be sent, or None for a slot
        this ring does not have."""
        if not 0 <= slot < self.slots:
            return None
        phase_step, j = divmod(slot, self.pieces)
        phase, step = divmod(phase_step, self.workers - 1)
        lo, hi = self.piece(self.received_chunk(phase, step, position), j)
        return hi - lo

    # ----- what it moves ------------------------------------------------------------------------
    def chunk_floats(self, chunk):
        return self.bounds[chunk % self.workers + 1] - self.bounds[chunk % self.workers]

    def floats_sent(self, position):
        """Floats the worker at `position` sends per iteration: every chunk but its own in the
        reduce-scatter, every chunk but its right neighbour's in the all-gather."""
        if self.workers == 1:
            return 0
        return 2 * self.floats - self.chunk_floats(position) - self.chunk_floats(position + 1)

    def floats_received(self, position):
        """... and receives: every chunk but its left neighbour's, then every chunk but its own."""
        if self.workers == 1:
            return 0
        return 2 * self.floats - self.chunk_floats(position - 1) - self.chunk_floats(position)

    def adds(self, position):
        """Floats the worker at `position` adds per iteration (the reduce-scatter's sums)."""
        return 0 if self.workers == 1 else self.floats - self.chunk_floats(position - 1)


@functools.lru_cache(maxsize=1024)
def ring_plan(floats, workers, piece_floats):
    """The (cached) plan of a layer of `floats` floats on `workers` workers."""
    return RingPlan(floats, workers, piece_floats)
