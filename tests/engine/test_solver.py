"""The Solver loop on a tiny InnerProduct net fed by Python data layers defined in this module."""
import logging
import os
import re

import numpy
import pytest
from google.protobuf import text_format

from poseidon import engine
from poseidon.engine import rng
from poseidon.engine.errors import ModelError, PoseidonError
from poseidon.engine.proto import caffe_pb2
from poseidon.engine.solvers import Solver, get_solver
from poseidon.engine.solvers import GlogFormatter


# ----- data layers (referenced from the prototxt as module "tests.engine.test_solver") ----------------------
class ToyData(engine.Layer):
    """A fixed 3-class problem of 48 samples read in order with a cursor; param_str "batch noise":
    noise > 0 adds engine.rng noise to each batch, so a resumed run must also restore the random state."""

    def setup(self, bottom, top):
        batch, noise = self.param_str.split()
        self.batch, self.noise = int(batch), float(noise)
        rs = numpy.random.RandomState(7 + self.phase)
        self.x = rs.standard_normal((48, 5))
        teacher = rs.standard_normal((5, 3))
        self.y = numpy.argmax(self.x @ teacher, axis=1).astype(numpy.float64)
        self.position = 0

    def reshape(self, bottom, top):
        top[0].reshape(self.batch, 5)
        top[1].reshape(self.batch)

    def forward(self, bottom, top):
        idx = (self.position + numpy.arange(self.batch)) % len(self.x)
        self.position = int((self.position + self.batch) % len(self.x))
        data = self.x[idx]
        if self.noise:
            data = data + self.noise * (rng.uniform(data.shape, numpy, numpy.float64) - 0.5)
        top[0].data[...] = self.xp.asarray(data)
        top[1].data[...] = self.xp.asarray(self.y[idx])

    def backward(self, top, propagate_down, bottom):
        pass

    def get_cursor(self):
        return {"position": self.position}

    def set_cursor(self, cursor):
        self.position = int(cursor["position"])


class Sequence(engine.Layer):
    """Test-net probe: on its k-th forward, top 's' = k and top 'seq' = [k, 10k]."""

    def setup(self, bottom, top):
        self.k = -1

    def reshape(self, bottom, top):
        top[0].reshape()
        top[1].reshape(2)

    def forward(self, bottom, top):
        self.k += 1
        top[0].data[...] = self.k
        top[1].data[...] = self.xp.asarray([self.k, 10 * self.k])

    def backward(self, top, propagate_down, bottom):
        pass


def net_text(batch=4, noise=0.0, name="toy"):
    return f"""
name: "{name}"
layer {{ name: "data" type: "Python" top: "data" top: "label"
  python_param {{ module: "tests.engine.test_solver" layer: "ToyData" param_str: "{batch} {noise}" }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param {{ num_output: 8 weight_filler {{ type: "gaussian" std: 0.3 }}
                         bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  param {{ lr_mult: 1 decay_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}
  inner_product_param {{ num_output: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
  include {{ phase: TEST }} }}
"""


def make_solver(extra="", batch=4, noise=0.0, **kwargs):
    text = (f'net_param {{ {net_text(batch, noise)} }}\n'
            'base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.001 '
            'random_seed: 3 display: 0 max_iter: 100 snapshot_after_train: false\n' + extra)
    # Merge: a later field in `extra` overrides the defaults above
    return Solver(text_format.Merge(text, caffe_pb2.SolverParameter()), dtype=numpy.float32,
                  xp=numpy, **kwargs)


def params_of(solver):
    return [numpy.array(b.data) for b in solver.net.learnable_params]


def history_of(solver):
    return [numpy.array(s) for h in solver.history for s in h]


# ----- tests --------------------------------------------------------------------------------------------
def test_loss_decreases():
    solver = make_solver()
    losses = []
    for _ in range(60):
        solver.net.ClearParamDiffs()
        losses.append(solver.forward_backward())
        solver.apply_update()
        solver.iter += 1
    assert solver.iter == 60
    assert numpy.mean(losses[-12:]) < 0.5 * numpy.mean(losses[:12])


