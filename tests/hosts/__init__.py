"""Emulated hosts: a job's processes in network namespaces joined by a Linux bridge.

Every other multi-host test runs on loopback, where the processes share one network stack (and,
before the host identity named the network namespace, Unix sockets and shared memory too). Here
each rank runs in a namespace of its own, on its own address of a private range that exists only
inside the namespaces these tests make, so its traffic crosses a real link: rate-capped with tc,
counted by the qdisc, cut with `ip link set down`, or passed through a userspace forwarder that
drops, delays and reorders its frames.

- network.py   the namespaces, bridge, links (veth, or a tap pair through forwarder.py), rate caps,
               counters, cuts, the processes started in them, and the clean-up of all of it
- forwarder.py a bounded userspace frame forwarder between two tap devices (loss, delay, reordering:
               this kernel has no netem)
- jobs.py      a small job (data, solver, key file) and its ranks started with the documented
               multi-host flags, one per host, or by mpirun across the namespaces
- intruder.py  a host on the bridge without the job's keys that connects and sends to its ports

Needs root (and iproute2); skipped with the reason otherwise. Run: python -m pytest tests/hosts -q
"""
