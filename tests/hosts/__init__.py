"""Emulated hosts: a job's processes in network namespaces joined by a Linux bridge.

The harness itself (namespaces, bridge, capped and counted links, cuts, the userspace forwarder
that drops, delays and reorders frames, ranks started one per host, and the clean-up of all of
it) is poseidon.tools.netns, which `poseidon bench` uses too. Here are only the tests' own parts:

- jobs.py      the tests' small job (an FC net on an LMDB, its solver, snapshots) on top of
               poseidon.tools.netns.ranks.HostJob, and mpirun across the namespaces
- intruder.py  a host on the bridge without the job's keys that connects and sends to its ports
- REPORT       lines for the session summary (conftest.py prints them under "emulated hosts")

Needs root (and iproute2); skipped with the reason otherwise. Run: python -m pytest tests/hosts -q
"""
REPORT = []
