"""BestScheme: Algorithm 1 of the Poseidon paper, over every registered scheme.

The paper compares two schemes' communication on the busiest node (Table 1: the parameter server's
2·M·N·(P1 + P2 − 2)/P2 floats against sufficient-factor broadcasting's 2·K·(P1 − 1)·(M + N)) and
takes the cheaper. Here each registered scheme states its own cost and where it applies, and the
cheapest that can sync the layer wins; a tie goes to the scheme that needs no servers (the paper's
"≤"). `--sync NAME` forces a scheme wherever it applies; elsewhere the layer goes by PS, which
applies to every layer. Under --straggler-timeout or --staleness only schemes that tolerate a late
or early worker (not `bsp_only`) may run: PS.
"""
from .base import SCHEMES, scheme_class

FALLBACK = "ps"


def sync_choices():
    """What --sync accepts: hybrid (BestScheme per layer) and every registered scheme."""
    return ("hybrid",) + tuple(SCHEMES)


def _usable(rec, relaxed):
    return [cls for cls in SCHEMES.values()
            if cls.applies_to(rec) and not (relaxed and cls.bsp_only)]


def choose_scheme(rec, P1, P2, sync="hybrid", relaxed=None):
    """The scheme's name for the layer the book describes as `rec`, with P1 workers and P2
    servers. `relaxed`: the option that relaxes BSP, if any."""
    usable = _usable(rec, relaxed)
    if sync != "hybrid":
        forced = scheme_class(sync)
        return forced.name if forced in usable else FALLBACK
    order = {name: i for i, name in enumerate(SCHEMES)}
    return min(usable, key=lambda cls: (cls.cost(rec, P1, P2), cls.uses_servers,
                                        order[cls.name])).name


def best_scheme(sfb_capable, M, N, K, P1, P2, sync="hybrid", relaxed=None):
    """choose_scheme for a layer given by its GEMM shape: M outputs, N inputs, K rows a worker."""
    return choose_scheme({"sfb": sfb_capable, "M": M, "N": N, "K": K}, P1, P2, sync, relaxed)


def possible_schemes(rec, sync="hybrid", relaxed=None):
    """Every scheme choose_scheme may pick for the layer under these options, whatever the costs
    (which a job may measure and change as it runs): the forced one or PS, or every usable one."""
    if sync != "hybrid":
        return [scheme_class(choose_scheme(rec, 1, 1, sync, relaxed))]
    return _usable(rec, relaxed)


def may_send_bottom_data(book, members, relaxed=None):
    """Whether a sync of these layers (the book's records) may send a layer's bottom data, so
    that the forward writing that blob must wait for it (dist/layerwait.py)."""
    sync = book.options.get("sync", "hybrid")
    return any(cls.sends_bottom_data for li in members
               for cls in possible_schemes(book.layer(li), sync, relaxed))
