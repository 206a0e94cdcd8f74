"""The real Caffe files (POSEIDON_CAFFE_MODELS, tests/conftest.py) load unchanged.

The files are read where they are, never copied or edited. Their train_val files and solvers name
paths relative to Caffe's root (examples/cifar10/cifar10_train_lmdb, data/ilsvrc12/..., a solver's
`net: "examples/..."`), so the tests run in a temporary "Caffe root": tiny LMDBs of the right image
size at those paths, mean files written with engine.io.caffemodel.write_binaryproto, and symbolic
links to the real model files where a solver names them.
"""
import os
from pathlib import Path

import numpy
import pytest

from poseidon.engine import prototxt
from poseidon.engine.io.caffemodel import write_binaryproto
from poseidon.engine.io.datum import array_to_datum
from poseidon.engine.io.lmdb_store import write_lmdb
from poseidon.engine.net import Net
from poseidon.engine.solvers import get_solver

from tests.conftest import CAFFE_MODELS, needs_caffe_models

SHARED = CAFFE_MODELS
pytestmark = needs_caffe_models

DEPLOYS = {"cifar10/cifar10_quick.prototxt": (145578, (1, 10)),
           "bvlc_alexnet/deploy.prototxt": (60965224, (10, 1000)),
           "bvlc_googlenet/deploy.prototxt": (6998552, (10, 1000)),
           "vgg/VGG_ILSVRC_19_layers_deploy.prototxt": (143667240, (10, 1000)),
           "resnet/ResNet-152-deploy.prototxt": (60192808, (1, 1000)),
           "inception/deploy_inception-v3.prototxt": (23834568, (1, 1000))}
# train_val file -> (learnable parameters, input shape in TRAIN, in TEST, outputs in TEST)
TRAIN_VALS = {
    "cifar10/cifar10_quick_train_test.prototxt": (145578, (100, 3, 32, 32), (100, 3, 32, 32),
                                                  ["accuracy", "loss"]),
    "cifar10/cifar10_full_train_test.prototxt": (89578, (100, 3, 32, 32), (100, 3, 32, 32),
                                                 ["accuracy", "loss"]),
    "mnist/lenet_train_test.prototxt": (431080, (64, 1, 28, 28), (100, 1, 28, 28),
                                        ["accuracy", "loss"]),
    "bvlc_alexnet/train_val.prototxt": (60965224, (256, 3, 227, 227), (50, 3, 227, 227),
                                        ["accuracy", "loss"]),
    "bvlc_reference_caffenet/train_val.prototxt": (60965224, (256, 3, 227, 227),
                                                   (50, 3, 227, 227), ["accuracy", "loss"]),
    # with the two auxiliary classifiers: 6998552 + 3188840 + 3190888
    "bvlc_googlenet/train_val.prototxt": (13378280, (32, 3, 224, 224), (50, 3, 224, 224),
                                          [f"loss{i}/{o}" for i in (1, 2, 3)
                                           for o in (f"loss{i}", "top-1", "top-5")]),
}
SOLVERS = ["cifar10/cifar10_quick_solver.prototxt", "cifar10/cifar10_quick_solver_lr1.prototxt",
           "mnist/lenet_solver.prototxt", "bvlc_alexnet/solver.prototxt",
           "bvlc_googlenet/quick_solver.prototxt"]
# where Caffe's solver files expect the model files, relative to Caffe's root
LINKS = {"examples/cifar10/cifar10_quick_train_test.prototxt":
         "cifar10/cifar10_quick_train_test.prototxt",
         "examples/mnist/lenet_train_test.prototxt": "mnist/lenet_train_test.prototxt",
         "models/bvlc_alexnet/train_val.prototxt": "bvlc_alexnet/train_val.prototxt",
         "models/bvlc_googlenet/train_val.prototxt": "bvlc_googlenet/train_val.prototxt"}


def tiny_lmdb(path, shape, count):
    r = numpy.random.default_rng(len(str(path)))
    records = ((f"{i:08d}", array_to_datum(r.integers(0, 256, shape, dtype=numpy.uint8),
                                           i % 10).SerializeToString()) for i in range(count))
    write_lmdb(str(path), records)


@pytest.fixture(scope="module")
def caffe_root(tmp_path_factory):
    """A temporary Caffe root holding the data the real files name, and links to the models."""
    root = tmp_path_factory.mktemp("caffe_root")
    for folder in ("examples/cifar10", "examples/mnist", "examples/imagenet", "data/ilsvrc12",
                   "models/bvlc_alexnet", "models/bvlc_googlenet"):
        (root / folder).mkdir(parents=True)
    for part in ("train", "test"):
        tiny_lmdb(root / f"examples/cifar10/cifar10_{part}_lmdb", (3, 32, 32), 12)
        tiny_lmdb(root / f"examples/mnist/mnist_{part}_lmdb", (1, 28, 28), 12)
    for part in ("train", "val"):
        tiny_lmdb(root / f"examples/imagenet/ilsvrc12_{part}_lmdb", (3, 256, 256), 3)
    r = numpy.random.default_rng(1)
    write_binaryproto(r.uniform(0, 255, (3, 32, 32)).astype(numpy.float32),
                      str(root / "examples/cifar10/mean.binaryproto"))
    write_binaryproto(r.uniform(0, 255, (3, 256, 256)).astype(numpy.float32),
                      str(root / "data/ilsvrc12/imagenet_mean.binaryproto"))
    for link, target in LINKS.items():
        try:
            os.symlink(SHARED / target, root / link)
        except OSError as e:     # pragma: no cover - file systems without symbolic links
            pytest.skip(f"cannot make symbolic links in {root} ({e}): the solvers' `net` paths "
                        f"cannot be resolved without copying the files")
    return root


