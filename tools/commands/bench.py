"""`poseidon bench`: the engine's speed beside PyTorch CPU and the distributed path's costs, in one
command that writes results.json, results.md and PNG plots into --out (default bench-results/).

    poseidon bench                      # everything (about 13-19 minutes on a 2-core machine)
    poseidon bench --parts g            # part g alone (root): each job beside a loopback twin
    poseidon bench --quick              # a one-minute smoke run (small batches, 2 runs, no jobs)
    poseidon bench --parts a,b          # only throughput and per-layer times
    poseidon bench --gpu 0              # adds CuPy beside PyTorch CUDA on that device
    poseidon bench --parts "" --gpu 0   # the GPU run alone (about a minute); --tf32: TF32 GEMMs
    poseidon bench --gpu 0 --probe      # the device probe (tools/bench/gpu_probe.py, <= 7 min)

Parts: a throughput, b per-layer times + GEMM peak share, c single-node overhead of the distributed
path, d KV-store vs raw ZeroMQ, e scaling under --bandwidth, f the real networks of prototxt/
(--real-nets) forward and backward beside PyTorch, g part e's jobs across hosts emulated in
network namespaces (root only) beside the token bucket, h the synchronisation schemes across 4
emulated hosts beside PyTorch DDP over gloo (root only; see tools/bench/). PyTorch is a
benchmark-only reference: without it the PyTorch columns say so; matplotlib comes with the bench
extra (pip install -e '.[bench]'), or pass --no-plots.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

from poseidon.engine.errors import PoseidonError

from .common import out, positive_int

PARTS = ("a", "b", "c", "d", "e", "f", "g", "h")
REAL_NETS = "alexnet:32,googlenet:16,vgg19:4,resnet50:8,inception_v3:8"


def add(sub):
    p = sub.add_parser("bench", help="benchmark training speed (vs PyTorch CPU) and the "
                                     "distributed path; writes JSON, markdown and plots")
    p.add_argument("--out", default="bench-results", help="output folder (default bench-results/)")
    p.add_argument("--quick", action="store_true",
                   help="a one-minute smoke run: small batches, 2 runs, no distributed jobs")
    p.add_argument("--runs", type=positive_int, help="runs per figure (default 5; --quick 2); "
                   "part c takes 96 rounds of its A/B whatever this says (32 for the "
                   "variants beside it), part f 2")
    p.add_argument("--threads", type=positive_int,
                   help="BLAS / PyTorch threads (default: the cores this process may use)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="comma-separated parts to run: a throughput, b per-layer, c single-node "
                        "overhead, d transport, e scaling, f real networks, g scaling across "
                        "emulated hosts, h schemes across emulated hosts beside DDP (default all)")
    p.add_argument("--bandwidth", default="1Gbit",
                   help="send cap per process for part e; part g's link rate")
    p.add_argument("--slow-bandwidth", default="100Mbit",
                   help="part h: the one slow host's link rate (the others at --bandwidth)")
    p.add_argument("--scheme-nets", default="fc_heavy,vgg_mini",
                   help="nets of part h, comma-separated: fc_heavy, vgg_mini, vgg_block (default "
                        "fc_heavy,vgg_mini)")
    p.add_argument("--scaling-nets", default="fc_heavy,cifar10_quick",
                   help="nets of parts e and g, comma-separated (default fc_heavy,cifar10_quick)")
    p.add_argument("--real-nets", default=REAL_NETS,
                   help="part f: folders of prototxt/ (or deploy files) with their batch, "
                        f"comma-separated (default {REAL_NETS}; --quick alexnet:2)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch columns")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots (no matplotlib)")
    p.add_argument("--unpinned", action="store_true",
                   help="add a labelled second throughput run with OPENBLAS_CORETYPE and "
                        "OPENBLAS_L2_SIZE unset (what a user's own machine gives)")
    p.add_argument("--gpu", default=None, help="also run part a on this GPU: CuPy beside "
                                               "PyTorch CUDA (with --parts '' alone)")
    p.add_argument("--tf32", action="store_true",
                   help="with --gpu: TF32 GEMMs on both sides (the engine's CuPy and PyTorch's "
                        "cuBLAS and cuDNN); default full FP32 on both")
    p.add_argument("--probe", action="store_true",
                   help="with --gpu: the prepared device probe instead (tools/bench/gpu_probe.py: "
                        "versions, GPU tests, layer checks, timings, launches, a CUDA graph "
                        "capture; results.json and results.md in --out, at most 7 minutes)")
    from poseidon.tools.bench.gpu_probe import add_options
    add_options(p)
    p.set_defaults(run=run)


def run(args):
    if args.probe:
        from poseidon.tools.bench import gpu_probe
        return gpu_probe.run_from_bench(args)
    parts, real_nets = _checked(args)
    from poseidon.tools.bench import env, nets, report
    t_start = time.perf_counter()
    runs = args.runs or (2 if args.quick else 5)
    threads = args.threads or env.cpu_count()
    # the engine's own threads (engine/parallel.py: sample ranges on Python threads,
    # numpy's BLAS held to one thread meanwhile); PyTorch gets the same count
    os.environ["POSEIDON_THREADS"] = str(threads)
    meta = _meta(args, env, parts, threads, runs)
    results = {"meta": meta}
    bench_nets = nets.all_nets(quick=args.quick)

    # one GEMM call of the engine runs on one core while it splits the batch over cores
    # (engine/parallel.py), every core running one at once: its peak is that of a
    # call in those conditions. Both peaks are sampled again after each net of part b
    # (env.GemmPeaks: the machine's speed drifts)
    peaks = env.GemmPeaks(threads, quick=args.quick)
    peaks.sample()
    results.update(peaks.results())
    _log_peaks(out, results, "")

    clock = _PartClock()
    results["part_seconds"] = clock.seconds       # where the run's time goes, part by part
    _engine_parts(args, parts, results, bench_nets, peaks, real_nets, threads, runs, clock)
    results["distributed"] = _distributed(args, parts, runs, clock)
    if args.unpinned:
        results["unpinned"] = _unpinned(args, threads, runs)
    if args.gpu is not None:
        results["gpu"] = _gpu(args, bench_nets, runs)

    meta["loadavg_end"] = env.loadavg()
    results["runtime_s"] = time.perf_counter() - t_start
    out_dir = report.write(results, args.out, with_plots=not args.no_plots)
    out(f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'}"
        + (f" and {len(results['plots'])} plots" if results.get("plots") else "")
        + f" in {results['runtime_s']:.0f} s"
        + (f" ({report.part_times_text(clock.seconds)})" if clock.seconds else ""))
    return 0


def _checked(args):
    """The selected parts and part f's (model, batch) list (None without part f), after every
    check that can refuse the run: a bad flag stops it here, not after minutes of measuring."""
    if args.tf32 and args.gpu is None:
        raise PoseidonError("--tf32 sets the GPU run's precision: add --gpu N, or drop --tf32")
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        raise PoseidonError(f"--parts: unknown part(s) {', '.join(bad)}; choose from "
                            f"{', '.join(PARTS)}")
    real_nets = None
    if "f" in parts:              # a bad --real-nets item stops here, not after parts a-b
        from poseidon.tools.bench import model_ref
        try:
            real_nets = model_ref.parse_models(
                "alexnet:2" if args.quick and args.real_nets == REAL_NETS else args.real_nets)
        except SystemExit as e:
            raise PoseidonError(f"--real-nets: {e}") from None
    if not args.no_plots:
        from poseidon.tools.bench import report_plots
        try:
            report_plots.pyplot()
        except report_plots.PlotsUnavailable as e:
            raise PoseidonError(str(e)) from None
    return parts, real_nets


def _meta(args, env, parts, threads, runs):
    """The run's conditions for the report (machine, BLAS, settings, PyTorch), also printed as
    the run's first line."""
    argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "bench" else []
    meta = env.describe(argv)
    meta.update(threads=threads, runs=runs, quick=bool(args.quick), parts=parts)
    if not args.no_torch:
        meta["torch"] = env.torch_info()
    else:
        meta["torch"] = {"available": False, "reason": "--no-torch"}
    out(f"poseidon bench: {meta['cpu']}, {meta['cores']} cores, numpy BLAS "
        f"{meta['blas'].get('library')} kernel {meta['blas'].get('kernel')}, {threads} threads, "
        f"{runs} runs per figure{' (quick)' if args.quick else ''}")
    return meta


