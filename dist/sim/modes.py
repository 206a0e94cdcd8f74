"""What one run of the simulator is asked and what it answers: the sync modes (`MODES`), the
cluster's figures (`Network`) and one iteration's outcome (`Result`).

Why apart from simulate.py: these are the plain records a caller fills in and reads (the command
line builds a Network from its flags and checks modes against MODES); simulate.py keeps the event
model alone.
"""
import math
from dataclasses import dataclass, field

from .systems import CAFFE_PS, FIRST_POSEIDON, HOROVOD, POSEIDON, TENSORFLOW, System


@dataclass(frozen=True)
class Mode:
    """How one mode syncs: `plan` is ps, sfb (every FC layer), hybrid (Algorithm 1), allreduce or
    timed (per layer by predicted time, dist/sim/cost.py); `overlap` is WFBP; `priority` serves
    lower layers first on every queue; `layerwise` lets the next forward start on a layer as soon
    as that layer is synced; `system` gives the host, sharding and TCP figures
    (dist/sim/systems.py)."""
    plan: str
    overlap: bool
    priority: bool = False
    layerwise: bool = False
    label: str = ""
    system: System = POSEIDON


MODES = {
    "ps-nooverlap": Mode("ps", False, label="PS, no overlap", system=CAFFE_PS),   # Caffe+PS
    "wfbp": Mode("ps", True, label="WFBP (PS)"),                 # Caffe+WFBP
    "poseidon": Mode("hybrid", True, label="Poseidon (paper)"),  # WFBP + Algorithm 1 per layer
    "sfb": Mode("sfb", True, label="SFB for FC, PS elsewhere"),
    "allreduce": Mode("allreduce", True, label="ring all-reduce"),
    "hybrid-nooverlap": Mode("hybrid", False, label="Poseidon (paper), no overlap"),
    "ps-sfb-ar": Mode("timed", True, label="PS+SFB+all-reduce"),
    "ps-sfb-ar-priority": Mode("timed", True, priority=True, layerwise=True,
                               label="PS+SFB+all-reduce, priority"),
    "tf": Mode("ps", False, label="TensorFlow (stock)", system=TENSORFLOW),
    "horovod": Mode("allreduce", True, label="Horovod (ring all-reduce)", system=HOROVOD),
    # the 2015 paper's three settings: traditional BP, DWBP (its WFBP), DWBP + SACP (its HybComm)
    "nodwbp-2015": Mode("ps", False, label="Poseidon 2015, no DWBP", system=FIRST_POSEIDON),
    "dwbp-2015": Mode("ps", True, label="Poseidon 2015, DWBP", system=FIRST_POSEIDON),
    "sacp-2015": Mode("hybrid", True, label="Poseidon 2015, DWBP+SACP", system=FIRST_POSEIDON),
}


@dataclass
class Network:
    """Link and host figures; rates in bytes/s (math.inf for 'free'), latency in seconds. A
    figure left None is the mode's system's (dist/sim/systems.py, `resolve`)."""
    bandwidth: float = 40e9 / 8        # the line rate, each direction
    latency: float = 5e-6
    pcie: float = None                 # GPU<->host copies, each direction
    update_rate: float = None          # bytes/s a server adds or applies
    gemm_rate: float = None            # FLOP/s of the SFB rebuild and all-reduce's reduction
    #                                    (None: the profile's own rate, its FLOPs over its time)
    intra_bandwidth: float = 12e9      # between the G devices of a node and their leader (PCIe)
    chunk_bytes: int = None            # messages cross the wire in pieces of at most this
    kv_pair_bytes: int = None
    separate_servers: bool = False     # servers on their own nodes instead of beside the workers
    goodput: float = None              # given: the link runs at min(bandwidth, goodput) instead
    tcp_efficiency: float = None       # TCP's share of the line rate
    stack_rate: float = None           # the most a node's TCP stack moves, each direction

    @classmethod
    def ideal(cls, **kw):
        """Everything but compute free: the speedup must then be P1."""
        base = dict(bandwidth=math.inf, latency=0.0, pcie=math.inf, update_rate=math.inf,
                    gemm_rate=math.inf, intra_bandwidth=math.inf, tcp_efficiency=1.0,
                    stack_rate=math.inf)
        base.update(kw)
        return cls(**base)


@dataclass
class Result:
    mode: str
    workers: int
    servers: int
    iteration_s: float
    compute_s: float
    speedup: float
    schemes: dict
    devices: int = 1
    plan: str = ""                     # for a by-time mode: which candidate plan ran
    node_bytes_sent: list = field(default_factory=list)
    node_bytes_received: list = field(default_factory=list)
    layer_done_s: dict = field(default_factory=dict)
    backward_done_s: float = 0.0
    events: int = 0

    def as_dict(self):
        return dict(self.__dict__)
