"""Part h of `poseidon bench` (tools/bench/schemes_part.py): the schemes across emulated hosts beside
PyTorch DDP. One tiny job end to end where namespaces can be made (root); elsewhere it is skipped
with the reason. The verdicts (hybrid against the best single scheme and DDP, measured against
static on a slow host) are checked on made-up jobs, with the report rendering them. No timing
assertions."""
import os

import pytest

from poseidon.tools import netns
from poseidon.tools.bench import report_schemes, schemes_part

WHY_NOT = netns.why_unavailable()


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_a_tiny_hybrid_job_across_two_colocated_hosts(tmp_path):
    out = schemes_part.schemes_across_hosts(tmp_path, tiny=True)
    assert out["status"] == "measured", out.get("reason")
    row, = out["rows"]
    assert (row["net"], row["mode"], row["status"]) == ("fc_heavy", "hybrid", "measured")
    assert row["iteration_s"]["median"] > 0 and row["bytes_sent_per_iter"] > 0
    assert set(row["schemes"]) == {"fc6", "fc7", "fc8"}           # every synced layer named
    assert [n for n in netns.network.sh(["ip", "netns", "list"], check=False).split()
            if n.startswith(f"{netns.network.PREFIX}{os.getpid()}n")] == []


def _job(seconds, schemes=None):
    return {"iteration_s": [seconds] * 3, "seconds": 10.0, "bytes_sent": [1e6],
            "schemes": schemes}


def test_verdicts_compare_the_hybrid_with_the_best_single_scheme_and_ddp(tmp_path, monkeypatch):
    per_mode = {"ps": 3.0, "sfb": 1.2, "allreduce": 2.0, "paper hybrid": 1.1, "hybrid": 1.0,
                "hybrid static": 4.0, "hybrid measured": 2.5}
    monkeypatch.setattr(netns, "why_unavailable", lambda: None)
    monkeypatch.setattr(schemes_part, "_ddp_unavailable", lambda: None)
    layouts = {}

    def poseidon_job(folder, solver, hosts, caps, flags, colocate):
        mode = folder.name.rsplit("-", 1)[0].replace("_", " ")
        layouts[mode] = (colocate, len(caps), caps[-1] < caps[0])
        return _job(per_mode[mode], {"fc6": "sfb" if "static" in flags else "ps"})
    monkeypatch.setattr(schemes_part, "_poseidon_job", poseidon_job)
    monkeypatch.setattr(schemes_part, "_ddp_job", lambda *a: _job(2.4))
    out = schemes_part.schemes_across_hosts(tmp_path, net_keys=["fc_heavy"],
                                            slow_nets=["fc_heavy"])
    assert out["status"] == "measured" and out["ddp"] == "measured"
    # worker i and server i share host i; the slow case gives every rank a host, the last slow
    assert layouts["hybrid"] == layouts["ps"] == (True, 4, False)
    assert layouts["hybrid static"] == layouts["hybrid measured"] == (False, 8, True)
    v = out["verdicts"]["fc_heavy"]
    assert v["best_single"] == "paper hybrid"
    assert v["hybrid_over_best_single"] == pytest.approx(1.0 / 1.1)
    assert v["hybrid_within_spread_or_faster"] is True
    assert v["throughput_over_ddp"] == pytest.approx(2.4)
    assert v["slow_host_measured_over_static"] == pytest.approx(2.5 / 4.0)
    assert v["slow_host_choices"] == {"hybrid static": {"fc6": "sfb"},
                                      "hybrid measured": {"fc6": "ps"}}
    text = "\n".join(report_schemes.markdown_lines(out))
    assert "| fc_heavy | ddp | - | 2.400 |" in text
    assert "| fc_heavy | hybrid static | 100Mbit | 4.000 |" in text
    assert "hybrid's throughput / DDP's 2.40" in text


def test_part_h_says_why_it_was_not_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "why_unavailable", lambda: "emulated hosts need root")
    out = schemes_part.schemes_across_hosts(tmp_path)
    assert out == {"status": "not measured", "reason": "emulated hosts need root"}
    assert report_schemes.markdown_lines(out)[0].endswith(": not measured: emulated hosts need root")
    monkeypatch.setattr(netns, "why_unavailable", lambda: None)
    out = schemes_part.schemes_across_hosts(tmp_path, net_keys=["vgg99"])
    assert out["status"] == "not measured" and "vgg99" in out["reason"]
