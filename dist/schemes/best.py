"""BestScheme: Algorithm 1 of the Poseidon paper, over every registered scheme.

The paper compares two schemes' communication on the busiest node (Table 1: the parameter server's
2·M·N·(P1 + P2 − 2)/P2 floats against sufficient-factor broadcasting's 2·K·(P1 − 1)·(M + N)) and
takes the cheaper. Here each registered scheme states its own cost and where it applies, and the
cheapest that can sync the layer wins; a tie goes to the scheme that needs no servers (the paper's
"≤"). `--sync NAME` forces a scheme wherever it applies; elsewhere the layer goes by PS, which
applies to every layer. Under --straggler-timeout or --staleness only schemes that tolerate a late
or early worker (not `bsp_only`) may run: PS.

With the measured cost model (dist/cost/model.py) the comparison is on predicted seconds instead:
`choose_scheme(..., predicted={name: seconds})`, with the same applicability and tie rules.

`--sync A+B` is a hybrid over the named schemes alone: `ps+sfb` is the paper's Algorithm 1 as
published, beside which the hybrid over every registered scheme can be measured.
"""
from ..coord.records import LayerRecord
from ..errors import DistError
from .base import SCHEMES, scheme_class

FALLBACK = "ps"


def sync_choices():
    """What --sync accepts: hybrid (BestScheme per layer) and every registered scheme (and, beside
    them, a '+'-joined hybrid over some: hybrid_members)."""
    return ("hybrid",) + tuple(SCHEMES)


def hybrid_members(sync):
    """The scheme names a --sync value lets BestScheme choose among: every registered one for
    'hybrid', the named ones for 'A+B[+...]', None for a single forced scheme. An unknown name is
    one DistError line."""
    if sync == "hybrid":
        return tuple(SCHEMES)
    names = [n.strip() for n in str(sync).split("+")]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown or len(names) != len(set(names)):
        raise DistError(f"--sync '{sync}': give hybrid, one scheme or several joined by '+' "
                        f"(each once), from {', '.join(SCHEMES)}")
    return tuple(names) if len(names) > 1 else None


def usable_schemes(rec, relaxed=None, sync="hybrid"):
    """The registered scheme classes that can sync the layer `rec` (under `relaxed`, if set),
    among those a hybrid `sync` names."""
    members = hybrid_members(sync) or tuple(SCHEMES)
    return [cls for cls in SCHEMES.values()
            if cls.name in members and cls.applies_to(rec) and not (relaxed and cls.bsp_only)]


def choose_scheme(rec, P1, P2, sync="hybrid", relaxed=None, predicted=None):
    """The scheme's name for the layer the book describes as `rec`, with P1 workers and P2
    servers. `relaxed`: the option that relaxes BSP, if any. `predicted`: {scheme name: seconds}
    of the measured cost model, compared instead of the floats (the schemes it names only)."""
    usable = usable_schemes(rec, relaxed, sync)
    if hybrid_members(sync) is None:
        forced = scheme_class(sync)
        return forced.name if forced in usable else FALLBACK
    if not usable:
        return FALLBACK
    if predicted is not None:
        usable = [cls for cls in usable if cls.name in predicted]

        def cost(cls):
            return predicted[cls.name]
    else:
        def cost(cls):
            return cls.cost(rec, P1, P2)
    order = {name: i for i, name in enumerate(SCHEMES)}
    return min(usable, key=lambda cls: (cost(cls), cls.uses_servers, order[cls.name])).name


def best_scheme(sfb_capable, M, N, K, P1, P2, sync="hybrid", relaxed=None):
    """choose_scheme for a layer given by its GEMM shape: M outputs, N inputs, K rows a worker."""
    rec = LayerRecord(index=0, name="", type="", M=M, N=N, K=K, sfb=sfb_capable, params=())
    return choose_scheme(rec, P1, P2, sync, relaxed)


def possible_schemes(rec, sync="hybrid", relaxed=None):
    """Every scheme choose_scheme may pick for the layer under these options, whatever the costs
    (which a job may measure and change as it runs): the forced one or PS, or every usable one of
    the hybrid."""
    if hybrid_members(sync) is None:
        return [scheme_class(choose_scheme(rec, 1, 1, sync, relaxed))]
    return usable_schemes(rec, relaxed, sync) or [scheme_class(FALLBACK)]


def may_send_bottom_data(book, members, relaxed=None):
    """Whether a sync of these layers (the book's records) may send a layer's bottom data, so
    that the forward writing that blob must wait for it (dist/worker/layerwait.py)."""
    sync = book.options.get("sync", "hybrid")
    return any(cls.sends_bottom_data for li in members
               for cls in possible_schemes(book.layer(li), sync, relaxed))
