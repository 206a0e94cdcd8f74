"""Randomised jobs through real `poseidon train` processes: hypothesis draws the net's layer sizes,
P1, P2, the scheme, the batch, and the ring's piece, the buckets' and the slices' sizes; the job
must end with the weights of one process on the combined batch (float64) and identical replicas.

A few examples a run (POSEIDON_RANDOM_JOBS, default 3), each a new draw: over many runs the
configurations the fixed matrix (test_train_equivalence.py) does not list get their turn. A
failing draw is printed, shrunk, and can be replayed with @example.

Run: python -m pytest tests/dist/test_random_jobs.py -q
"""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .jobs import (DigitsData, digest_of_snapshot, replica_digests, snapshot_of, train, weights,
                   worst_relative, write_solver)

EXAMPLES = int(os.environ.get("POSEIDON_RANDOM_JOBS", "3"))
ITERATIONS = 4
TOLERANCE = 1e-6


def small_net(data, batch, conv_out, hidden):
    """conv (3x3) -> max pool -> ReLU -> InnerProduct(hidden) -> ReLU -> InnerProduct(10)."""
    return f"""
name: "drawn"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{data.train}" batch_size: {batch} backend: LMDB }} }}
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{data.test}" batch_size: 4 backend: LMDB }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param {{ lr_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}
  convolution_param {{ num_output: {conv_out} pad: 1 kernel_size: 3 stride: 2
    weight_filler {{ type: "gaussian" std: 0.1 }} bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
  inner_product_param {{ num_output: {hidden} weight_filler {{ type: "gaussian" std: 0.05 }}
    bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
"""


JOBS = st.fixed_dictionaries({
    "conv_out": st.integers(1, 12),
    "hidden": st.integers(1, 48),
    "workers": st.integers(2, 4),
    "servers": st.integers(1, 2),
    "sync": st.sampled_from(["ps", "sfb", "allreduce", "hybrid", "ps+sfb", "allreduce+sfb"]),
    "batch": st.integers(1, 6),
    "piece_bytes": st.one_of(st.none(), st.integers(64, 8192)),
    "bucket_bytes": st.one_of(st.just("auto"), st.just(0), st.integers(1024, 1 << 20)),
    "slice_bytes": st.one_of(st.none(), st.integers(4096, 65536)),
    "no_overlap": st.booleans(),
})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return DigitsData(tmp_path_factory.mktemp("random-jobs"))


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(job=JOBS)
def test_a_drawn_job_trains_as_one_process(data, tmp_path_factory, job):
    folder = tmp_path_factory.mktemp("job")
    net = small_net(data, job["batch"], job["conv_out"], job["hidden"])
    workers = job["workers"]
    one = write_solver(folder / "one",
                       small_net(data, workers * job["batch"], job["conv_out"], job["hidden"]),
                       ITERATIONS)
    done = train(one)
    assert done.returncode == 0, done.stdout[-3000:]
    flags = ["--workers", workers, "--servers", job["servers"], "--sync", job["sync"],
             "--bucket-bytes", job["bucket_bytes"]]
    for name in ("piece_bytes", "slice_bytes"):
        if job[name] is not None:
            flags += [f"--{name.replace('_', '-')}", job[name]]
    if job["no_overlap"]:
        flags.append("--no-overlap")
    solver = write_solver(folder / "job", net, ITERATIONS)
    done = train(solver, *flags)
    assert done.returncode == 0, f"{job}: exit {done.returncode}\n{done.stdout[-3000:]}"
    err, where = worst_relative(weights(snapshot_of(solver, ITERATIONS)),
                                weights(snapshot_of(one, ITERATIONS)))
    assert err <= TOLERANCE, f"{job}: blob {where} differs from one process by {err:.3g}"
    want = digest_of_snapshot(snapshot_of(solver, ITERATIONS))
    assert all(d == want for d in replica_digests(solver, ITERATIONS, workers).values()), \
        f"{job}: the replicas differ"
