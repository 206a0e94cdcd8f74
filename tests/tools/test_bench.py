"""`poseidon bench --quick`: the one-minute smoke run writes the JSON, the markdown table and (with
matplotlib) the plots, with the keys the docs rely on and positive figures. No timing assertions."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_writes_results(tmp_path):
    out = tmp_path / "bench"
    plots = importlib.util.find_spec("matplotlib") is not None
    cmd = [sys.executable, "-m", "poseidon.tools.cli", "bench", "--quick", "--out", str(out)]
    if not plots:
        cmd.append("--no-plots")
    proc = subprocess.run(cmd, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    results = json.loads((out / "results.json").read_text())
    for key in ("meta", "gemm_peak", "throughput", "layers", "distributed", "targets",
                "runtime_s"):
        assert key in results, key
    meta = results["meta"]
    for key in ("command", "cpu", "cores", "numpy", "blas", "env", "threads", "runs"):
        assert key in meta, key
    assert set(meta["env"]) >= {"OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"}
    assert results["gemm_peak"]["peak"] > 0
    # sampled before part b and after each of its three nets (tools/bench/env.GemmPeaks)
    assert results["gemm_peak"]["samples"] == 4
    assert results["gemm_peak"]["peak"] == max(results["gemm_peak"]["runs"])
    call = results["gemm_peak_call"]
    if meta["threads"] > 1:   # one single-thread call per core, all at once, as the engine runs
        assert call["threads"] == 1 and call["calls"] == meta["threads"] and call["peak"] > 0
        assert results["gemm_peak_call_alone"]["peak"] > 0
    assert set(results["throughput"]) == {"cifar10_quick", "fc_heavy", "vgg_block"}
    for row in results["throughput"].values():
        assert row["engine"]["median"] > 0 and row["engine"]["min"] <= row["engine"]["max"]
        assert len(row["engine"]["runs"]) == meta["runs"]
        if row["torch"] is not None:
            assert row["torch"]["median"] > 0 and row["ratio"] > 0
        else:
            assert row["torch_note"]
    for net in results["layers"].values():
        assert net["step_ms"] > 0 and net["gemm_layers_gflop"] > 0
        convs = [r for r in net["layers"] if r["type"] in ("Convolution", "InnerProduct")]
        assert convs and all(r["gflop_forward"] > 0 and r["peak_share"] > 0 for r in convs)
        assert all(r["forward_ms"]["median"] >= 0 for r in net["layers"])
        torch_rows = [r for r in net["layers"] if "torch_forward_ms" in r]
        if net["torch_layers_ms"] is not None:      # PyTorch's same layers, beside the engine's
            # every layer with weights or windows has its PyTorch twin; the loss has none
            assert {r["name"] for r in convs} <= {r["name"] for r in torch_rows}
            assert all(r["torch_forward_ms"]["median"] > 0 for r in torch_rows)
            assert not any(r["type"] == "SoftmaxWithLoss" for r in torch_rows)
        else:
            assert not torch_rows
    for part in ("single_node_overhead", "transport", "scaling", "emulated_hosts",
                 "schemes_across_hosts"):
        assert results["distributed"][part]["status"] in ("measured", "not measured", "failed")
        if results["distributed"][part]["status"] != "measured":
            assert results["distributed"][part]["reason"]
    assert len(results["targets"]) == 6
    spent = results["part_seconds"]                 # where the run's time went, part by part
    assert set(spent) == set("abcdefgh") and all(v >= 0 for v in spent.values())
    assert results["distributed"]["emulated_hosts"] == {       # part g: no jobs in --quick
        "status": "not measured", "reason": "skipped in --quick (it starts jobs of up to 8 "
                                            "processes across network namespaces)"}
    assert results["distributed"]["schemes_across_hosts"] == {   # part h: none either
        "status": "not measured", "reason": "skipped in --quick (it starts jobs of 8 processes "
                                            "across network namespaces)"}
    assert sum(spent.values()) <= results["runtime_s"]
    real, = results["real_nets"]                       # part f, --quick: alexnet at batch 2
    assert (real["model"], real["batch"]) == ("alexnet", 2)
    assert real["engine_ms"]["median"] > 0 and len(real["engine_ms"]["runs"]) == meta["runs"]
    assert {"Convolution 11x11/4", "InnerProduct", "LRN", "Pooling"} <= set(real["by_type_ms"])
    if real["torch_ms"] is not None:
        assert real["ratio"] > 0 and len(real["ratio_rounds"]) == meta["runs"]
    else:
        assert real["torch_note"] and real["ratio"] is None
    md = (out / "results.md").read_text()
    assert "## Targets" in md and "cifar10_quick" in md and "; part by part: a " in md
    assert "## f. Real networks" in md and "| alexnet | 2 |" in md
    if plots:
        for name in results["plots"]:
            assert (out / name).stat().st_size > 0
        assert "throughput.png" in results["plots"]
        assert ("real_nets.png" in results["plots"]) == (real["ratio"] is not None)


def test_transport_target_compares_like_for_like():
    """Part d's target row: KV with CURVE against raw ZeroMQ with CURVE, --insecure KV against
    plain raw beside it; results written before both were measured still render."""
    from poseidon.tools.bench import report

    def s(v):
        return {"median": v, "min": v, "max": v, "runs": [v]}

    t = {"status": "measured", "parameter_bytes": 64 << 20, "kv_pair_bytes": 2 << 20, "rounds": 1,
         "kv_push_pull_Bps": s(0.6e9), "raw_zmq_curve_frames_Bps": s(0.8e9),
         "kv_push_pull_insecure_Bps": s(1.5e9), "raw_zmq_frames_Bps": s(2.0e9),
         "raw_zmq_one_frame_Bps": s(1.0e9), "ratio": 0.75, "ratio_rounds": s(0.75),
         "ratio_insecure": 0.75, "ratio_insecure_rounds": s(0.75), "note": "n"}
    row = [r for r in report.targets({"distributed": {"transport": t}})
           if r[0] == report.TARGETS[4][0]][0]
    assert "75% with CURVE on both (0.60 vs 0.80 GB/s)" in row[2]
    assert "--insecure vs plain 75% (1.50 vs 2.00 GB/s)" in row[2] and row[3] is True
    assert "Unix sockets" not in row[2]             # written before the Unix-socket sides
    t.update(kv_push_pull_ipc_Bps=s(2.4e9), raw_zmq_ipc_frames_Bps=s(3.0e9), ratio_ipc=0.8,
             ratio_ipc_rounds=s(0.8))
    row = [r for r in report.targets({"distributed": {"transport": t}})
           if r[0] == report.TARGETS[4][0]][0]
    assert row[2].endswith("; Unix sockets 80% (2.40 vs 3.00 GB/s)")
    assert row[3] is True                           # the target stays the TCP CURVE ratio
    t.update(kv_push_pull_shared_Bps=s(6.0e9), ratio_shared=2.0, ratio_shared_rounds=s(2.0))
    row = [r for r in report.targets({"distributed": {"transport": t}})
           if r[0] == report.TARGETS[4][0]][0]
    assert row[2].endswith("; Unix sockets 80% (2.40 vs 3.00 GB/s); shared memory (the default "
                           "on one host) 6.00 GB/s, 200% of raw on a Unix socket")
    assert row[3] is True                           # shared memory is shown, not judged
    old = {k: t[k] for k in ("status", "kv_push_pull_Bps", "raw_zmq_frames_Bps")}
    old["ratio"] = 0.3
    row = [r for r in report.targets({"distributed": {"transport": old}})
           if r[0] == report.TARGETS[4][0]][0]
    assert row[2] == "30% (0.60 vs 2.00 GB/s)" and row[3] is False


def test_gemm_peaks_take_the_best_run_of_every_sample(monkeypatch):
    """A peak is the fastest the machine was seen to go: a slow sample after a fast one (or the
    other way round) leaves the peak at the fast one, and every share of part b is taken against
    it, whatever the order."""
    from poseidon.tools.bench import env
    machine = iter([[100.0, 120.0], [150.0, 140.0], [90.0, 95.0]])
    alone = iter([[50.0], [85.0], [70.0]])
    call = iter([[40.0, 45.0], [70.0, 80.0], [60.0, 61.0]])
    peaks = env.GemmPeaks(threads=2)
    # gemm_peak serves the machine peak (peaks.runs runs) and the lone call in turn
    monkeypatch.setattr(env, "gemm_peak", lambda size, runs: (
        {"runs": next(machine)} if runs == peaks.runs else {"runs": next(alone)}))
    monkeypatch.setattr(env, "gemm_peak_concurrent",
                        lambda calls, size, runs: {"runs": next(call)})
    peaks.sample()
    assert (peaks.machine_peak, peaks.call_peak) == (120.0, 45.0)
    peaks.sample()
    peaks.sample()
    assert (peaks.machine_peak, peaks.call_peak) == (150.0, 80.0)
    got = peaks.results()
    assert got["gemm_peak"]["peak"] == 150.0 and got["gemm_peak"]["samples"] == 3
    assert len(got["gemm_peak"]["runs"]) == 6 and got["gemm_peak"]["min"] == 90.0
    assert got["gemm_peak_call"]["peak"] == 80.0 and got["gemm_peak_call"]["calls"] == 2
    assert got["gemm_peak_call_alone"]["peak"] == 85.0
    one = env.GemmPeaks(threads=1)                   # one thread: a call is the machine
    machine = iter([[30.0, 33.0]])
    monkeypatch.setattr(env, "gemm_peak", lambda size, runs: {"runs": next(machine)})
    one.sample()
    assert one.call_peak == one.machine_peak == 33.0
    assert one.results()["gemm_peak_call"]["threads"] == 1


def test_median_interval_brackets_the_median_and_narrows_with_more_rounds():
    from poseidon.tools.bench.env import median_interval
    assert median_interval([0.1, 0.2, 0.3]) is None              # too few rounds to say
    assert median_interval([0.05] * 8) == [0.05, 0.05]
    rs = __import__("numpy").random.default_rng(1)
    few = list(0.08 + 0.12 * rs.standard_normal(12))
    many = list(0.08 + 0.12 * rs.standard_normal(400))
    lo, hi = median_interval(few)
    assert min(few) <= lo <= sorted(few)[6] <= hi <= max(few)
    assert median_interval(few) == [lo, hi]                      # fixed seed: reproducible
    lo2, hi2 = median_interval(many)
    assert lo2 < 0.08 < hi2 and hi2 - lo2 < (hi - lo) / 2


def test_factored_ab_names_the_weights_and_times_both_paths(capsys):
    """tools/bench/factored_ab.py (the A/B behind the factored update's figures) runs end to end."""
    from poseidon.tools.bench import factored_ab
    factored_ab.main(["cifar10_quick", "1", "1"])
    out = capsys.readouterr().out
    assert "weights from factors: ip1, ip2; 1 rounds of 1 steps" in out
    for side in ("from factors", "diff path"):
        assert f"  {side}" in out and "median" in out
    assert "parameters after the run:" in out


def test_stride_ab_times_the_three_ways_of_writing_a_weight_gradient(capsys):
    """tools/bench/stride_ab.py (behind the padded-rows figures) runs end to end; with rows of
    1,024 floats (4 KiB) the padded stride it reports is one cache line more."""
    from poseidon.tools.bench import stride_ab
    stride_ab.main(["64", "1024", "8"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "GFLOP/s" in line]
    assert len(lines) == 4
    assert "rows 4096 bytes apart" in out and "rows 4160 bytes apart" in out
    assert all(float(line.split()[-2]) > 0 for line in lines)


def test_model_ref_times_a_training_resnet50():
    """tools/bench/model_ref.py (behind the ResNet-50 and other real-net figures): the net it
    times trains as ResNet-50 does (batch statistics, a backward through every layer but no
    image gradient), and its per-type times add up to the totals it reports."""
    from poseidon.tools.bench import model_ref
    param = model_ref.training_param("resnet50", 1)
    from poseidon.engine.net import Net
    from poseidon.engine.proto import caffe_pb2
    net = Net(param, phase=caffe_pb2.TRAIN)
    assert net.blobs["data"].shape == (1, 3, 224, 224)
    norms = [layer for layer in net.layers if layer.type == "BatchNorm"]
    assert len(norms) == 53 and not any(layer.use_global_stats for layer in norms)
    first = net.layer_names.index("conv1")
    assert net.layer_need_backward[first] and not net.bottom_need_backward[first][0]
    forward, backward, by_type = model_ref.engine_times("resnet50", 1, 1)
    assert {"BatchNorm", "Scale", "Eltwise", "Convolution 1x1/1", "Convolution 3x3/1",
            "Convolution 1x1/2", "Convolution 7x7/2"} <= set(by_type)
    assert forward > 0 and backward > 0
    assert abs(sum(f for f, _ in by_type.values()) - forward) < 1e-9
    assert abs(sum(b for _, b in by_type.values()) - backward) < 1e-9


def test_model_ref_refuses_a_net_without_one_input(tmp_path):
    """A training file (Data layers) is not what model_ref times: a clear error, not a crash."""
    import pytest
    from poseidon.tools.bench import model_ref
    path = tmp_path / "train.prototxt"
    path.write_text('layer { name: "d" type: "DummyData" top: "data" '
                    'dummy_data_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }')
    with pytest.raises(SystemExit, match="one Input layer"):
        model_ref.training_param(str(path), 2)
    with pytest.raises(SystemExit, match="no deploy file for 'nonesuch'"):
        model_ref.model_path("nonesuch")
    assert model_ref.parse_models("resnet50:4, googlenet") == [("resnet50", 4), ("googlenet", 8)]
    assert model_ref.parse_models(f"{path}:2") == [(str(path), 2)]
    with pytest.raises(SystemExit, match="'resnet50:x': give MODEL:BATCH"):
        model_ref.parse_models("resnet50:x")
    with pytest.raises(SystemExit, match="no deploy file for 'nonesuch'"):
        model_ref.parse_models("alexnet:2,nonesuch:4")


def test_bench_refuses_a_bad_real_net_before_measuring(tmp_path):
    """A --real-nets item that names no deploy file stops the bench at once, with the item."""
    proc = subprocess.run([sys.executable, "-m", "poseidon.tools.cli", "bench", "--parts", "a,f",
                           "--real-nets", "alexnet:2,nonesuch:4", "--no-plots",
                           "--out", str(tmp_path / "b")], cwd=str(ROOT), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode != 0
    assert "--real-nets" in proc.stdout and "nonesuch" in proc.stdout
    assert "a. training throughput" not in proc.stdout
    assert not (tmp_path / "b" / "results.json").exists()


def test_bench_gpu_run_alone_reports_a_missing_device(tmp_path):
    """`--parts '' --gpu 0` runs no CPU part; on a machine without CuPy or a device the report
    says why the GPU part was not measured instead of failing."""
    from poseidon.engine import backend
    proc = subprocess.run([sys.executable, "-m", "poseidon.tools.cli", "bench", "--parts", "", "--gpu", "0",
                           "--quick", "--no-plots", "--no-torch", "--out", str(tmp_path / "b")],
                          cwd=str(ROOT), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert "a. training throughput" not in proc.stdout
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["meta"]["parts"] == []
    assert "throughput" not in results
    if not backend.gpu_available():
        assert results["gpu"]["status"] == "not measured"
        assert "no GPU" in results["gpu"]["reason"]
    else:
        assert results["gpu"]["status"] == "measured"


SMALL_NET = """
name: "mixed"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 3 dim: 3 dim: 12 dim: 12 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 stride: 1 } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "split" type: "Split" bottom: "conv1" top: "a" top: "b" }
layer { name: "conv_a" type: "Convolution" bottom: "a" top: "ca"
        convolution_param { num_output: 8 kernel_h: 1 kernel_w: 3 pad_h: 0 pad_w: 1 bias_term: false } }
layer { name: "sum" type: "Eltwise" bottom: "ca" bottom: "b" top: "sum" eltwise_param { coeff: 1 coeff: 0.5 } }
layer { name: "conv_b" type: "Convolution" bottom: "b" top: "cb"
        convolution_param { num_output: 4 kernel_size: 1 group: 2 } }
layer { name: "cat" type: "Concat" bottom: "sum" bottom: "cb" top: "cat" }
layer { name: "lrn" type: "LRN" bottom: "cat" top: "lrn" lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 } }
layer { name: "pool" type: "Pooling" bottom: "lrn" top: "pool"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "avg" type: "Pooling" bottom: "pool" top: "avg" pooling_param { pool: AVE global_pooling: true } }
layer { name: "fc" type: "InnerProduct" bottom: "avg" top: "fc" inner_product_param { num_output: 5 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


def test_model_ref_torch_graph_computes_the_engine_nets_function(tmp_path):
    """The PyTorch side is built from the same NetParameter: with the engine's weights it gives
    the engine's output (BatchNorm + Scale as one affine BatchNorm2d, Split, Eltwise with
    coefficients, Concat, LRN, CEIL pooling, global pooling, rectangular kernels, groups)."""
    import numpy
    import pytest
    torch = pytest.importorskip("torch", reason="PyTorch is the benchmark's reference; the "
                                                "engine side is tested without it above")
    from poseidon.tools.bench import model_ref
    path = tmp_path / "deploy.prototxt"
    path.write_text(SMALL_NET)
    side = model_ref.EngineSide(str(path), 3)
    net = side.net
    rs = numpy.random.RandomState(1)
    for layer in net.layers:
        for blob in layer.blobs:
            blob.data[...] = rs.standard_normal(blob.shape) * 0.5
    net.Forward()
    shapes = {name: blob.shape for name, blob in net.blobs.items()}
    graph = model_ref.torch_graph(side.param, shapes, 1)
    model_ref.copy_weights(graph, net)
    with torch.no_grad():
        out = graph({"data": torch.from_numpy(net.blobs["data"].data.copy())})
    numpy.testing.assert_allclose(out.numpy(), net.blobs["prob"].data, rtol=1e-4, atol=1e-6)


def test_install_ab_alternates_two_installs(tmp_path):
    """tools/bench/install_ab: two interpreters (here the same install twice) take turns on part a's
    nets; one JSON line per net with both sides' img/s and the per-round ratios."""
    import json
    proc = subprocess.run([sys.executable, "-m", "poseidon.tools.bench.install_ab", sys.executable,
                           sys.executable, "2", "0.05", "cifar10_quick,vgg_block"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, POSEIDON_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert set(rows) == {"cifar10_quick", "vgg_block"}
    for row in map(json.loads, rows.values()):
        assert row["old_img_s"] > 0 and row["new_img_s"] > 0 and row["rounds"] == 2
        low, high = row["new_over_old_range"]
        assert low <= row["new_over_old_median"] <= high
