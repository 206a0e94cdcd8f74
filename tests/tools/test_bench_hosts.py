"""Part g of `poseidon bench` (tools/bench/hosts_part.py): part e's jobs across emulated hosts.

One tiny job end to end where namespaces can be made (root): its JSON fields, that the TCP payload
tc counted on every link is at least what the job itself counted, and that no namespace is left;
elsewhere that test is skipped with the reason, and part g reports "not measured" with it. Without
namespaces: the token bucket's side comes from part e of the same run where part e measured the
row, else from a twin run beside each netns job; and the report renders the part. No timing
assertions.
"""
import os
from pathlib import Path

import pytest

from poseidon.tools import netns
from poseidon.tools.netns import ranks
from poseidon.tools.bench import dist_parts, hosts_part, report_hosts

WHY_NOT = netns.why_unavailable()


def namespaces_of_this_process():
    return [n for n in netns.network.sh(["ip", "netns", "list"], check=False).split()
            if n.startswith(f"{netns.network.PREFIX}{os.getpid()}n")]


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_a_tiny_job_across_emulated_hosts_counts_at_least_its_payload_on_the_links(tmp_path):
    out = hosts_part.emulated_hosts(tmp_path, tiny=True)
    assert out["status"] == "measured", out.get("reason")
    assert out["tbf"]["rate"] == "1000000000bit"                  # --bandwidth 1Gbit, as part e
    row, = out["rows"]
    assert (row["net"], row["workers"], row["servers"], row["mode"]) == (
        "cifar10_quick", 2, 2, "wfbp ps")
    ns, tb = row["netns"], row["token_bucket"]
    assert ns["status"] == "measured" and tb["status"] == "measured", (ns, tb)
    assert row["token_bucket_from"] == "twins"                    # no part e in this run
    assert ns["iteration_s"]["median"] > 0 and tb["iteration_s"]["median"] > 0
    ratio = ns["iteration_s"]["median"] / tb["iteration_s"]["median"]
    assert row["netns_over_token_bucket"]["median"] == pytest.approx(ratio)
    assert out["netns_over_token_bucket"]["wfbp ps"]["median"] == pytest.approx(ratio)
    # every rank's link, each way, over the whole job: tc's TCP payload >= the job's own count
    # (payload + message headers of every sync)
    assert ns["tc_over_counted"]["min"] >= 1.0, ns["tc_over_counted"]
    assert ns["tc_payload_bytes"] >= ns["counted_bytes"] > 0
    assert ns["tbf_drops"] >= 0 and ns["tcp_retransmits"] >= 0
    per_iter = ns["worker0_bytes_per_iter"]                        # worker 0, polled window
    assert per_iter["stats_sent"] > 0 and per_iter["stats_received"] > 0
    assert per_iter["tc_sent"] > 0 and per_iter["tc_received"] > 0
    assert tb["bytes_sent_per_iter"] == ns["bytes_sent_per_iter"]  # the same job both ways
    assert namespaces_of_this_process() == []                     # every namespace removed
    assert "| cifar10_quick | 2 | wfbp ps |" in "\n".join(report_hosts.markdown_lines(out))


def test_part_g_says_why_it_was_not_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "why_unavailable", lambda: "emulated hosts need root")
    out = hosts_part.emulated_hosts(tmp_path)
    assert out == {"status": "not measured", "reason": "emulated hosts need root"}
    lines = report_hosts.markdown_lines(out)
    assert lines[0].endswith(": not measured: emulated hosts need root")
    monkeypatch.setattr(netns, "why_unavailable", lambda: None)
    out = hosts_part.emulated_hosts(tmp_path, net_keys=["vgg99"])
    assert out["status"] == "not measured" and "vgg99" in out["reason"]


def _records(times, sent=1000):
    return [{"time": t, "barrier_wait_s": 0.0, "sent_payload": sent, "sent_header": 10,
             "recv_payload": sent, "recv_header": 10} for t in times]