def test_step_counts_and_shares_weights_with_test_net():
    solver = make_solver('test_iter: 3 test_interval: 5')
    solver.step(7)
    assert solver.iter == 7
    test = solver.test_nets[0]
    assert test.params["ip1"][0] is solver.net.params["ip1"][0]
    assert "accuracy" in test.output_names and "accuracy" not in solver.net.output_names


def test_seed_makes_init_reproducible():
    a, b = make_solver(), make_solver()
    for x, y in zip(params_of(a), params_of(b)):
        numpy.testing.assert_array_equal(x, y)


def test_iter_size_equals_bigger_batch():
    """iter_size 2 with batch K gives the updates of iter_size 1 with batch 2K (normalize before decay)."""
    small = make_solver("iter_size: 2", batch=4)
    big = make_solver("iter_size: 1", batch=8)
    for x, y in zip(params_of(small), params_of(big)):
        numpy.testing.assert_array_equal(x, y)
    small.step(6)
    big.step(6)
    for x, y in zip(params_of(small), params_of(big)):
        numpy.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)
    assert not numpy.allclose(params_of(small)[0], params_of(make_solver())[0])


def test_clip_gradients(caplog):
    """With SGD, no momentum and no decay, the whole step is lr * clip / ||g|| * g: its norm is lr*clip."""
    caplog.set_level(logging.INFO, logger="poseidon")
    solver = make_solver("clip_gradients: 0.01 momentum: 0 weight_decay: 0")
    before = params_of(solver)
    solver.step(1)
    lr_mults = [s.lr_mult for s in solver.net.learnable_param_specs]
    # undo the lr_mult of ip2's bias so the steps are lr * clipped gradient
    sq = sum(float(((a - b) ** 2).sum()) / m ** 2
             for a, b, m in zip(params_of(solver), before, lr_mults))
    assert numpy.sqrt(sq) == pytest.approx(0.1 * 0.01, rel=1e-4)
    assert any("Gradient clipping: scaling down gradients (L2 norm" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("kind,fmt", [("SGD", "BINARYPROTO"), ("Adam", "BINARYPROTO"),
                                      ("Nesterov", "HDF5")])
def test_snapshot_restore_is_bitwise(tmp_path, kind, fmt):
    if fmt == "HDF5":
        pytest.importorskip("h5py")
    extra = (f'type: "{kind}" snapshot_prefix: "{tmp_path}/toy" snapshot_format: {fmt} '
             f'test_iter: 2 test_interval: 3')
    if kind == "Adam":
        extra += " momentum2: 0.99 base_lr: 0.01"
    straight = make_solver(extra, noise=0.2)
    straight.step(10)

    first = make_solver(extra, noise=0.2)
    first.step(5)
    state_file = first.snapshot()
    suffix = ".h5" if fmt == "HDF5" else ""
    assert state_file == f"{tmp_path}/toy_iter_5.solverstate{suffix}"
    assert os.path.exists(f"{tmp_path}/toy_iter_5.caffemodel{suffix}")
    assert os.path.exists(f"{tmp_path}/toy_iter_5.cursors.json")

    resumed = make_solver(extra, noise=0.2)
    rng.uniform((17,), numpy)                       # disturb the random stream: restore must reset it
    resumed.net.layer_dict["data"].position = 11    # and the data cursor
    resumed.restore(state_file)
    assert resumed.iter == 5
    for x, y in zip(params_of(resumed), params_of(first)):
        numpy.testing.assert_array_equal(x, y)
    resumed.step(5)
    assert resumed.iter == straight.iter == 10
    for x, y in zip(params_of(resumed) + history_of(resumed), params_of(straight) + history_of(straight)):
        numpy.testing.assert_array_equal(x, y)


def test_restore_rejects_wrong_history_count(tmp_path):
    sgd = make_solver(f'snapshot_prefix: "{tmp_path}/s"')
    sgd.step(1)
    path = sgd.snapshot()
    adam = make_solver('type: "Adam"')
    with pytest.raises(ModelError, match="history blobs"):
        adam.restore(path)


def test_test_outputs_are_averaged(caplog):
    caplog.set_level(logging.INFO, logger="poseidon")
    text = f"""
train_net_param {{ {net_text()} }}
test_net_param {{ name: "probe"
  layer {{ name: "seq" type: "Python" top: "s" top: "seq" loss_weight: 0.5 loss_weight: 0
           python_param {{ module: "tests.engine.test_solver" layer: "Sequence" }} }} }}
test_iter: 4 test_interval: 100
base_lr: 0.1 lr_policy: "fixed" display: 0 max_iter: 1
"""
    solver = Solver(text_format.Parse(text, caffe_pb2.SolverParameter()), xp=numpy)
    caplog.clear()
    result = solver.test(0)
    assert result["s"] == pytest.approx(1.5)
    numpy.testing.assert_allclose(result["seq"], [1.5, 15.0])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["Iteration 0, Testing net (#0)",
                     "    Test net output #0: s = 1.5 (* 0.5 = 0.75 loss)",
                     "    Test net output #1: seq = 1.5",
                     "    Test net output #2: seq = 15"]


@pytest.mark.parametrize("factored", [True, False])
def test_nan_gradient_stops_with_iteration_and_layer(tmp_path, factored):
    """A NaN in ip1's weight gradient: in its diff when the weight is updated from the diff, in
    the top gradient (the factor G) when it is updated from factors (engine/solvers/factored.py)."""
    class Faulty(Solver):
        def forward_backward(self):
            loss = super().forward_backward()
            if self.iter == 3:
                if factored:
                    self.net.blobs["ip1"].diff[0, 1] = numpy.nan
                else:
                    self.net.params["ip1"][0].diff[0, 1] = numpy.nan
            return loss

    text = (f'net_param {{ {net_text()} }} base_lr: 0.1 lr_policy: "fixed" max_iter: 10 '
            f'snapshot: 2 snapshot_prefix: "{tmp_path}/f"')
    solver = Faulty(text_format.Parse(text, caffe_pb2.SolverParameter()), xp=numpy)
    assert [layer.name for _, _, layer in solver.factored.entries] == ["ip1", "ip2"]
    if not factored:
        solver.factored.entries = []
    with pytest.raises(PoseidonError, match=r"iteration 3: loss is .*layer 'ip1'.*param #0"):
        solver.solve()
    assert solver.iter == 3
    assert sorted(os.listdir(tmp_path)) == ["f_iter_2.caffemodel", "f_iter_2.cursors.json",
                                            "f_iter_2.manifest.json", "f_iter_2.solverstate"]


def test_nan_loss_names_first_layer_in_backward_order():
    solver = make_solver(noise=0.0)
    solver.net.layer_dict["data"].x[:] = numpy.nan
    with pytest.raises(PoseidonError, match=r"iteration 0: loss is nan.*layer 'ip2'"):
        solver.step(1)


def test_solve_logs_and_snapshots_from_files(tmp_path, monkeypatch, caplog):
    """Solver file with a relative net path (found beside the solver), Caffe's log lines, resume."""
    caplog.set_level(logging.INFO, logger="poseidon")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "toy.prototxt").write_text(net_text())
    (folder / "solver.prototxt").write_text(
        'net: "toy.prototxt"\ntest_iter: 2\ntest_interval: 4\nbase_lr: 0.05\nlr_policy: "step"\n'
        'gamma: 0.5\nstepsize: 4\nmomentum: 0.9\ndisplay: 2\nmax_iter: 6\nsnapshot: 4\n'
        'random_seed: 1\n')
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    solver = get_solver(str(folder / "solver.prototxt"), xp=numpy)
    assert solver.param.snapshot_prefix == str(folder / "solver")
    solver.solve()
    lines = [r.getMessage() for r in caplog.records]
    assert "Solving toy" in lines and "Learning Rate Policy: step" in lines
    assert lines[-1] == "Optimization Done."
    assert "Iteration 0, Testing net (#0)" in lines and "Iteration 4, Testing net (#0)" in lines
    assert any(re.fullmatch(r"Iteration 2 \([\d.e+-]+ iter/s, [\d.e+-]+s/2 iters\), loss = [\d.]+", x)
               for x in lines)
    assert any(re.fullmatch(r"    Train net output #0: loss = [\d.]+ \(\* 1 = [\d.]+ loss\)", x)
               for x in lines)
    assert "Iteration 4, lr = 0.025" in lines
    assert any(re.fullmatch(r"    Test net output #0: accuracy = [\d.]+", x) for x in lines)
    assert f"Snapshotting to binary proto file {folder}/solver_iter_4.caffemodel" in lines
    assert f"Snapshotting solver state to binary proto file {folder}/solver_iter_6.solverstate" in lines
    assert re.fullmatch(r"Iteration 6, loss = [\d.]+", lines[-2])   # final forward-only display
    # the test after the last iteration comes after the final snapshot
    assert lines.index("Iteration 4, Testing net (#0)") > lines.index(
        f"Snapshotting solver state to binary proto file {folder}/solver_iter_4.solverstate")

    resumed = get_solver(str(folder / "solver.prototxt"), xp=numpy)
    resumed.param.max_iter = 8
    resumed.solve(str(folder / "solver_iter_6.solverstate"))
    assert resumed.iter == 8


