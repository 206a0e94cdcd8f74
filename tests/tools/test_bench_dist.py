"""The distributed parts of `poseidon bench` (tools/bench/dist_parts.py): how iteration times are
taken from the jobs' stats (warm-up left out, rounds paired for the hybrid / no-overlap ratio),
and part c's alternating measurement end to end (a real KV server process). No timing assertions.
"""
from pathlib import Path

import pytest

from poseidon.tools.bench import dist_parts, report


def _records(times, sent=1000):
    return [{"time": t, "barrier_wait_s": 0.01, "sent_payload": sent, "sent_header": 10,
             "recv_payload": sent, "recv_header": 10} for t in times]


def test_iteration_times_leave_out_the_warm_up():
    assert dist_parts.iteration_times(_records([0.0, 5.0, 6.0, 8.0]), skip=1) == [1.0, 2.0]


def test_scaling_rows_take_the_median_per_round_and_pair_rounds_for_the_ratio():
    # round medians: no-overlap 2.0 then 4.0 (a loaded round), hybrid 0.5 then 2.0
    slow = [(_records([0, 9, 11, 13, 15]), None, 1.0, None),       # warm-up 9 s, then 2 s each
            (_records([0, 9, 13, 17, 21]), None, 1.0, None)]
    fast = [(_records([0, 9, 9.5, 10.0, 10.5], sent=10), None, 1.0, None),
            (_records([0, 9, 11, 13, 15], sent=10), None, 1.0, None)]
    rows = [dist_parts.scaling_row("fc_heavy", 4, "no-overlap ps", "1Gbit", slow, skip=1),
            dist_parts.scaling_row("fc_heavy", 4, "hybrid", "1Gbit", fast, skip=1)]
    assert rows[0]["iteration_s_by_round"] == [2.0, 4.0]
    assert rows[0]["iteration_s"]["median"] == 3.0
    assert rows[1]["bytes_sent_per_iter"] == 20
    ratios = dist_parts.per_round_ratios(rows)
    assert sorted(ratios["fc_heavy-4"]["runs"]) == [0.25, 0.5]    # 0.5/2 and 2/4, not 0.5/4


def test_a_failed_job_makes_a_failed_row_with_its_reason():
    row = dist_parts.scaling_row("fc_heavy", 2, "hybrid", "1Gbit",
                                 [([], None, 1.0, "exit status 1: boom")], skip=1)
    assert row["status"] == "failed" and "boom" in row["reason"]


def test_scaling_gives_its_rounds_to_the_target_row_only(tmp_path, monkeypatch):
    """fc_heavy at 4 workers (the target) gets up to 3 rounds of each mode, every other row one:
    the bench stays under 15 minutes on a slower machine."""
    jobs = []

    def job(solver_path, p1, p2, folder, extra, timeout, threads):
        jobs.append((Path(folder).parent.name, p1))
        return _records([0, 9, 11, 13, 15]), None, 1.0, None

    monkeypatch.setattr(dist_parts, "run_job", job)
    monkeypatch.setattr(dist_parts, "status", lambda: (True, ""))
    out = dist_parts.scaling(tmp_path, runs=5)
    assert out["rounds"] == {"fc_heavy-2": 1, "fc_heavy-4": 3, "cifar10_quick-2": 1,
                             "cifar10_quick-4": 1}
    modes = len(dist_parts.MODES)
    assert jobs.count(("fc_heavy-4", 4)) == 3 * modes and jobs.count(("fc_heavy-2", 2)) == modes
    assert len(out["hybrid_over_no_overlap"]["fc_heavy-4"]["runs"]) == 3


def test_scaling_refuses_an_unknown_net():
    out = dist_parts.scaling("/nonexistent", net_keys=["vgg99"])
    assert out["status"] == "not measured" and "vgg99" in out["reason"]