def test_the_token_bucket_side_comes_from_part_e_where_it_measured_the_row(tmp_path, monkeypatch):
    """fc_heavy at 4 workers measured by part e: those rows take part e's figure (the ratio of
    the medians) and run no twin; every other row runs its loopback twin right after its netns
    job (the ratio per round). The summary pairs hybrid with no-overlap PS on each side."""
    ran = []

    def netns_job(solver, p1, folder, flags, tbf, total, keys):
        ran.append(("netns", Path(folder).parent.parent.name, Path(folder).parent.name))
        step = 1.0 if "hybrid" in flags else 3.0                  # hybrid a third of PS
        times = [0, 9] + [9 + step * (i + 1) for i in range(total - 2)]
        return {"records": _records(times), "seconds": 1.0, "error": None,
                "window": {"records": [2, total], "sent": 1100 * (total - 2),
                           "received": 1100 * (total - 2)},
                "links": {0: {"sent": 5000, "received": 5000}},
                "counted": {0: {"sent": 4000, "received": 4000}}, "drops": 0, "resent": 0}

    def twin(solver, p1, p2, folder, extra, timeout, threads):
        ran.append(("twin", Path(folder).parent.parent.name, Path(folder).parent.name))
        assert extra[-2:] == ["--bandwidth", "1Gbit"] and "--ipc" in extra and threads == 1
        return _records([0, 9, 11, 13, 15, 17, 19, 21, 23]), None, 1.0, None

    monkeypatch.setattr(netns, "why_unavailable", lambda: None)
    monkeypatch.setattr(hosts_part, "_netns_job", netns_job)
    monkeypatch.setattr(dist_parts, "run_job", twin)
    monkeypatch.setattr(ranks, "make_key_file", lambda path, env=None: str(path))
    part_e_rows = [dict(dist_parts.scaling_row("fc_heavy", 4, mode, "1Gbit",
                                               [(_records([0, 9, 11, 13, 15]), None, 1.0, None)],
                                               skip=1)) for mode, _ in dist_parts.MODES]
    part_e = {"status": "measured", "rows": part_e_rows}
    out = hosts_part.emulated_hosts(tmp_path, part_e=part_e)
    assert out["status"] == "measured", out.get("reason")
    assert not [r for r in ran if r[0] == "twin" and r[1] == "fc_heavy-4"]
    assert len([r for r in ran if r[0] == "netns"]) == 12            # 2 nets x 2 counts x 3 modes
    assert len([r for r in ran if r[0] == "twin"]) == 9              # all but part e's three
    rows = {(r["net"], r["workers"], r["mode"]): r for r in out["rows"]}
    from_e = rows[("fc_heavy", 4, "hybrid")]
    assert from_e["token_bucket_from"] == "part e" and from_e["token_bucket"] is part_e_rows[2]
    assert from_e["netns_over_token_bucket"]["median"] == pytest.approx(1.0 / 2.0)
    paired = rows[("cifar10_quick", 2, "wfbp ps")]
    assert paired["token_bucket_from"] == "twins"
    assert paired["netns_over_token_bucket"]["median"] == pytest.approx(3.0 / 2.0)
    assert out["target_figure"]["netns"] == pytest.approx(1.0 / 3.0)
    assert out["target_figure"]["token_bucket"] == pytest.approx(1.0)
    ns = paired["netns"]
    assert ns["worker0_bytes_per_iter"]["tc_sent"] == 1100
    assert ns["worker0_bytes_per_iter"]["stats_sent"] == 1010
    assert ns["tc_over_counted"]["min"] == pytest.approx(1.25)
    text = "\n".join(report_hosts.markdown_lines(out))
    assert "| fc_heavy | 4 | hybrid |" in text and "(part e)" in text
    assert ("hybrid / no-overlap ps iteration time, fc_heavy at 4 workers: across emulated hosts "
            "0.33, with the token bucket 1.00") in text
