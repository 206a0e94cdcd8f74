"""Snapshots carry a manifest; resuming refuses a torn or altered set with a clear message."""
import pytest

from poseidon.engine import ModelError
from poseidon.engine.io import manifest
from poseidon.engine.solvers import get_solver
from poseidon.engine.prototxt import parse_net_text
from poseidon.engine.proto import caffe_pb2

NET = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _solver(tmp_path):
    param = caffe_pb2.SolverParameter(base_lr=0.1, lr_policy="fixed", max_iter=2, snapshot=2,
                                      snapshot_prefix=str(tmp_path / "s"), random_seed=1)
    param.net_param.CopyFrom(parse_net_text(NET))
    return get_solver(param)


def test_snapshot_writes_manifest_and_resume_verifies(tmp_path):
    _solver(tmp_path).solve()
    state = tmp_path / "s_iter_2.solverstate"
    info = manifest.verify_manifest(manifest.manifest_path(str(state)))
    assert info["iter"] == 2
    _solver(tmp_path).restore(str(state))       # an intact set resumes


@pytest.mark.parametrize("victim, damage", [("s_iter_2.caffemodel", "truncate"),
                                            ("s_iter_2.solverstate", "delete"),
                                            ("s_iter_2.cursors.json", "alter")])
def test_torn_snapshot_is_refused_naming_the_file(tmp_path, victim, damage):
    _solver(tmp_path).solve()
    path = tmp_path / victim
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-5])
    elif damage == "delete":
        path.unlink()
    else:
        path.write_text(path.read_text().replace("2", "3", 1))
    with pytest.raises(ModelError, match=victim.replace(".", r"\.")):
        manifest.verify_manifest(str(tmp_path / "s_iter_2.manifest.json"))
    if damage != "delete":
        with pytest.raises(ModelError, match="snapshot"):
            _solver(tmp_path).restore(str(tmp_path / "s_iter_2.solverstate"))