def test_single_node_overhead_alternates_plain_and_distributed(tmp_path):
    out = dist_parts.single_node_overhead(tmp_path, quick=True, threads=1)
    assert out["status"] == "measured", out.get("reason")
    assert out["rounds"] == 4 and len(out["overhead_rounds"]["runs"]) == 4
    assert out["plain_engine_s"]["median"] > 0 and out["distributed_s"]["median"] > 0
    assert out["overhead"] == pytest.approx(out["overhead_rounds"]["median"])
    parts = out["where_it_goes"]                     # the overhead split into its parts
    assert parts["worker_cpu_plain_ms"] > 0 and parts["worker_cpu_distributed_ms"] > 0
    assert parts["exposed_sync_ms"] > 0               # the one bucket syncs after backward
    # /proc counts CPU in 10 ms ticks: over a quick run's blocks of 2 iterations the server's
    # few ms per iteration may round to 0 in most blocks, so only the sign is certain
    assert parts["server_cpu_ms"] is None or parts["server_cpu_ms"] >= 0
    threads = parts["threads_cpu_ms"]                # per thread, from /proc (Linux)
    if threads:
        # one bucket for the whole net (the one-host default): its sync starts after the last
        # backward, so the training thread runs it and the pool has nothing to do
        assert "MainThread" in threads["distributed"]
        assert "sync" not in threads["distributed"]
        assert threads["plain"]["MainThread"] > 0 and threads["distributed"]["MainThread"] > 0
        assert all(v >= 0 for side in threads.values() for v in side.values())
        assert {"python", "ZMQbg/IO"} <= set(threads["server"])          # the server's threads
        line = report._overhead_parts(parts)
        assert "CPU per thread" in line and "MainThread" in line
    low, high = out["overhead_interval95"]           # the bootstrap interval holds the median
    assert out["overhead_rounds"]["min"] <= low <= out["overhead"] <= high \
        <= out["overhead_rounds"]["max"]


def test_single_node_overhead_passes_options_to_both_processes(tmp_path):
    """Part c's variants: the same A/B with options for both processes (a bad option would fail
    the child; the per-thread split shows the sync threads ran: each layer alone, so that all
    syncs but the last go to the pool)."""
    out = dist_parts.single_node_overhead(tmp_path, quick=True, threads=1,
                                          options={"ipc": "links", "bucket_bytes": 0})
    assert out["status"] == "measured", out.get("reason")
    assert "sync" in out["where_it_goes"]["threads_cpu_ms"]["distributed"]
    bad = dist_parts.single_node_overhead(tmp_path / "bad", quick=True, threads=1,
                                          options={"ipc": "carrier-pigeon"})
    assert bad["status"] == "failed" and "ipc='carrier-pigeon'" in bad["reason"]


def test_part_c_variants_name_their_flag_and_threads(monkeypatch):
    """Part c's figures beside the default: each names the flag users give, the options both
    processes get and its compute threads; on more than one core one of them trains on one
    thread, leaving a core to the sync path. The target row and the report show each measured
    variant by its flag; the default alone decides the target."""
    monkeypatch.setattr(dist_parts, "cpu_count", lambda: 2)
    variants = {v.key: v for v in dist_parts.overhead_variants()}
    one = variants["one_thread"]
    assert one.flag == "POSEIDON_THREADS=1" and one.options == {} and one.threads == 1
    assert variants["layers_alone"].options == {"bucket_bytes": 0}
    assert variants["ipc_links"].options == {"ipc": "links"}    # the shared memory's figure
    assert all(v.threads is None for key, v in variants.items() if key != "one_thread")
    assert dist_parts.overhead_variants(quick=True) == []
    monkeypatch.setattr(dist_parts, "cpu_count", lambda: 1)
    assert "one_thread" not in {v.key for v in dist_parts.overhead_variants()}
    monkeypatch.setattr(dist_parts, "cpu_count", lambda: 2)

    def part_c(overhead):
        s = {"median": 0.05, "min": 0.05, "max": 0.05, "runs": [0.05]}
        return {"status": "measured", "net": "cifar10_quick", "overhead": overhead,
                "overhead_rounds": dict(s, median=overhead), "overhead_interval95": None,
                "plain_engine_s": s, "distributed_s": s, "note": "n", "where_it_goes": None}

    d = {"single_node_overhead": part_c(0.02), "single_node_overhead_one_thread": part_c(0.004)}
    row = [r for r in report.targets({"distributed": d})
           if r[0] == report.TARGETS[3][0]][0]
    assert row[2] == "+2.0%; with `POSEIDON_THREADS=1` +0.4%" and row[3] is False
    (flag, note, shown), = report._overhead_variants(d)     # what the report's part c lists
    assert flag == "POSEIDON_THREADS=1" and note.startswith("both sides train on one thread")
    assert shown["overhead"] == 0.004