class _PartClock:
    """Seconds each part took, from the end of the one before (the report's part-by-part line)."""

    def __init__(self):
        self.seconds = {}
        self.mark = time.perf_counter()

    def done(self, part):
        now = time.perf_counter()
        self.seconds[part] = round(now - self.mark, 1)
        self.mark = now


def _engine_parts(args, parts, results, bench_nets, peaks, real_nets, threads, runs, clock):
    """Parts a, b and f, those selected, into results; part b samples the GEMM peaks again."""
    if "a" in parts:
        from poseidon.tools.bench import throughput
        out("a. training throughput (engine vs PyTorch CPU, interleaved)")
        results["throughput"] = throughput.measure(
            bench_nets, threads, runs=runs, run_s=0.3 if args.quick else 2.0,
            with_torch=not args.no_torch, log=out)
        clock.done("a")
    if "b" in parts:
        from poseidon.tools.bench import layers
        out("b. per-layer times")
        results["layers"] = layers.measure(bench_nets, threads, peaks, runs=runs,
                                           iterations=1 if args.quick else 4, log=out,
                                           with_torch=not args.no_torch)
        results.update(peaks.results())
        _log_peaks(out, results, f", best of {peaks.samples} samples (before part b and after "
                                 f"each of its nets)")
        clock.done("b")
    if "f" in parts:
        from poseidon.tools.bench import model_ref
        out("f. real networks, forward + backward (engine vs PyTorch CPU, taking turns)")
        results["real_nets"] = model_ref.measure(
            real_nets, threads, rounds=min(runs, 2), iterations=1 if args.quick else 2,
            with_torch=not args.no_torch, log=out)
        clock.done("f")


