"""How a layer's parameters are synchronised: one class a scheme, registered by name, and BestScheme.

A scheme is a class with `@register_scheme` (dist/schemes/base.py has the interface). The paper's
two are here: the sharded parameter server (ps.py) and sufficient-factor broadcasting (sfb.py);
and a third, a ring all-reduce among the workers (allreduce.py, its plan in ring.py).
BestScheme (best.py) compares the registered schemes' own costs for each layer, so a new scheme —
defined anywhere, even in a test file — is chosen where it is cheapest and can be forced with
`--sync NAME`, with no change to the worker loop, the book or the command line.
"""
from .base import SCHEMES, Scheme, make_scheme, register_scheme, scheme_class  # noqa: F401
from . import ps, sfb, allreduce  # noqa: F401,E402  (register the paper's two, then the ring)
from .best import (best_scheme, choose_scheme, hybrid_members, may_send_bottom_data,  # noqa: F401,E402
                   possible_schemes, sync_choices, usable_schemes)
