"""Numerical faults: a NaN injected into worker 1's gradient at one iteration (a Python layer keyed
on its rank, tests/dist/fault_layers.py) stops the distributed run naming the iteration, the worker
and the layer, before the bad gradient leaves the worker; every process exits and the last good
snapshot stays intact.

Run: python -m pytest tests/dist/test_nan.py -q -s
"""
import glob
import json
import re
import subprocess
import time

import pytest

from poseidon.dist.errors import DistError
from poseidon.engine.io import manifest

from .helpers import fc_net, make_lmdb, run_threads, solver_param
from .test_processes import alive, cli, env, write_solver

NAN_AT = 7


def poisoned(net_text, rank=1, iteration=NAN_AT):
    """The net with an in-place pass-through on ip2's output that puts a NaN into ip2's top
    gradient on `rank` at `iteration` (so ip2's and, below it, ip1's gradients hold NaN)."""
    config = json.dumps({"rank": rank, "iter": iteration})
    layer = (f'layer {{ name: "poison" type: "Python" bottom: "ip2" top: "ip2" python_param {{ '
             f'module: "tests.dist.fault_layers" layer: "NaNOnRank" param_str: \'{config}\' }} }}\n')
    return net_text.replace('layer { name: "relu2"', layer + 'layer { name: "relu2"', 1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train")


@pytest.mark.slow
def test_nan_stops_the_launched_job_naming_iteration_worker_and_layer(data, tmp_path):
    """`poseidon train --workers 2 --servers 1`, snapshots every 3 iterations, NaN at 7."""
    solver = write_solver(tmp_path / "job", poisoned(fc_net(data, 4)), 20, snapshot=3)
    t0 = time.monotonic()
    r = subprocess.run(cli("--solver", solver, "--workers", 2, "--servers", 1, "--no-progress"),
                       env=env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=120)
    elapsed = time.monotonic() - t0
    text = r.stdout.decode()
    snap = tmp_path / "job" / "snap"
    last = str(snap / "run_iter_6.solverstate")
    want = (f"worker 1: iteration {NAN_AT}: layer 'ip2' weight gradient has NaN/Inf; stopping "
            f"(last good snapshot: {last})")
    lines = [line for line in text.splitlines() if "NaN/Inf" in line]
    print(f"\nexit status {r.returncode} after {elapsed:.1f} s; the lines naming the fault:")
    print("\n".join(lines))
    assert r.returncode != 0
    assert any(line.startswith("[worker 1]") and want in line for line in lines), text[-3000:]
    for who in ("worker 0", "server 0"):          # the others stop, naming worker 1's fault
        assert re.search(rf"\[{who}\] .*stopping: .*iteration {NAN_AT}: layer 'ip2'", text), \
            text[-3000:]
    m = re.search(r"poseidon: worker 0 pid (\d+), worker 1 pid (\d+), server 0 pid (\d+)", text)
    assert m, text[:2000]
    assert not any(alive(int(pid)) for pid in m.groups()), "a process was left behind"
    manifest.verify_manifest(str(snap / "run_iter_6.manifest.json"))   # intact, and complete
    later = [p for p in glob.glob(str(snap / "run_iter_*.manifest.json"))
             if int(re.search(r"_iter_(\d+)\.", p).group(1)) > 6]
    assert not later, f"a snapshot was written after the fault: {later}"


@pytest.mark.slow
def test_nan_through_the_parameter_server(data):
    """--sync ps, roles as threads: the gradient is checked before it is pushed, and the job's
    error names worker 1, the iteration and ip2 (the first bad layer in backward order)."""
    param = solver_param(poisoned(fc_net(data, 4)), max_iter=12)
    with pytest.raises(DistError) as error:
        run_threads(param, 2, 1, sync="ps", timeout=20, bucket_bytes=0)   # each layer alone
    print(f"\n{error.value}")
    assert (f"worker 1: iteration {NAN_AT}: layer 'ip2' weight gradient has NaN/Inf; stopping "
            f"(last good snapshot: none written yet)") in str(error.value)


@pytest.mark.slow
def test_nan_in_a_bucket_names_the_layer_inside_it(data):
    """--bucket-bytes puts the three layers into one sync ('ip3+ip2+ip1'): the error names the
    bucket and, inside it, ip2, whose gradient is the first bad one in backward order."""
    param = solver_param(poisoned(fc_net(data, 4)), max_iter=12)
    with pytest.raises(DistError) as error:
        run_threads(param, 2, 1, sync="ps", timeout=20, bucket_bytes=64 << 20)
    print(f"\n{error.value}")
    assert (f"worker 1: iteration {NAN_AT}: layer 'ip3+ip2+ip1' weight gradient (of layer 'ip2') has "
            f"NaN/Inf") in str(error.value)
