"""Emulated hosts: a job's processes in network namespaces joined by a Linux bridge.

On loopback every process of a job shares one network stack, so no byte of it crosses a link.
Here each rank runs in a namespace of its own, on its own address of a private range that exists
only inside the namespaces made here, so its traffic crosses a real link: rate-capped with tc's
tbf, counted by the qdisc, cut with `ip link set down`, or passed through a userspace forwarder
that drops, delays and reorders its frames.

- network.py   the namespaces, bridge, links (veth, or a tap pair through forwarder.py), rate caps,
               counters, cuts, the processes started in them, and the clean-up of all of it
- forwarder.py a bounded userspace frame forwarder between two tap devices (loss, delay,
               reordering, for kernels without netem)
- ranks.py     a `poseidon train` job's ranks started one per host with the multi-host flags

Needs root and iproute2; `why_unavailable()` says why not where it cannot run. Used by the tests
in tests/hosts/ and by `poseidon bench`'s part g.
"""
from .network import (Host, Impairment, Network, pids_in, sigterm_as_exit, sweep_stale,
                      tbf_rate, tcp_payload, why_unavailable)

__all__ = ["Host", "Impairment", "Network", "pids_in", "sigterm_as_exit", "sweep_stale", "tbf_rate",
           "tcp_payload", "why_unavailable"]