def _distributed(args, parts, runs, clock):
    """Parts c-e, g and h, those selected, in that order; the others recorded as not selected."""
    dist_results = {}
    work = Path(args.out) / "jobs"
    for part, measure in (("c", _part_c), ("d", _part_d), ("e", _part_e), ("g", _part_g),
                          ("h", _part_h)):
        if part in parts:
            measure(args, work, runs, dist_results)
            clock.done(part)
    for key in ("single_node_overhead", "transport", "scaling", "emulated_hosts",
                "schemes_across_hosts"):
        dist_results.setdefault(key, {"status": "not measured",
                                      "reason": "part not selected (--parts)"})
    return dist_results


def _part_c(args, work, runs, dist_results):
    """Part c (tools/bench/dist_parts.py): the overhead of the default set-up, then each variant
    beside it; skipped in --quick."""
    from poseidon.tools.bench import dist_parts
    out("c. single-node overhead of the distributed path")
    if args.quick:
        dist_results["single_node_overhead"] = dist_parts.not_measured(
            "skipped in --quick (it starts a distributed job)")
    else:
        dist_results["single_node_overhead"] = dist_parts.single_node_overhead(work)
    out(f"  {_status(dist_results['single_node_overhead'], 'overhead', '{:+.1%}')}")
    for v in dist_parts.overhead_variants(args.quick):
        variant = dist_parts.single_node_overhead(work / v.key, options=v.options,
                                                  threads=v.threads,
                                                  rounds=dist_parts.VARIANT_ROUNDS)
        dist_results[f"single_node_overhead_{v.key}"] = variant
        out(f"  with {v.flag}: {_status(variant, 'overhead', '{:+.1%}')}")


def _part_d(args, work, runs, dist_results):
    """Part d (tools/bench/dist_parts.py): KV push + pull beside raw ZeroMQ; skipped in --quick."""
    from poseidon.tools.bench import dist_parts
    out("d. KV-store push+pull vs raw ZeroMQ (CURVE and plain)")
    if args.quick:
        dist_results["transport"] = dist_parts.not_measured(
            "skipped in --quick (it starts a distributed job)")
    else:
        dist_results["transport"] = dist_parts.transport(work, runs=runs)
    t = dist_results["transport"]
    out(f"  {_status(t, 'ratio', '{:.0%}')}" + (
        f" (TCP, CURVE both; --insecure vs plain {t['ratio_insecure']:.0%}; Unix "
        f"sockets {t['ratio_ipc']:.0%})"
        if t.get("ratio_ipc") is not None else ""))


def _part_e(args, work, runs, dist_results):
    """Part e (tools/bench/dist_parts.py): scaling under --bandwidth."""
    from poseidon.tools.bench import dist_parts
    out(f"e. scaling under a {args.bandwidth} cap")
    dist_results["scaling"] = dist_parts.scaling(
        work, quick=args.quick, bandwidth=args.bandwidth, runs=runs,
        net_keys=[k.strip() for k in args.scaling_nets.split(",") if k.strip()])
    out(f"  {dist_results['scaling']['status']}"
        + (f": {dist_results['scaling'].get('reason')}"
           if dist_results['scaling'].get('reason') else ""))


def _part_g(args, work, runs, dist_results):
    """Part g (tools/bench/hosts_part.py): skipped in --quick; its token-bucket side from part e
    of this run where part e measured the row."""
    from poseidon.tools.bench import dist_parts, hosts_part
    out(f"g. scaling across emulated hosts, links at {args.bandwidth} (tbf)")
    if args.quick:
        g = dist_parts.not_measured("skipped in --quick (it starts jobs of up to 8 processes "
                                    "across network namespaces)")
    else:
        g = hosts_part.emulated_hosts(
            work, bandwidth=args.bandwidth, part_e=dist_results.get("scaling"), log=out,
            net_keys=[k.strip() for k in args.scaling_nets.split(",") if k.strip()])
    dist_results["emulated_hosts"] = g
    figure = (g.get("target_figure") or {}).get("netns")
    out(f"  {g['status']}" + (f": {g.get('reason')}" if g.get("reason") else "")
        + (f"; hybrid / no-overlap ps, fc_heavy at 4 workers: {figure:.2f}"
           if figure is not None else ""))


