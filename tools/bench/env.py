"""What the numbers were measured on: machine, BLAS kernel and threads, the environment variables
that change them, load; the GEMM peak; and thread limits for numpy's BLAS during a measurement."""
import contextlib
import datetime
import os
import platform
import sys
import time

import numpy

ENV_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "MKL_ENABLE_INSTRUCTIONS")


def cpu_model():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # pragma: no cover - not Linux
        return os.cpu_count() or 1


def blas_info():
    """numpy's BLAS: library, kernel (architecture) and thread count, from threadpoolctl when it
    imports, else from numpy.show_config()."""
    try:
        import threadpoolctl
    except ImportError:
        threadpoolctl = None
    if threadpoolctl is not None:
        pools = [p for p in threadpoolctl.threadpool_info() if p.get("user_api") == "blas"]
        if pools:
            p = pools[0]
            return {"source": "threadpoolctl", "library": p.get("internal_api"),
                    "version": p.get("version"), "kernel": p.get("architecture"),
                    "threads": p.get("num_threads"), "threading_layer": p.get("threading_layer"),
                    "filepath": p.get("filepath")}
    info = {"source": "numpy.show_config", "library": None, "kernel": None, "threads": None}
    try:
        cfg = numpy.show_config(mode="dicts")
        blas = cfg.get("Build Dependencies", {}).get("blas", {})
        info.update(library=blas.get("name"), version=blas.get("version"),
                    config=blas.get("openblas configuration"))
    except Exception as e:  # pragma: no cover - old numpy
        info["error"] = str(e)
    return info


def torch_info():
    try:
        import torch
    except Exception as e:
        return {"available": False, "reason": f"torch is not importable ({type(e).__name__}: {e})"}
    info = {"available": True, "version": torch.__version__, "threads": torch.get_num_threads()}
    try:
        info["mkldnn"] = bool(torch.backends.mkldnn.is_available())
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:
        pass
    return info


def describe(argv=None):
    return {
        "command": " ".join(["poseidon", "bench"] + list(argv or [])),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "cpu": cpu_model(), "cores": cpu_count(),
        "python": sys.version.split()[0], "numpy": numpy.__version__,
        "platform": platform.platform(),
        "blas": blas_info(),
        "env": {name: os.environ.get(name) for name in ENV_VARS},
        "loadavg_start": _loadavg(),
    }


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return None


def loadavg():
    return _loadavg()


