"""Training across emulated hosts: equivalence, the bytes on each link, loss, and mpirun.

(a) 2 workers and 2 servers on 4 hosts (--sync ps, float64) end with the parameters of one process
    on the combined batch (rtol 1e-5, as tests/dist/test_equivalence.py); each rank ran in its own
    host's namespace, no pair of them took the other for a local peer, and every host's link
    carried, each way, at least the parameter bytes its role must move.
(b) The same run, every link capped at 100 Mbit/s by tbf: per host and direction, the TCP payload
    that crossed (tc's bytes minus its segments times their Ethernet, IPv4 and TCP headers) is at
    least what the job's --stats count (payload + message headers of every sync) and at most 5%
    more. What the 5% covers: ZeroMQ framing and CURVE (about 40 bytes per frame), the messages
    that are not syncs (registration, the book, heartbeats, the loss reduction; worker 0's INIT
    of the servers, its snapshot GET and the servers' answers: about one iteration's parameters
    each), TCP's handshakes, and retransmissions (none at this cap: tbf dropped nothing).
(d) 3% loss, 3 ms delay and 5% of frames held 6 ms more (overtaken), on worker 1's and server 0's
    links through the userspace forwarder: the run is bitwise that of the clean network.
(g) mpirun (Open MPI) starts the same job, one rank per host through an rsh agent that enters a
    host's namespace; ranks from OMPI_COMM_WORLD_RANK: bitwise the clean network's run.

Run: python -m pytest tests/hosts -q     (root; skipped otherwise)
"""
import shutil

import pytest

from poseidon.tools import netns as net
from poseidon.tools.netns.ranks import role_of

from ..dist.helpers import assert_params_close, fc_net, reference, solver_param
from . import REPORT
from .jobs import BATCH, Job, assert_bitwise_equal, wait_for

pytestmark = pytest.mark.slow   # every test here is a job across emulated hosts

PS_ITERS = 100                  # one-off messages stay within about 2% of the syncs' bytes
CAP = "100mbit"
SLACK = 0.05


def label(job, rank):
    return "%s %d" % role_of(rank, job.workers)


@pytest.fixture(scope="module")
def ps_run(data, tmp_path_factory):
    """The (a)/(b) run: 4 hosts at 100 Mbit/s, --sync ps, float64, --stats; and its reference."""
    folder = tmp_path_factory.mktemp("ps-run")
    weights = str(folder / "init.caffemodel")
    P1 = 2
    want = reference(solver_param(fc_net(data, P1 * BATCH), max_iter=PS_ITERS),
                     weights_out=weights)
    job = Job(folder / "job", data, workers=P1, servers=2, iters=PS_ITERS, dtype="float64",
              flags=["--sync", "ps", "--stats", "stats.jsonl", "--weights", weights])
    with net.Network(job.size) as network:
        for host in network.hosts:
            network.cap(host, CAP)
        procs = job.start(network)
        where = {}

        def placed():
            where.update({r: network.namespace_of(p.pid) for r, p in procs.items()})
            return all(where[r] is network.hosts[r] for r in procs)
        wait_for(placed, 30, "every rank inside its host's namespace", procs)
        job.wait(procs)
        links = {r: network.counters(network.hosts[r]) for r in procs}
        header = network.tcp_header_bytes(network.hosts[0])
        resent = {r: network.tcp_retransmits(network.hosts[r]) for r in procs}
    return {"job": job, "want": want, "links": links, "header": header, "where": where,
            "resent": resent}


def test_a_four_hosts_train_like_one_process_each_over_its_own_link(ps_run):
    job, links, header = ps_run["job"], ps_run["links"], ps_run["header"]
    assert [ps_run["where"][r].index for r in range(job.size)] == list(range(job.size))
    assert_params_close([g.reshape(w.shape) for g, w in zip(job.final_params(), ps_run["want"])],
                        ps_run["want"], rtol=1e-5, label="4 emulated hosts")
    for rank in range(job.size):
        out = job.output(rank)
        assert "on this host: Unix sockets" not in out, out[-2000:]
    assert "one host:" not in job.output(0)                       # no one-host buckets
    params = sum(w.nbytes for w in ps_run["want"])                # float64: what a worker moves
    held = {r: job.stats("server", r - job.workers)[-1]["bytes_held"]
            for r in range(job.workers, job.size)}
    assert sum(held.values()) == params
    lines = []
    for rank in range(job.size):
        must = PS_ITERS * (params if rank < job.workers else job.workers * held[rank])
        sent, received = (net.tcp_payload(links[rank][w], header) for w in ("sent", "received"))
        assert sent >= must and received >= must, (rank, sent, received, must)
        lines.append(f"{label(job, rank)}: {sent / 1e6:.2f} MB out, "
                     f"{received / 1e6:.2f} MB in (at least {must / 1e6:.2f} MB each way)")
    REPORT.append(f"(a) {PS_ITERS} iterations, --sync ps, float64, each rank in its own "
                      f"namespace; TCP payload per link: " + "; ".join(lines))


