"""Snapshots carry a manifest; resuming refuses a torn or altered set with a clear message."""
import numpy
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


@pytest.mark.parametrize("text", ["[]", '{"files": null}', '{"files": [1]}', '"files"',
                                  '{"files": [{"file": 3, "bytes": 1, "sha256": "x"}]}'])
def test_manifest_of_the_wrong_shape_is_a_torn_snapshot(tmp_path, text):
    """Valid JSON that is not a list of files with sizes and checksums: one ModelError naming the
    manifest (it was a TypeError), and `--resume auto` goes back to the previous snapshot."""
    from poseidon.dist.job.resume import newest_complete
    param = _solver(tmp_path).param
    param.max_iter, param.snapshot = 4, 2
    get_solver(param).solve()
    newest = tmp_path / "s_iter_4.manifest.json"
    newest.write_text(text)
    with pytest.raises(ModelError, match=r"s_iter_4\.manifest\.json: snapshot manifest does not "
                                         r"list files.*resume from an earlier one"):
        manifest.verify_manifest(str(newest))
    with pytest.raises(ModelError, match=r"s_iter_4\.manifest\.json"):
        _solver(tmp_path).restore(str(tmp_path / "s_iter_4.solverstate"))
    lines = []
    assert newest_complete(str(tmp_path / "s"), say=lines.append) == \
        str(tmp_path / "s_iter_2.solverstate")
    assert len(lines) == 1 and lines[0].startswith("skipping the snapshot of iteration 4: ")


def _experiment(folder, seed):
    """A solver file in `folder` writing to the relative prefix snapshots/run, trained 2
    iterations from `folder` (as a user runs it), with its own random seed."""
    folder.mkdir()
    (folder / "net.prototxt").write_text(NET)
    (folder / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 2\nsnapshot: 2\n'
        f'snapshot_prefix: "snapshots/run"\nrandom_seed: {seed}\n')
    return folder / "snapshots" / "run_iter_2"


def _weights(caffemodel):
    from poseidon.engine.io.caffemodel import proto_to_array, read_net_proto
    return [proto_to_array(b) for lp in read_net_proto(str(caffemodel)).layer for b in lp.blobs]


@pytest.mark.parametrize("with_manifest", [True, False])
def test_resume_from_another_folder_loads_that_snapshots_weights(tmp_path, monkeypatch,
                                                                 with_manifest):
    """Experiments A and B share snapshot_prefix "snapshots/run"; resuming A's snapshot from
    inside B's folder must take A's weights (the solverstate names the relative path
    snapshots/run_iter_2.caffemodel, which in B's folder is B's file)."""
    snaps = {}
    for name, seed in (("A", 1), ("B", 2)):
        snaps[name] = _experiment(tmp_path / name, seed)
        monkeypatch.chdir(tmp_path / name)
        get_solver("solver.prototxt").solve()
    a_weights, b_weights = (_weights(f"{snaps[n]}.caffemodel") for n in "AB")
    assert not numpy.array_equal(a_weights[0], b_weights[0])
    if not with_manifest:                           # a Caffe snapshot: beside the solverstate
        (tmp_path / "A" / "snapshots" / "run_iter_2.manifest.json").unlink()
    monkeypatch.chdir(tmp_path / "B")
    solver = get_solver("solver.prototxt")
    solver.restore(str(tmp_path / "A" / "snapshots" / "run_iter_2.solverstate"))
    for got, want in zip((b.data for b in solver.net.learnable_params), a_weights):
        numpy.testing.assert_array_equal(got.reshape(want.shape), want)


def test_resume_refuses_a_weights_file_cut_at_a_layer_boundary(tmp_path):
    """A cut at a layer boundary parses; a resume needs every layer, so it names the ones left
    out (here the snapshot has no manifest, as Caffe's, so the checksum cannot tell)."""
    from poseidon.engine.io.caffemodel import read_net_proto
    _solver(tmp_path).solve()
    model = tmp_path / "s_iter_2.caffemodel"
    full = read_net_proto(str(model))
    cut = caffe_pb2.NetParameter(name=full.name)
    cut.layer.extend([lp for lp in full.layer if lp.name == "data"])
    assert model.read_bytes().startswith(cut.SerializeToString())
    model.write_bytes(cut.SerializeToString())
    (tmp_path / "s_iter_2.manifest.json").unlink()
    with pytest.raises(ModelError, match=r"s_iter_2\.caffemodel: has no weights for layer\(s\) "
                                         r"'ip' of the net.*resume from an earlier snapshot"):
        _solver(tmp_path).restore(str(tmp_path / "s_iter_2.solverstate"))
