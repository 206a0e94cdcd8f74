"""b. Per-layer forward/backward times of the training nets and, for Convolution and InnerProduct,
the GEMM FLOPs they do and the share of the machine's GEMM peak (measured in the same run) that
their time represents: share = FLOPs / layer time / peak, so everything the layer does besides the
GEMM (im2col, transposes, bias) counts against it. A convolution's FLOPs are always those of a
direct convolution, the usual way to count them; for a layer on the frequency route
(engine/layers/conv/fourier.py), which does fewer, that share is an effective figure and may pass
100%, while the metered GEMM calls count the FLOPs actually done. Beside each layer, when torch is
installed, the same layer in PyTorch on the same input and thread count
(tools/bench/torch_ref.TorchNet.layer_times), so a gap in part a's throughput can be traced to
the layers where it arises.
"""
import time
from typing import NamedTuple

import numpy

from . import nets
from .env import stats
from poseidon.engine.gemm import METER


def _sync(xp):
    if xp is not numpy:
        xp.cuda.Stream.null.synchronize()


def gemm_flops(net, li):
    """(forward FLOPs, backward FLOPs) of the GEMMs of layer li (0, 0 for other types)."""
    layer = net.layers[li]
    bottom, top = net.bottom_vecs[li], net.top_vecs[li]
    t = layer.type
    if t in ("Convolution", "Deconvolution"):
        g = layer.geom
        n = bottom[0].shape[0]
        conv_in = layer.channels if t == "Convolution" else layer.num_output
        conv_out = layer.num_output if t == "Convolution" else layer.channels
        plane = top[0].shape[2] * top[0].shape[3] if t == "Convolution" else \
            bottom[0].shape[2] * bottom[0].shape[3]
        one = 2.0 * n * conv_out * (conv_in // layer.group) * g.kh * g.kw * plane * len(bottom)
        bwd = one * (1 if layer.param_propagate_down[0] else 0)
        bwd += one * (1 if net.bottom_need_backward[li][0] else 0)
        return one, bwd
    if t == "InnerProduct":
        one = 2.0 * layer.k * layer.n_in * layer.num_output
        bwd = one * (1 if layer.param_propagate_down[0] else 0)
        bwd += one * (1 if net.bottom_need_backward[li][0] else 0)
        return one, bwd
    return 0.0, 0.0


def _metered(fn, totals):
    """Run fn() and add the GEMM FLOPs and in-call seconds it spent (engine.gemm.METER)."""
    before = METER.snapshot()
    fn()
    after = METER.snapshot()
    totals[0] += after["flops"] - before["flops"]
    totals[1] += after["seconds"] - before["seconds"]


def measure(bench_nets, threads, peaks, runs=5, iterations=5, xp=None, log=print,
            with_torch=False):
    """Per-layer times of each net and the shares of the GEMM peaks they represent: of the
    machine peak for whole layers, and of the per-call peak (the threads one GEMM call gets: one
    core while the engine splits the batch over cores) for the GEMM calls themselves, metered
    inside the layers (engine.gemm). `peaks` (env.GemmPeaks) is sampled again after each net,
    and every share is taken against the best of all its samples, once every net has run."""
    timed = []
    for bn in bench_nets:
        timed.append((bn, _time_layers(bn, runs, iterations, xp)))
        peaks.sample()
    out = {}
    for bn, times in timed:
        out[bn.key] = _shares(bn, times, peaks.machine_peak, peaks.call_peak)
        net = out[bn.key]
        log(f"  {bn.key}: forward {net['forward_ms']:.1f} ms, backward {net['backward_ms']:.1f} "
            f"ms, update {net['update_ms']['median']:.1f} ms; conv/IP layers at "
            f"{100 * (net['gemm_layers_peak_share'] or 0):.0f}% of the GEMM peak"
            + (f", their GEMM calls at {100 * net['gemm_calls_share']:.0f}% of the per-call "
               f"peak" if net["gemm_calls_share"] else ""))
        if with_torch:
            net["torch_layers_ms"] = _torch_columns(bn, net["layers"], threads, runs, iterations)
        if net["torch_layers_ms"]:
            log(f"  {bn.key} in PyTorch, layer by layer: forward "
                f"{net['torch_layers_ms']['forward']:.1f} ms, backward "
                f"{net['torch_layers_ms']['backward']:.1f} ms")
    return out


class LayerTimes(NamedTuple):
    """What _time_layers measured of one net, per layer unless said: name, type, convolution
    algorithm (or None), GEMM FLOPs (forward, backward), forward and backward ms of each run,
    the update's ms of each run (one list), [metered GEMM FLOPs, seconds inside the calls]."""
    names: list
    types: list
    algorithms: list
    flops: list
    fwd: list
    bwd: list
    upd: list
    gemm: list


def _time_layers(bn, runs, iterations, xp=None):
    """LayerTimes of `runs` runs of `iterations` training steps of bench net `bn`, timed layer
    by layer."""
    # the engine runs its own threads (POSEIDON_THREADS, set by the command)
    solver = nets.make_solver(bn, xp=xp)
    net = solver.net
    n_layers = len(net.layers)
    solver.step(2)                                        # warm-up
    fwd = [[] for _ in range(n_layers)]
    bwd = [[] for _ in range(n_layers)]
    upd = []
    gemm = [[0.0, 0.0] for _ in range(n_layers)]   # FLOPs, seconds inside GEMM calls
    METER.enabled = True
    try:
        for _ in range(runs):
            f = numpy.zeros(n_layers)
            b = numpy.zeros(n_layers)
            u = 0.0
            for _ in range(iterations):
                net.ClearParamDiffs()
                for li in range(n_layers):
                    _sync(net.xp)
                    t = time.perf_counter()
                    _metered(lambda: net.ForwardLayer(li, alone=False), gemm[li])
                    _sync(net.xp)
                    f[li] += time.perf_counter() - t
                for li in range(n_layers - 1, -1, -1):
                    t = time.perf_counter()
                    _metered(lambda: net.BackwardThrough(li), gemm[li])
                    _sync(net.xp)
                    b[li] += time.perf_counter() - t
                t = time.perf_counter()
                solver.apply_update()
                solver.iter += 1
                _sync(net.xp)
                u += time.perf_counter() - t
            for li in range(n_layers):
                fwd[li].append(f[li] / iterations * 1e3)
                bwd[li].append(b[li] / iterations * 1e3)
            upd.append(u / iterations * 1e3)
    finally:
        METER.enabled = False
    flops = [gemm_flops(net, li) for li in range(n_layers)]
    algorithms = [getattr(layer, "algorithm", None) for layer in net.layers]
    return LayerTimes(list(net.layer_names), [layer.type for layer in net.layers], algorithms,
                      flops, fwd, bwd, upd, gemm)


def _shares(bn, t, peak_gflops, call_peak_gflops):
    """The rows of one net (LayerTimes t) and its totals, with the shares of the two peaks."""
    rows = []
    gemm_time = gemm_fl = 0.0
    call_fl = call_s = 0.0
    gemm = t.gemm
    for li, name in enumerate(t.names):
        ff, bf = t.flops[li]
        row = {"name": name, "type": t.types[li], "forward_ms": stats(t.fwd[li]),
               "backward_ms": stats(t.bwd[li])}
        if t.algorithms[li]:      # im2col, fourier or winograd (engine/layers/conv/routes.py)
            row["algorithm"] = t.algorithms[li]
        if ff:
            tf = row["forward_ms"]["median"] / 1e3
            tb = row["backward_ms"]["median"] / 1e3
            row["gflop_forward"] = ff / 1e9
            row["gflop_backward"] = bf / 1e9
            row["gflops_forward"] = ff / tf / 1e9 if tf else None
            row["gflops_backward"] = bf / tb / 1e9 if tb and bf else None
            row["peak_share_forward"] = row["gflops_forward"] / peak_gflops \
                if row["gflops_forward"] else None
            row["peak_share_backward"] = row["gflops_backward"] / peak_gflops \
                if row["gflops_backward"] else None
            row["peak_share"] = (ff + bf) / (tf + tb) / 1e9 / peak_gflops
            gemm_time += tf + tb
            gemm_fl += ff + bf
            if gemm[li][1] > 0:
                row["gemm_call_gflops"] = gemm[li][0] / gemm[li][1] / 1e9
                row["gemm_call_share"] = row["gemm_call_gflops"] / call_peak_gflops
                call_fl += gemm[li][0]
                call_s += gemm[li][1]
        rows.append(row)
    update = stats(t.upd)
    total_f = sum(r["forward_ms"]["median"] for r in rows)
    total_b = sum(r["backward_ms"]["median"] for r in rows)
    return {"net": bn.title, "layers": rows, "update_ms": update,
            "forward_ms": total_f, "backward_ms": total_b,
            "step_ms": total_f + total_b + update["median"],
            "gemm_layers_ms": gemm_time * 1e3,
            "gemm_layers_gflop": gemm_fl / 1e9,
            "gemm_layers_peak_share": gemm_fl / gemm_time / 1e9 / peak_gflops
            if gemm_time else None,
            "gemm_calls_gflops": call_fl / call_s / 1e9 if call_s else None,
            "gemm_calls_share": call_fl / call_s / 1e9 / call_peak_gflops if call_s else None,
            "gemm_call_peak_gflops": call_peak_gflops,
            "gemm_peak_gflops": peak_gflops,
            "torch_layers_ms": None}


def _torch_columns(bench_net, rows, threads, runs, iterations):
    """Add PyTorch's time for each layer to its row (torch_forward_ms / torch_backward_ms);
    returns the sums, or None without torch (the rows keep no PyTorch columns then)."""
    from . import torch_ref
    ok, _ = torch_ref.available()
    if not ok:
        return None
    tnet = torch_ref.TorchNet(bench_net, threads)
    tnet.set_batch(*nets.synthetic_batch(bench_net))
    times = tnet.layer_times(runs, iterations)
    total = {"forward": 0.0, "backward": 0.0}
    for row in rows:
        if row["name"] in times:
            fw, bw = times[row["name"]]
            row["torch_forward_ms"], row["torch_backward_ms"] = stats(fw), stats(bw)
            total["forward"] += row["torch_forward_ms"]["median"]
            total["backward"] += row["torch_backward_ms"]["median"]
    return total