def test_b_tc_bytes_match_the_jobs_own_counters_within_5_percent(ps_run):
    job, links, header = ps_run["job"], ps_run["links"], ps_run["header"]
    assert all(links[r]["drops"] == 0 for r in links), links        # the cap lost nothing
    lines = []
    for rank in range(job.size):
        for way, key in (("sent", "sent"), ("received", "recv")):
            wire = net.tcp_payload(links[rank][way], header)
            mine = job.counted(rank, key)
            assert mine <= wire <= (1 + SLACK) * mine, \
                (f"{label(job, rank)} {way}: tc {wire} bytes of TCP payload, the job counted "
                 f"{mine}: {wire / mine - 1:+.2%}")
            lines.append(f"{label(job, rank)} {way} {wire / mine - 1:+.1%}")
    resent = sum(ps_run["resent"].values())
    REPORT.append(f"(b) at {CAP}: tc's TCP payload over the job's --stats bytes: "
                      + ", ".join(lines) + f"; tbf drops 0, TCP segments sent again: {resent}")


IMPAIRED = net.Impairment(loss=0.03, delay_ms=3.0, reorder=0.05, hold_ms=6.0, seed=7)


def test_d_loss_delay_and_reordering_leave_the_result_bitwise_unchanged(data, reference,
                                                                         networks, tmp_path):
    job = Job(tmp_path / "job", data, snapshot=4)
    network = networks(job.size, impaired={1: IMPAIRED, 2: IMPAIRED})
    job.wait(job.start(network))
    assert_bitwise_equal(job.final_params(), reference, "loss, delay and reordering")
    seen = []
    for host in (network.hosts[1], network.hosts[2]):
        resent = network.tcp_retransmits(host)
        counts = network.stop_forwarder(host)
        assert counts["dropped"] > 0 and counts["reordered"] > 0, counts
        seen.append(f"{counts['frames']} frames, {counts['dropped']} dropped, "
                    f"{counts['reordered']} overtaken, {resent} TCP segments sent again")
    REPORT.append(f"(d) {IMPAIRED.loss:.0%} loss, {IMPAIRED.delay_ms:g} ms delay, "
                      f"{IMPAIRED.reorder:.0%} held {IMPAIRED.hold_ms:g} ms, on worker 1's and "
                      f"server 0's links: " + "; ".join(seen) + "; bitwise equal")


def mpi_ranks_in(namespace):
    """OMPI_COMM_WORLD_RANK of each `poseidon train` process running in a namespace."""
    ranks = []
    for pid in net.pids_in(namespace):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"poseidon.tools.cli" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:                       # it ended meanwhile
            continue
        if b"OMPI_COMM_WORLD_RANK" in env:
            ranks.append(int(env[b"OMPI_COMM_WORLD_RANK"]))
    return ranks


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="Open MPI's mpirun not found (apt-get install openmpi-bin; .ci/run "
                           "installs it)")
def test_g_mpirun_starts_the_job_one_rank_per_host(data, reference, networks, tmp_path):
    job = Job(tmp_path / "job", data, snapshot=4)
    network = networks(job.size)
    launcher = job.mpirun(network)
    seen = {}

    def every_rank_on_its_host():
        for host in network.hosts:
            seen.update({rank: host.index for rank in mpi_ranks_in(host.name)})
        return len(seen) == job.size
    wait_for(every_rank_on_its_host, 60, "every rank started by mpirun", {"mpirun": launcher})
    assert seen == {r: r for r in range(job.size)}, seen
    job.wait({"mpirun": launcher})
    out = job.output("mpirun")
    assert "on this host: Unix sockets" not in out, out[-3000:]
    assert_bitwise_equal(job.final_params(), reference, "mpirun")
    assert not network.leftover(), network.leftover()
    REPORT.append("(g) mpirun -np 4 --map-by node over the 4 namespaces (rsh agent: ip netns "
                      "exec): bitwise equal")
