"""The Scheme interface and the registry of schemes by name.

A scheme says, as class attributes and static methods, what BestScheme needs to compare it with the
others (`applies_to`, `cost`, `uses_servers`, `bsp_only`), and, as an instance made per synced layer,
how one iteration's sync runs: `send(it, stats)` then `receive(it, stats)`, which between them must
leave the layer's parameters at their new values on this worker. It reaches its worker only
through the SyncContext its syncer holds (dist/worker/syncer.py).
"""
from poseidon.engine.solvers.health import all_finite, param_label

from ..errors import DistError

SCHEMES = {}


def register_scheme(cls):
    """Class decorator: make the scheme known by its `name` (once: a second class of the same name
    is refused, as Caffe refuses a layer type registered twice)."""
    if not cls.name:
        raise DistError(f"scheme class {cls.__name__} has no name")
    known = SCHEMES.get(cls.name)
    if known is not None and known is not cls:
        raise DistError(f"scheme '{cls.name}' is registered twice ({known.__module__}."
                        f"{known.__name__} and {cls.__module__}.{cls.__name__})")
    SCHEMES[cls.name] = cls
    return cls


def scheme_class(name):
    try:
        return SCHEMES[name]
    except KeyError:
        raise DistError(f"unknown synchronisation scheme '{name}' (known: "
                        f"{', '.join(sorted(SCHEMES))})") from None


def make_scheme(name, syncer):
    return scheme_class(name)(syncer)


class Scheme:
    name = None
    #: its parameters live on the KV servers (their update is the servers'); without servers it
    #: cannot run. A scheme without servers updates on every worker, which keeps its solver history.
    uses_servers = False
    #: it needs every worker's contribution of an iteration, so it cannot run under
    #: --straggler-timeout or --staleness (which let a worker be left out or run ahead)
    bsp_only = True
    #: the layer's weight gradient is made from its sufficient factors by the scheme, not by the
    #: layer's backward (the solver is told so through its hooks)
    factored = False
    #: it sends (or reads on its thread) the bottom data of its layers, which the next forward of
    #: the layers below overwrites (dist/worker/layerwait.py: that forward waits for it)
    sends_bottom_data = False

    @staticmethod
    def applies_to(rec):
        """Whether it can sync the layer the book describes as `rec` (a LayerRecord)."""
        return True

    @staticmethod
    def cost(rec, P1, P2):
        """Its communication cost for the layer, in floats per iteration on the busiest node."""
        raise NotImplementedError

    @classmethod
    def traffic(cls, rec, P1, P2):
        """What one iteration's sync of the layer costs, for the measured cost model
        (dist/cost/model.py): {"messages": messages on the busiest node, "floats": cost(),
        "flops": extra arithmetic on a worker}. This default: a request and an answer per server
        for a scheme with servers, a message to and from each peer otherwise, no arithmetic."""
        messages = 2 * P2 if cls.uses_servers else 2 * max(P1 - 1, 0)
        return {"messages": messages, "floats": cls.cost(rec, P1, P2), "flops": 0.0}

    @staticmethod
    def peer_arrays(rec, arrays):
        """The shapes the arrays of a peer's SF message for this layer must have (a scheme that
        syncs peer to peer sends its arrays in SF messages, checked on receipt), and how to say
        them in an error; shapes None: the count is wrong. Schemes with servers send none."""
        return None, "no peer-to-peer message"

    @staticmethod
    def ring_piece(rec, slot, workers, position):
        """Floats of piece `slot` of this layer that the worker at ring position `position` (of
        `workers`) may be sent in a RING message, or None: it takes no such piece. Only a scheme
        that passes pieces round a ring of workers (allreduce.py) takes any."""
        return None

    def __init__(self, syncer):
        self.syncer = syncer
        self.ctx = syncer.ctx

    def send(self, it, stats):
        raise NotImplementedError

    def receive(self, it, stats):
        raise NotImplementedError

    def unwritten_params(self):
        """The parameters whose diff the layer's backward does not write under this scheme."""
        return ()

    def nonfinite(self):
        """What of this layer's gradient holds NaN/Inf ('weight gradient', ...), or None. Checked
        before anything is sent, so a bad gradient never leaves the worker."""
        ctx = self.ctx
        for pid in self.syncer.pids:
            if not all_finite(ctx.net.learnable_params[pid].diff):
                li, bi = ctx.book.params[pid].owner
                where = (f" (of layer '{ctx.net.layer_names[li]}')"
                         if len(self.syncer.members) > 1 else "")   # a bucket of several layers
                return f"{param_label(bi)} gradient{where}"
        return None
