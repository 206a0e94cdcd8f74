"""The communication cost model of the Poseidon paper (Table 1), in floats per iteration.

The figures are for an M×N fully connected weight, P1 workers, P2 servers and per-worker batch K,
counted on the busiest node when every node is both a worker and a server (send plus receive):

    PS    2·M·N·(P1 + P2 − 2) / P2     each worker pushes and pulls the matrix; a server's shard
                                       comes from P1 − 1 remote workers and goes back to them
    SFB   2·K·(P1 − 1)·(M + N)         each worker sends its K·(M + N) factors to P1 − 1 peers
                                       and receives theirs
    Adam  P1·K·(M + N) + P1·M·N        factors up, full matrix down (the comparator in the paper)

They follow from the payload a scheme moves per worker, which the tests measure on the wire:
PS pushes and pulls the layer's M·N (+M bias) floats once; SFB sends K·(M + N) (+M bias) floats to
each of the P1 − 1 peers. BestScheme (dist/coordinator.py) compares the first two.
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


def ps_payload_per_worker(M, N, bias=True):
    """Floats one worker pushes (and then pulls) for a layer synced by PS."""
    return M * N + (M if bias else 0)


def sfb_payload_per_peer(M, N, K, bias=True):
    """Floats one worker sends to EACH of its P1 − 1 peers for a layer synced by SFB."""
    return K * (M + N) + (M if bias else 0)


def scheme_costs(M, N, K, P1, P2):
    return {"ps": ps_cost(M, N, P1, P2), "sfb": sfb_cost(M, N, K, P1),
            "adam": adam_cost(M, N, K, P1)}
