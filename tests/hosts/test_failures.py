"""Faults across emulated hosts: a cut link, a host without the keys, a SIGKILLed process.

(c) Worker 1's link goes down (`ip link set eth0 down`) mid-run: every process on every host stops
    within the heartbeat deadline, each naming the rank it lost (the others name worker 1; worker 1
    names the coordinator), and none is left running. The same command with `--resume auto` then
    finishes from the newest complete snapshot, bitwise equal to the undisturbed run.
(e) A fifth host on the bridge, without the job's secret key, connects and sends to every port of
    the job while it trains: no connection is admitted, nothing comes back but the handshake
    bytes, and the job's result is bitwise that of the undisturbed run.
(f) SIGKILL: the rank-0 process of a multi-host job (the one the coordinator lives in; a
    multi-host job has no launcher), and the local launcher (`poseidon train --workers 2
    --servers 1` inside one namespace): no process is left on any host.

The job is slowed where a test must act while it runs (a rate cap on one link): a cap changes
when bytes arrive, never which, so the results stay bitwise comparable.

Run: python -m pytest tests/hosts -q     (root; skipped otherwise)
"""
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from poseidon.tools import netns as net

from . import REPORT
from .jobs import (CALM_HEARTBEAT_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, ROOT, Job, assert_bitwise_equal,
                   cli, environment, public_key, wait_for)

pytestmark = pytest.mark.slow   # every test here is a job across emulated hosts

SLOW = "256kbit"                # keeps a 12-iteration job running for some seconds
SLOW_BURST = "8kb"
# From the cut, a process may take this long beyond --heartbeat-timeout to be gone: the loss is
# declared on the transport's next tick after the silence passes the timeout, then the ABORT
# reaches the others and each closes its sockets (linger 0.5 s) and exits.
EXIT_ALLOWANCE_S = 3.0
STOP_WAIT_S = HEARTBEAT_TIMEOUT_S + 30.0


def stop_times(procs, since, limit=STOP_WAIT_S):
    """{rank: seconds from `since` to its exit}, polling (bounded); None for one still running."""
    times = {}
    deadline = since + limit
    while time.monotonic() < deadline and len(times) < len(procs):
        for rank, proc in procs.items():
            if rank not in times and proc.poll() is not None:
                times[rank] = time.monotonic() - since
        time.sleep(0.02)
    return {rank: times.get(rank) for rank in procs}


def snapshot_written(job, iteration):
    return lambda: Path(f"{job.snapshot_prefix}_iter_{iteration}.manifest.json").exists()


