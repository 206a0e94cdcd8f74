"""What each distributed system of the papers brings to an iteration besides its sync plan: its
host-side rates, how it shards parameters over servers and how much of the line rate its TCP stack
delivers. One frozen record per system; each mode names its system (dist/sim/modes.py), and a
Network's explicit figures override the system's (`resolve`).

Why: the baselines the papers compare against were slow for reasons that are not the wire's line
rate (a CPU-side KV store, TCP under many-to-one fan-in, whole tensors on one server). Named
mechanisms with one source each replace a goodput fitted per figure; docs/simulate.md gives the
sources and the rows each mechanism does not reach.
"""
import dataclasses
import math
from dataclasses import dataclass

from ..coord.placement import DEFAULT_PAIR_BYTES

# a KV pair no tensor reaches: every tensor sits whole on one server (TensorFlow's sharding)
WHOLE_TENSORS = 1 << 40
PINNED_PCIE = 12e9          # PCIe 3.0 x16, pinned buffers, as measured in practice (bytes/s)


def host_copy_rate(param_bytes, batch, img_s_alone, img_s_with_ps):
    """Bytes/s one host thread copies, from one node's slowdown when Caffe syncs through a
    parameter server: the paper puts it on the RAM<->GPU memcpy every step forces (synchronous,
    through pageable memory, so a CPU copy into a staging buffer paces it); the gradients go
    down and the parameters come back, 2·bytes in the extra time."""
    extra = batch / img_s_with_ps - batch / img_s_alone
    return 2 * param_bytes / extra


# The 2017 paper's two byte-bound single-node slowdowns: VGG19-22K (229,052,817 float32
# parameters, batch 32) from 34.2 img/s in Caffe to 18.5 in Caffe+PS, 2.31 GB/s; VGG19
# (143,667,240, batch 32) from 35.5 to 21.3, 1.91 GB/s. Their mean, 2.11 GB/s (16.9 Gbit/s).
# GoogLeNet's (257 to 213.3 img/s for 28 MB) is left out: 58 small layers make it bound by
# messages, not bytes.
PAPER_HOST_COPY_RATE = (host_copy_rate(229_052_817 * 4, 32, 34.2, 18.5)
                        + host_copy_rate(143_667_240 * 4, 32, 35.5, 21.3)) / 2
# A server's adds and update: memory bound on the 16-core Xeon, several threads.
SERVER_UPDATE_RATE = 10e9
# TCP's share of the line rate when every node's 2 MB pairs fan in to every server at once
# (incast): from the paper's Fig. 8, WFBP on VGG19 at 16 nodes under 10, 20 and 30 GbE caps
# reaching about 8x, 12x and 15x; one figure for the three caps.
PS_FAN_IN_TCP_EFFICIENCY = 0.55


@dataclass(frozen=True)
class System:
    """One system's figures. `stack_rate` caps what a node's TCP stack moves per direction (the
    CPU copies of a host-side KV store); the link then runs at
    min(line rate · tcp_efficiency, stack_rate): a CPU-side KV store's socket thread copies each
    byte it sends, and each it receives, at one thread's copy rate."""
    name: str
    pcie: float = PINNED_PCIE
    update_rate: float = SERVER_UPDATE_RATE
    kv_pair_bytes: int = DEFAULT_PAIR_BYTES
    tcp_efficiency: float = PS_FAN_IN_TCP_EFFICIENCY
    stack_rate: float = PAPER_HOST_COPY_RATE


# Poseidon's KV store on the paper's cluster (16-core Xeon, Titan X, 40 GbE), 2 MB pairs, its
# copies pinned and on their own CUDA streams; Caffe+WFBP is this store without HybComm.
POSEIDON = System("Poseidon KV store")
# The paper's Caffe+PS: the same store, synced after the backward pass, its copies synchronous
# through pageable memory.
CAFFE_PS = dataclasses.replace(POSEIDON, name="Caffe+PS", pcie=PAPER_HOST_COPY_RATE)
# Stock distributed TensorFlow (r0.10): whole tensors on one parameter server each (the paper's
# first named cause), over gRPC on the same cluster's TCP.
TENSORFLOW = dataclasses.replace(POSEIDON, name="TensorFlow", kv_pair_bytes=WHOLE_TENSORS)
# The 2015 paper's Poseidon (Caffe of Oct 2014 on a Petuum parameter server; Opteron nodes, K20C
# GPUs, 40 GbE). Its network stack's rate is the one figure fitted: 0.171 GB/s (1.37 Gbit/s) per
# direction makes its baseline, AlexNet on 8 nodes without DWBP, come out at the paper's 2.2x
# (its footnote: protocol and software kept it well under the line rate). DWBP and SACP on the
# same nodes are then predictions.
STACK_RATE_2015 = 0.1714e9
FIRST_POSEIDON = System("Poseidon 2015", stack_rate=STACK_RATE_2015)
# Horovod: ring all-reduce, one TCP flow in and one out per node (no fan-in) and no CPU KV store.
HOROVOD = System("Horovod", update_rate=math.inf, tcp_efficiency=1.0, stack_rate=math.inf)


def resolve(net, system):
    """The Network a run uses: the system's figure wherever `net` leaves one as None, the link
    at min(line · tcp_efficiency, stack_rate), or at min(line, goodput) when a goodput is given."""
    def pick(value, default):
        return default if value is None else value
    line = net.bandwidth
    if net.goodput is not None:
        bandwidth = min(line, net.goodput)
    else:
        bandwidth = min(line * pick(net.tcp_efficiency, system.tcp_efficiency),
                        pick(net.stack_rate, system.stack_rate))
    pair = pick(net.kv_pair_bytes, system.kv_pair_bytes)
    return dataclasses.replace(
        net, bandwidth=bandwidth, goodput=None, tcp_efficiency=1.0, stack_rate=math.inf,
        pcie=pick(net.pcie, system.pcie), update_rate=pick(net.update_rate, system.update_rate),
        kv_pair_bytes=pair, chunk_bytes=pick(net.chunk_bytes, min(pair, DEFAULT_PAIR_BYTES)))