def _part_h(args, work, runs, dist_results):
    """Part h (tools/bench/schemes_part.py): skipped in --quick."""
    from poseidon.tools.bench import dist_parts, schemes_part
    out(f"h. schemes across {schemes_part.HOSTS} emulated hosts at {args.bandwidth}, beside DDP")
    if args.quick:
        h = dist_parts.not_measured("skipped in --quick (it starts jobs of 8 processes "
                                    "across network namespaces)")
    else:
        h = schemes_part.schemes_across_hosts(
            work, bandwidth=args.bandwidth, slow=args.slow_bandwidth,
            runs=min(args.runs or 1, 3),
            net_keys=[k.strip() for k in args.scheme_nets.split(",") if k.strip()], log=out)
    dist_results["schemes_across_hosts"] = h
    out(f"  {h['status']}" + (f": {h.get('reason')}" if h.get("reason") else ""))
    for net, v in (h.get("verdicts") or {}).items():
        out(f"  {net}: " + ", ".join(f"{k} {x:.2f}" for k, x in v.items()
                                      if isinstance(x, float)))


def _log_peaks(out, results, how):
    peak, call = results["gemm_peak"], results["gemm_peak_call"]
    out(f"GEMM peak{how}: {peak['peak']:.0f} GFLOP/s (median {peak['median']:.0f} over "
        f"{len(peak['runs'])} runs)")
    if "gemm_peak_call_alone" in results:
        out(f"GEMM peak of one call, 1 thread, {call['calls']} at once{how}: "
            f"{call['peak']:.0f} GFLOP/s (alone: {results['gemm_peak_call_alone']['peak']:.0f})")


def _status(part, key, fmt):
    if part.get("status") == "measured":
        return f"{key} {fmt.format(part[key])}"
    return f"{part.get('status')}: {part.get('reason')}"


def _unpinned(args, threads, runs):
    """Part a again in a child process with OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset."""
    import json
    from poseidon.dist.job.spawn import module_command
    pinned = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    if not any(pinned.values()):
        return {"status": "not measured",
                "reason": "OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are already unset: the main "
                          "run is the unpinned one"}
    child_out = Path(args.out) / "unpinned"
    env_vars = {k: v for k, v in os.environ.items() if k not in pinned}
    cmd = module_command("poseidon.tools.cli", "bench", "--parts", "a", "--no-plots",
                         "--out", child_out, "--runs", runs, "--threads", threads)
    if args.quick:
        cmd.append("--quick")
    if args.no_torch:
        cmd.append("--no-torch")
    out("unpinned: part a again with OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset")
    proc = subprocess.run(cmd, env=env_vars)
    if proc.returncode != 0:
        return {"status": "failed", "reason": f"exit status {proc.returncode}"}
    child = json.loads((child_out / "results.json").read_text())
    return {"status": "measured", "unset": pinned, "blas": child["meta"]["blas"],
            "gemm_peak": child["gemm_peak"], "throughput": child["throughput"]}


def _gpu(args, bench_nets, runs):
    from poseidon.engine import backend
    from poseidon.tools.bench import throughput
    try:
        backend.set_mode_gpu(int(args.gpu))
    except Exception as e:
        return {"status": "not measured", "reason": f"no GPU: {e}"}
    try:
        import cupy
        precision = backend.set_tf32(args.tf32)
        device = backend.device_name(cupy)
        out(f"GPU: {device}: engine on CuPy vs PyTorch CUDA, "
            + ("TF32 GEMMs on both sides" if args.tf32 else "full FP32 on both sides (TF32 off)")
            + ("" if precision in ("tf32", "fp32") else f"; engine: {precision}"))
        thr = throughput.measure(bench_nets, 1, runs=runs, run_s=0.3 if args.quick else 2.0,
                                 torch_device=f"cuda:{int(args.gpu)}", xp=cupy,
                                 with_torch=not args.no_torch, log=out, tf32=args.tf32)
    finally:
        backend.set_tf32(False)
        backend.set_mode_cpu()
    return {"status": "measured", "device": device, "throughput": thr,
            "precision": "tf32" if args.tf32 else "fp32", "engine_precision": precision}
