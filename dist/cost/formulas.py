"""The communication cost model of the Poseidon paper (Table 1), in floats per iteration.

The figures are for an M×N fully connected weight, P1 workers, P2 servers and per-worker batch K,
counted on the busiest node when every node is both a worker and a server (send plus receive):

    PS    2·M·N·(P1 + P2 − 2) / P2     each worker pushes and pulls the matrix; a server's shard
                                       comes from P1 − 1 remote workers and goes back to them
    SFB   2·K·(P1 − 1)·(M + N)         each worker sends its K·(M + N) factors to P1 − 1 peers
                                       and receives theirs
    Adam  P1·K·(M + N) + P1·M·N        factors up, full matrix down (the comparator in the paper)
    Ring  2·2·(P1 − 1)/P1·F            ring all-reduce (not in the paper): a worker sends (P1 − 1)/P1
                                       of the layer's F floats in the reduce-scatter and as much in
                                       the all-gather, and receives as much as it sends; no server

They follow from the payload a scheme moves per worker, which the tests measure on the wire:
PS pushes and pulls the layer's M·N (+M bias) floats once; SFB sends K·(M + N) (+M bias) floats to
each of the P1 − 1 peers; the ring sends and receives 2·(P1 − 1)/P1 of F each.

What each counts: PS and SFB, as in Table 1, count the weight matrix only (M·N, or SFB's factors);
the ring counts F, every synced learnable blob of the layer (M·N and the bias), because it moves
them as one flat gradient. The ring's figure is exact when P1 divides F; otherwise its chunks differ
by one float, and a worker moves up to 4 floats more or less than it. Payload only, never headers.
BestScheme (dist/schemes/best.py) compares the registered schemes' costs per layer.
"""


def ps_cost(M, N, P1, P2):
    """Floats per iteration on the busiest node for the parameter server (Table 1)."""
    if P2 <= 0:
        return float("inf")
    return 2.0 * M * N * (P1 + P2 - 2) / P2


def sfb_cost(M, N, K, P1):
    """Floats per iteration on the busiest node for sufficient-factor broadcasting (Table 1)."""
    return 2.0 * K * (P1 - 1) * (M + N)


def adam_cost(M, N, K, P1):
    """Floats per iteration at the server for Adam-style factors-up, matrix-down (comparator)."""
    return float(P1 * K * (M + N) + P1 * M * N)


def allreduce_cost(floats, P1):
    """Floats per iteration on the busiest node for a ring all-reduce of `floats` floats: sent
    plus received, 2·2·(P1 − 1)/P1·floats (every node is a worker; servers move nothing)."""
    return 4.0 * (P1 - 1) * floats / P1 if P1 > 0 else 0.0


def scheme_costs(M, N, K, P1, P2):
    return {"ps": ps_cost(M, N, P1, P2), "sfb": sfb_cost(M, N, K, P1),
            "adam": adam_cost(M, N, K, P1)}