def test_transport_measures_tcp_and_unix_socket_sides(tmp_path):
    """Part d end to end (--quick: a 4 MiB parameter, one round): the KV jobs over TCP with CURVE,
    with --insecure, and over Unix sockets, each beside raw ZeroMQ of the same route, and the
    KV job in shared memory (the default on one host); the raw Unix-socket side cleans up its
    folder."""
    import glob
    import tempfile
    before = set(glob.glob(f"{tempfile.gettempdir()}/poseidon-raw-*"))
    out = dist_parts.transport(tmp_path, quick=True, runs=1)
    assert out["status"] == "measured", out.get("reason")
    for key in ("kv_push_pull_Bps", "raw_zmq_curve_frames_Bps", "kv_push_pull_insecure_Bps",
                "raw_zmq_frames_Bps", "kv_push_pull_ipc_Bps", "raw_zmq_ipc_frames_Bps",
                "kv_push_pull_shared_Bps"):
        assert out[key]["median"] > 0, key
    assert out["ratio_ipc"] == out["kv_push_pull_ipc_Bps"]["median"] / \
        out["raw_zmq_ipc_frames_Bps"]["median"]
    assert set(glob.glob(f"{tempfile.gettempdir()}/poseidon-raw-*")) == before
    for side in ("kv", "kv_insecure", "kv_ipc", "kv_shared"):   # each KV side took its route
        log = (tmp_path / "transport" / f"{side}-0" / "output.log").read_text()
        assert ("on this host: Unix sockets" in log) == (side in ("kv_ipc", "kv_shared")), \
            (side, log[-2000:])
        assert ("shared memory" in log) == (side == "kv_shared"), (side, log[-2000:])


def test_part_c_reads_a_threads_cpu_finer_than_the_clock_tick():
    """Part c's per-thread CPU (tools/bench/overhead_ab.py) comes from schedstat, in nanoseconds:
    a few milliseconds of a thread's work read as that, not as 0 or 10 ms (stat's ticks). Read
    while the thread sleeps, as part c reads them between blocks (a running thread's figure
    lags until the scheduler next looks)."""
    import os
    import threading
    import time
    from poseidon.tools.bench import overhead_ab
    go, done, end = threading.Event(), threading.Event(), threading.Event()
    spent = {}

    def work():
        go.wait(10)
        clock = time.thread_time()
        while time.thread_time() - clock < 0.003:          # 3 ms of this thread's CPU
            pass
        spent["thread_time"] = time.thread_time() - clock
        done.set()
        end.wait(10)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        task = f"/proc/self/task/{worker.native_id}"
        if not os.path.exists(f"{task}/schedstat"):
            pytest.skip("this kernel keeps no schedstat (part c then falls back to clock ticks)")
        time.sleep(0.05)
        before = overhead_ab._task_cpu(task)
        go.set()
        assert done.wait(10)
        time.sleep(0.05)
        measured = overhead_ab._task_cpu(task) - before
        assert abs(measured - spent["thread_time"]) < 0.0005
        assert overhead_ab._process_cpu(os.getpid()) >= overhead_ab._task_cpu(task)
    finally:
        end.set()
        worker.join(10)