def test_c_a_cut_link_stops_every_host_and_resume_auto_finishes_bitwise(data, reference, networks,
                                                                        tmp_path):
    job = Job(tmp_path / "job", data, snapshot=4, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
    network = networks(job.size)
    victim = network.hosts[1]                      # worker 1: SFB peer of worker 0, PS client
    network.cap(victim, SLOW, burst=SLOW_BURST)
    procs = job.start(network)
    wait_for(snapshot_written(job, 4), 90, "the snapshot of iteration 4", procs)
    network.cut(victim)
    cut = time.monotonic()
    times = stop_times(procs, cut)
    outputs = {r: job.output(r) for r in procs}
    assert all(t is not None for t in times.values()), \
        (times, {r: out[-1000:] for r, out in outputs.items()})
    for rank, proc in procs.items():
        assert proc.returncode != 0, f"rank {rank} ended before the cut:\n{outputs[rank][-2000:]}"
        lost = "the coordinator (beside worker 0)" if rank == 1 else "worker 1"
        assert re.search(rf"stopping: .*lost contact with {re.escape(lost)}", outputs[rank]), \
            f"rank {rank} does not name {lost}:\n{outputs[rank][-2000:]}"
        assert times[rank] <= HEARTBEAT_TIMEOUT_S + EXIT_ALLOWANCE_S, (rank, times)
    assert not network.leftover(), network.leftover()

    network.restore(victim)
    network.cap(victim, None)
    again = job.start(network, attempt="-resumed", extra=[
        "--resume", "auto", "--heartbeat-timeout", CALM_HEARTBEAT_TIMEOUT_S])     # no fault now
    job.wait(again, attempt="-resumed")
    assert "resuming from" in job.output(0, "-resumed"), job.output(0, "-resumed")[-2000:]
    assert_bitwise_equal(job.final_params(), reference, "resumed after the cut")
    REPORT.append(f"(c) worker 1's link cut after the snapshot of iteration 4, "
                      f"--heartbeat-timeout {HEARTBEAT_TIMEOUT_S:g}: stopped after "
                      + ", ".join(f"rank {r} {t:.1f} s" for r, t in sorted(times.items()))
                      + "; --resume auto: bitwise equal")


def test_e_a_host_without_the_keys_gets_nothing_and_changes_nothing(data, reference, networks,
                                                                    tmp_path):
    job = Job(tmp_path / "job", data, snapshot=4)
    network = networks(job.size)
    intruder = network.add_host()
    network.cap(network.hosts[1], SLOW, burst=SLOW_BURST)      # the job runs through the attack
    procs = job.start(network)
    coordinator = job.coordinator(network)
    inboxes = []

    def every_port_open():
        listening = {h.index: network.listening(h) for h in network.hosts[:job.size]}
        inboxes[:] = [a for ports in listening.values() for a in ports if a != coordinator]
        return coordinator in listening[0] and all(listening.values())
    wait_for(every_port_open, 60, "every rank listening", procs)
    wait_for(snapshot_written(job, 4), 90, "the snapshot of iteration 4", procs)
    argv = [sys.executable, "-m", "tests.hosts.intruder", "--public", public_key(job.keys),
            "--coordinator", coordinator] + [x for a in inboxes for x in ("--inbox", a)]
    attack = network.spawn(intruder, argv, tmp_path / "intruder.log", env=environment(), cwd=ROOT)
    attack.wait(60)
    log = (tmp_path / "intruder.log").read_text()
    assert attack.returncode == 0, log
    running = [r for r, p in procs.items() if p.poll() is None]
    network.cap(network.hosts[1], None)
    job.wait(procs)
    assert running == list(procs), f"the job ended before the attack did: {running}"
    seen = json.loads(log.strip().splitlines()[-1])
    assert seen["ports"] == 1 + job.size and seen["not_refused"] == [], seen
    assert seen["messages_received"] == 0 and seen["raw_closed"] == seen["ports"], seen
    got = network.counters(intruder)["received"]
    got_payload = net.tcp_payload(got, network.tcp_header_bytes(intruder))
    # what a refused client may be sent: greetings (64 bytes), CURVE's WELCOME (168) and an
    # ERROR, again on each of ZeroMQ's reconnections (no message: messages_received is 0)
    handshake_bytes = 1024 * seen["sockets"] + 128 * seen["ports"]
    assert got_payload <= handshake_bytes, (got, seen)
    assert_bitwise_equal(job.final_params(), reference, "with an intruder on the bridge")
    REPORT.append(f"(e) an intruder on the bridge: {seen['sockets']} ZeroMQ sockets and "
                      f"{seen['ports']} raw clients on {seen['ports']} ports, "
                      f"{seen['attempted']} messages sent; all refused; it received "
                      f"{got_payload} bytes of TCP payload (handshakes; {seen['raw_received']} "
                      f"on the raw clients), 0 messages; bitwise equal")


def _wait_for_progress(job, procs, stats="stats.worker-0.jsonl", lines=2):
    path = job.folder / stats
    wait_for(lambda: path.exists() and len(path.read_text().splitlines()) >= lines, 90,
             f"{lines} iterations in {path.name}", procs)


@pytest.mark.parametrize("victim", ["rank 0", "local launcher"])
def test_f_a_sigkill_leaves_no_process_on_any_host(data, networks, tmp_path, victim):
    job = Job(tmp_path / "job", data, iters=1_000_000, flags=["--stats", "stats.jsonl"],
              heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
    network = networks(job.size)
    if victim == "rank 0":
        procs = job.start(network)
        target = procs[0]
    else:
        argv = cli("train", "--solver", job.solver, "--workers", 2, "--servers", 1,
                   "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S, "--stats", "stats.jsonl",
                   "--no-progress")
        target = network.spawn(network.hosts[0], argv, job.log("launcher"), env=environment(),
                               cwd=job.folder)
        procs = {"launcher": target}
    _wait_for_progress(job, procs)
    running = {h.index: len(net.pids_in(h.name)) for h in network.hosts}
    expected = ({h.index: 1 for h in network.hosts} if victim == "rank 0" else
                {0: 4, 1: 0, 2: 0, 3: 0})           # the launcher and its 3 children
    assert running == expected, running
    os.kill(target.pid, signal.SIGKILL)
    killed = time.monotonic()
    gone = {}

    def nothing_left():
        gone.update({h.name: time.monotonic() - killed for h in network.hosts
                     if h.name not in gone and not net.pids_in(h.name)})
        return len(gone) == len(network.hosts)
    wait_for(nothing_left, STOP_WAIT_S, "every host empty after the SIGKILL")
    assert not network.leftover()
    last = max(gone.values())
    if victim == "rank 0":
        for rank in range(1, job.size):
            out = job.output(rank)
            assert "the coordinator (beside worker 0)" in out, f"rank {rank}:\n{out[-2000:]}"
        assert last <= HEARTBEAT_TIMEOUT_S + EXIT_ALLOWANCE_S, gone
    who = victim if victim == "rank 0" else f"the {victim}"
    REPORT.append(f"(f) SIGKILL of {who}: every host empty after {last:.1f} s")