def test_errors_are_clear(tmp_path):
    with pytest.raises(ModelError, match="exactly one of net, net_param, train_net"):
        Solver(text_format.Parse('base_lr: 0.1 lr_policy: "fixed"', caffe_pb2.SolverParameter()))
    (tmp_path / "s.prototxt").write_text('net: "missing.prototxt" base_lr: 0.1 lr_policy: "fixed"')
    with pytest.raises(ModelError, match="missing.prototxt' does not exist"):
        Solver(str(tmp_path / "s.prototxt"))
    with pytest.raises(ModelError, match="test_interval"):
        make_solver("test_iter: 2")
    with pytest.raises(ModelError, match="snapshot_prefix"):
        make_solver("snapshot: 10")


def test_glog_formatter():
    record = logging.LogRecord("poseidon", logging.INFO, "/x/engine/solvers/solver.py", 123,
                               "Iteration %d, lr = %s", (100, "0.01"), None)
    line = GlogFormatter().format(record)
    assert re.fullmatch(r"I\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ solver\.py:123\] Iteration 100, lr = 0\.01",
                        line)


def test_resume_is_bitwise_with_lmdb_data_and_dropout(tmp_path):
    """The real Data layer (prefetching, random crop and mirror) and Dropout (engine.rng) resume
    exactly: cursors and random states travel in the .cursors.json sidecar."""
    pytest.importorskip("lmdb")
    from poseidon.engine.io.datum import array_to_datum
    from poseidon.engine.io.lmdb_store import write_lmdb
    rs = numpy.random.RandomState(0)
    images = rs.randint(0, 255, size=(20, 3, 6, 6)).astype(numpy.uint8)
    write_lmdb(str(tmp_path / "db"), (array_to_datum(im, int(im.mean() > 127)).SerializeToString()
                                      for im in images))
    net = f"""
name: "lmdb_toy"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ crop_size: 4 mirror: true scale: 0.0039 }}
  data_param {{ source: "{tmp_path}/db" batch_size: 6 backend: LMDB }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param {{ num_output: 6 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param {{ dropout_ratio: 0.3 }} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 2 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
"""
    text = (f'net_param {{ {net} }} type: "Nesterov" base_lr: 0.05 lr_policy: "fixed" momentum: 0.9 '
            f'random_seed: 5 snapshot_prefix: "{tmp_path}/snap" max_iter: 8')

    def build():
        return Solver(text_format.Parse(text, caffe_pb2.SolverParameter()), xp=numpy)

    straight = build()
    straight.step(8)
    first = build()
    first.step(3)
    state_file = first.snapshot()
    for s in (straight, first):
        s.net.shutdown()
    resumed = build()
    resumed.step(1)                    # move the data cursors and the random streams away
    resumed.restore(state_file)
    resumed.step(5)
    resumed.net.shutdown()
    for x, y in zip(params_of(resumed) + history_of(resumed), params_of(straight) + history_of(straight)):
        numpy.testing.assert_array_equal(x, y)