@pytest.fixture
def in_root(caffe_root, monkeypatch):
    monkeypatch.chdir(caffe_root)
    return caffe_root


def shutdown(*nets):
    for net in nets:
        net.shutdown()


def close(solver):
    shutdown(solver.net, *solver.test_nets)


def params_of(net):
    return [numpy.array(b.data) for b in net.learnable_params]


def test_the_files_are_the_known_ones():
    found = {str(p.relative_to(SHARED)) for p in SHARED.rglob("*.prototxt")}
    assert found == set(DEPLOYS) | set(TRAIN_VALS) | set(SOLVERS)


@pytest.mark.parametrize("rel", sorted(DEPLOYS))
def test_deploy_file_builds(rel):
    total, out_shape = DEPLOYS[rel]
    net = Net(str(SHARED / rel), "TEST")
    assert net.param_counts()[0] == total
    assert net.output_names == ["prob"] and net.blobs["prob"].shape == out_shape
    assert net.inputs == ["data"]
    shutdown(net)


def test_small_deploy_file_runs_forward():
    net = Net(str(SHARED / "cifar10/cifar10_quick.prototxt"), "TEST")
    image = numpy.random.default_rng(0).uniform(-1, 1, (1, 3, 32, 32))
    prob = numpy.asarray(net.forward(data=image)["prob"])
    assert prob.shape == (1, 10) and abs(prob.sum() - 1) < 1e-5


@pytest.mark.parametrize("rel", sorted(TRAIN_VALS))
def test_train_val_file_builds_in_both_phases(in_root, rel):
    total, train_shape, test_shape, test_outputs = TRAIN_VALS[rel]
    train = Net(str(SHARED / rel), "TRAIN")
    test = Net(str(SHARED / rel), "TEST")
    try:
        for net, shape in ((train, train_shape), (test, test_shape)):
            assert net.param_counts()[0] == total
            assert net.blobs["data"].shape == shape and net.blobs["label"].shape == shape[:1]
        assert test.output_names == sorted(test_outputs)
        if shape[0] <= 100 and shape[2] <= 32:          # the small ones: one real pass each
            assert numpy.isfinite(train.ForwardBackward())
            assert numpy.isfinite(test.Forward())
    finally:
        shutdown(train, test)


@pytest.mark.parametrize("rel", SOLVERS)
def test_solver_file_parses(rel):
    param = prototxt.read_solver(str(SHARED / rel))
    assert param.net and param.max_iter > 0 and param.base_lr > 0 and len(param.test_iter) == 1


def short(solver, max_iter, snapshot=0, test_interval=None):
    """Shorten a solver built from a real file (the file itself is not touched)."""
    p = solver.param
    p.max_iter, p.snapshot = max_iter, snapshot
    p.test_interval = test_interval or max_iter
    p.test_iter[0] = 1
    p.display = 1
    return solver


@pytest.mark.parametrize("rel, prefix", [
    ("cifar10/cifar10_quick_solver.prototxt", "examples/cifar10/cifar10_quick"),
    ("mnist/lenet_solver.prototxt", "examples/mnist/lenet")])
def test_solver_file_trains(in_root, rel, prefix):
    solver = short(get_solver(str(SHARED / rel)), 3)
    try:
        before = params_of(solver.net)
        solver.solve()
        assert solver.iter == 3
        assert all(numpy.isfinite(p).all() for p in params_of(solver.net))
        assert any(not numpy.array_equal(a, b) for a, b in zip(before, params_of(solver.net)))
        assert 0 <= solver.last_test_results[0]["accuracy"] <= 1
    finally:
        close(solver)
    for ext in (".caffemodel", ".solverstate"):
        assert (in_root / f"{prefix}_iter_3{ext}").exists()


def test_hdf5_solver_snapshots_and_resumes(in_root):
    pytest.importorskip("h5py", reason="h5py is not installed: snapshot_format: HDF5 needs it "
                                       "(pip install h5py, or the [hdf5] extra)")
    rel = "cifar10/cifar10_quick_solver_lr1.prototxt"
    prefix = in_root / "examples/cifar10/cifar10_quick"
    straight = short(get_solver(str(SHARED / rel)), 4, snapshot=2, test_interval=2)
    try:
        straight.solve()
        expected = params_of(straight.net)
    finally:
        close(straight)
    for it in (2, 4):
        for ext in (".caffemodel.h5", ".solverstate.h5"):
            assert Path(f"{prefix}_iter_{it}{ext}").exists()
        assert not Path(f"{prefix}_iter_{it}.caffemodel").exists()

    resumed = short(get_solver(str(SHARED / rel)), 4, snapshot=0, test_interval=2)
    resumed.param.snapshot_after_train = False
    try:
        resumed.solve(resume_file=f"{prefix}_iter_2.solverstate.h5")
        assert resumed.iter == 4
        for a, b in zip(expected, params_of(resumed.net)):
            assert numpy.array_equal(a, b)
    finally:
        close(resumed)


@pytest.mark.parametrize("rel", ["bvlc_alexnet/solver.prototxt",
                                 "bvlc_googlenet/quick_solver.prototxt"])
def test_imagenet_solver_files_build_their_nets(in_root, rel):
    solver = get_solver(str(SHARED / rel))
    try:
        assert len(solver.test_nets) == 1
        assert solver.net.blobs["data"].shape[0] in (256, 32)
        assert solver.test_nets[0].blobs["data"].shape[0] == 50
        # the test net shares the train net's parameters
        test_params = solver.test_nets[0].params
        assert list(test_params) == list(solver.net.params)
        assert all(a is b for name, blobs in solver.net.params.items()
                   for a, b in zip(blobs, test_params[name]))
    finally:
        close(solver)
