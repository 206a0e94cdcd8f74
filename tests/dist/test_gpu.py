"""Workers on CuPy: pinned host buffers, CUDA streams from the pool, events after each layer's
backward; the parameters still equal one numpy process on the combined batch (float64).

Marked `gpu`: skipped with the reason where CuPy or a CUDA device is missing.
"""
import numpy
import pytest

from poseidon.engine import backend

from .helpers import (assert_params_close, conv_net, fc_net, make_lmdb, params_of, reference,
                      run_threads, solver_param)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


@pytest.fixture
def gpu():
    backend.set_mode_gpu(0)
    yield
    backend.set_mode_cpu()


@pytest.mark.slow
@pytest.mark.parametrize("net,K", [("fc", 8), ("conv", 2)])
@pytest.mark.parametrize("sync", ["ps", "sfb", "allreduce", "hybrid"])
def test_gpu_workers_equal_one_process(data, tmp_path, gpu, net, K, sync):
    build = {"fc": fc_net, "conv": conv_net}[net]
    P1, iters = 2, 12
    weights = str(tmp_path / "init.caffemodel")
    backend.set_mode_cpu()
    want = reference(solver_param(build(data, P1 * K), max_iter=iters), weights_out=weights)
    backend.set_mode_gpu(0)
    for overlap in (True, False):
        solvers = run_threads(solver_param(build(data, K), max_iter=iters), P1, 1, weights=weights,
                              sync=sync, no_overlap=not overlap)
        assert solvers[0].net.xp is not numpy
        got = params_of(solvers[0])
        assert_params_close(got, want, rtol=1e-5, label=f"gpu {net} {sync} overlap={overlap}")
        for a, b in zip(got, params_of(solvers[1])):
            assert numpy.array_equal(a, b)