@contextlib.contextmanager
def blas_threads(n):
    """Limit numpy's BLAS to n threads for the block (threadpoolctl; a no-op without it, then
    the threads are what OPENBLAS_NUM_THREADS gave at start-up)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield False
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield True


def stats(values):
    """median / min / max (and the runs) of a list of numbers."""
    v = sorted(float(x) for x in values)
    return {"median": float(numpy.median(v)), "min": v[0], "max": v[-1], "runs": v}


def median_interval(values, level=0.95, resamples=4000, seed=0):
    """[low, high]: the bootstrap (percentile) interval of the median of values, or None for
    fewer than 4 values. It says how far this machine's noise could move a median of these
    rounds, so a target can be read as met, missed, or not resolved."""
    v = numpy.asarray([float(x) for x in values])
    if v.size < 4:
        return None
    picks = numpy.random.default_rng(seed).integers(0, v.size, (resamples, v.size))
    medians = numpy.median(v[picks], axis=1)
    tail = (1.0 - level) / 2
    low, high = numpy.quantile(medians, [tail, 1.0 - tail])
    return [float(low), float(high)]


def _square_operands(size, dtype):
    """Two random size x size matrices and the FLOPs of their product."""
    rs = numpy.random.default_rng(0)
    a = rs.standard_normal((size, size)).astype(dtype)
    b = rs.standard_normal((size, size)).astype(dtype)
    return a, b, 2.0 * size ** 3


def gemm_peak(size=2048, runs=7, dtype=numpy.float32):
    """GFLOP/s of a large square float32 numpy matmul (out= a preallocated array), several runs."""
    a, b, flops = _square_operands(size, dtype)
    c = numpy.empty((size, size), dtype)
    numpy.matmul(a, b, out=c)
    rates = []
    for _ in range(runs):
        t = time.perf_counter()
        numpy.matmul(a, b, out=c)
        rates.append(flops / (time.perf_counter() - t) / 1e9)
    out = stats(rates)
    out.update(size=size, dtype=numpy.dtype(dtype).name, peak=out["max"],
               note="GFLOP/s of a float32 matmul of two square matrices; 'peak' is the best run "
                    "(the machine's capability: a loaded machine only lowers runs)")
    return out


def gemm_peak_concurrent(calls, size=2048, runs=5, dtype=numpy.float32):
    """GFLOP/s of one call when `calls` single-thread matmuls run at once, one per thread, as
    the engine runs its GEMMs while it splits a batch over cores (engine/parallel.py):
    the cores then share the caches and the memory bus, so a call alone on an idle machine is
    faster than any of the engine's calls can be. Per run, the mean rate of the calls; BLAS must
    be held to one thread (blas_threads(1)) around this."""
    import threading
    a, b, flops = _square_operands(size, dtype)
    outs = [numpy.empty((size, size), dtype) for _ in range(calls)]
    start = threading.Barrier(calls)
    seconds = [0.0] * calls

    def one(i):
        start.wait()
        t = time.perf_counter()
        numpy.matmul(a, b, out=outs[i])
        seconds[i] = time.perf_counter() - t

    def run_all():
        threads = [threading.Thread(target=one, args=(i,)) for i in range(1, calls)]
        for th in threads:
            th.start()
        one(0)
        for th in threads:
            th.join()
        return sum(flops / s / 1e9 for s in seconds) / calls

    run_all()                                                    # warm-up
    out = stats([run_all() for _ in range(runs)])
    out.update(size=size, dtype=numpy.dtype(dtype).name, peak=out["max"], calls=calls,
               note=f"GFLOP/s of one single-thread float32 matmul of two square matrices while "
                    f"{calls} run at once, one per core (as the engine runs its GEMMs); 'peak' "
                    f"is the best run")
    return out


class GemmPeaks:
    """The two GEMM peaks the shares of part b are taken against, sampled more than once.

    A shared machine's speed drifts by tens of percent within minutes, so a peak taken once,
    before the layers run, can sit below what the layers' own GEMMs reach (a share over 100%) or
    above it.
    A peak is a capability, which a slow moment only lowers: `sample()` is called before part b
    and after each of its nets, and the peak is the best run of all the samples, so every share
    is taken against the fastest the machine was seen to go around those measurements.

    machine: `threads` BLAS threads on one square matmul; call: one single-thread matmul per core,
    all at once, as the engine runs its GEMMs while it splits a batch over cores (with one thread
    the two are the same); alone: one single-thread call on an otherwise idle machine, for
    reference."""

    def __init__(self, threads, quick=False):
        self.threads = threads
        self.size = 1024 if quick else 2048
        self.runs = 3 if quick else 7
        self.call_runs = 3 if quick else 5
        self.samples = 0
        self._rates = {"machine": [], "call": [], "alone": []}

    def sample(self):
        """Measure both peaks once more (about 2 s at 2048³ on 2 cores)."""
        with blas_threads(self.threads):
            self._rates["machine"] += gemm_peak(self.size, self.runs)["runs"]
        if self.threads > 1:
            with blas_threads(1):
                self._rates["call"] += gemm_peak_concurrent(self.threads, self.size,
                                                            self.call_runs)["runs"]
                self._rates["alone"] += gemm_peak(self.size, self.call_runs)["runs"]
        self.samples += 1

    @property
    def machine_peak(self):
        return max(self._rates["machine"])

    @property
    def call_peak(self):
        return max(self._rates["call"]) if self.threads > 1 else self.machine_peak

    def results(self):
        """{"gemm_peak", "gemm_peak_call"[, "gemm_peak_call_alone"]}: stats over every run of
        every sample, 'peak' the best, 'samples' how many times the peaks were measured."""
        size, dtype = self.size, "float32"
        common = {"size": size, "dtype": dtype, "samples": self.samples}
        out = {"gemm_peak": dict(stats(self._rates["machine"]), peak=self.machine_peak,
                                 note="GFLOP/s of a float32 matmul of two square matrices; 'peak' "
                                      "is the best run of all samples (a slow moment only lowers "
                                      "runs)", **common)}
        if self.threads > 1:
            out["gemm_peak_call"] = dict(
                stats(self._rates["call"]), peak=self.call_peak, calls=self.threads, threads=1,
                note=f"GFLOP/s of one single-thread float32 matmul while {self.threads} run at "
                     f"once, one per core (as the engine runs its GEMMs); 'peak' is the best run "
                     f"of all samples", **common)
            out["gemm_peak_call_alone"] = dict(stats(self._rates["alone"]),
                                               peak=max(self._rates["alone"]), **common)
        else:
            out["gemm_peak_call"] = dict(out["gemm_peak"], threads=self.threads)
        return out
