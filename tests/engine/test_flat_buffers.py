"""Flat parameter buffers (engine/flat_params.py) and the rules over flat ranges (rules.apply,
engine/solvers/flat_update.py, the fused kernels of engine/solvers/fused.py).

The rules are checked against a per-blob reference written here from Caffe's solver formulas
(sgd_solver.cpp and the nesterov/adagrad/rmsprop/adadelta/adam solvers), in float64, over several
iterations of a net whose parameters have different lr_mult and decay_mult.
"""
import ctypes
import math
import shutil
import subprocess

import numpy
import pytest

from poseidon.engine import backend
from poseidon.engine.flat_params import FlatParams, SliceMults
from poseidon.engine.net import Net
from poseidon.engine.proto import caffe_pb2
from poseidon.engine.prototxt import parse_net_text
from poseidon.engine.solvers import fused, get_solver, make_rule
from poseidon.engine.solvers.flat_update import update_layer, update_params

NET = """
name: "flat"
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 4 dim: 5 } shape { dim: 4 dim: 2 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        param { lr_mult: 2 decay_mult: 3 } param { lr_mult: 0.5 decay_mult: 0.25 }
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 4 decay_mult: 0 }
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: -0.2 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip2" bottom: "target" top: "loss" }
"""
RULES = ("SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam")


def make_net():
    return Net(parse_net_text(NET), dtype=numpy.float64, xp=numpy)


def flat_net():
    net = make_net()
    net.flat = FlatParams(net)
    return net


def rule_for(kind, regularization):
    param = caffe_pb2.SolverParameter(type=kind, base_lr=0.05, lr_policy="inv", gamma=0.1,
                                      power=0.75, weight_decay=0.01,
                                      regularization_type=regularization)
    if kind in ("SGD", "Nesterov", "AdaDelta", "Adam"):
        param.momentum = 0.9
    if kind == "Adam":
        param.momentum2 = 0.99
    if kind == "RMSProp":
        param.rms_decay = 0.95
    return make_rule(param)


# ----- layout --------------------------------------------------------------------------------
def test_blobs_are_views_of_the_flat_buffers():
    net = flat_net()
    flat = net.flat
    history = flat.attach_history(2)
    for pid, blob in enumerate(net.learnable_params):
        a, b = flat.param_range(pid)
        blob.data[...] = pid + 1.5
        blob.diff[...] = -pid
        history[pid][1][...] = 10 * pid
        assert (flat.data[a:b] == pid + 1.5).all()
        assert (flat.diff[a:b] == -pid).all()
        assert (flat.history[1][a:b] == 10 * pid).all()
    flat.data[...] = 7.0
    assert all((blob.data == 7.0).all() for blob in net.learnable_params)


def test_layers_are_contiguous_ranges_in_backward_order():
    net = flat_net()
    flat = net.flat
    ip1, ip2 = net.layer_names.index("ip1"), net.layer_names.index("ip2")
    # the last layer's parameters first, each layer's blobs in their own order, no gaps
    assert flat.layer_range(ip2) == (0, 2 * 3 + 2)
    assert flat.layer_range(ip1) == (8, 8 + 3 * 5 + 3)
    assert flat.size == 26
    w2, b2 = net.layers[ip2].blobs
    assert numpy.shares_memory(w2.data, flat.data[0:6]) and w2.data.shape == (2, 3)
    assert numpy.shares_memory(b2.diff, flat.diff[6:8])
    assert flat.mults(0, 26).offsets == (0, 6, 8, 23, 26)
    assert flat.mults(0, 26).lr_mult == (1.0, 4.0, 2.0, 0.5)
    assert flat.layer_range(net.layer_names.index("relu")) == (0, 0)


def test_initial_values_are_kept_and_clearing_is_one_fill():
    before = make_net()
    net = make_net()
    for b0, b1 in zip(before.learnable_params, net.learnable_params):
        b1.data[...] = b0.data
    net.flat = FlatParams(net)
    for b0, b1 in zip(before.learnable_params, net.learnable_params):
        numpy.testing.assert_array_equal(b0.data, b1.data)
    net.flat.diff[...] = 3.0
    net.ClearParamDiffs()
    assert not net.flat.diff.any()
    net.flat.diff[...] = 3.0
    net.clear_diffs([net.learnable_params[0]])       # ip1's weight only
    a, b = net.flat.param_range(0)
    assert not net.flat.diff[a:b].any() and (net.flat.diff[:a] == 3.0).all()


def test_a_reshaped_parameter_lays_the_buffers_out_again():
    net = flat_net()
    flat = net.flat
    history = flat.attach_history(1)
    other = net.learnable_params[2]                 # ip2's weight keeps its values and history
    other.data[...] = 4.0
    history[2][0][...] = 5.0
    net.learnable_params[0].reshape(3, 6)           # ip1's weight grows
    assert flat.size == 29
    for pid, blob in enumerate(net.learnable_params):
        a, b = flat.param_range(pid)
        assert numpy.shares_memory(blob.data, flat.data[a:b]) and blob.count == b - a
        assert numpy.shares_memory(history[pid][0], flat.history[0][a:b])
    assert (other.data == 4.0).all() and (history[2][0] == 5.0).all()
    assert net.learnable_params[0].data.shape == (3, 6)


SHARED = """
name: "shared"
layer { name: "data" type: "Input" top: "a" top: "b"
        input_param { shape { dim: 4 dim: 6 } shape { dim: 4 dim: 4 } } }
layer { name: "ip_a" type: "InnerProduct" bottom: "a" top: "ya"
        param { name: "w" share_mode: PERMISSIVE }
        inner_product_param { num_output: 2 bias_term: false } }
layer { name: "ip_b" type: "InnerProduct" bottom: "b" top: "yb"
        param { name: "w" share_mode: PERMISSIVE }
        inner_product_param { num_output: 3 } }
"""


def test_a_weight_shared_with_another_shape_follows_the_layout():
    net = Net(parse_net_text(SHARED), dtype=numpy.float64, xp=numpy)
    net.flat = FlatParams(net)
    view = net.layer_dict["ip_b"].blobs[0]
    assert view.shape == (3, 4) and view is not net.learnable_params[0]
    for step in ("laid out", "re-laid out"):
        a, b = net.flat.param_range(0)
        net.flat.data[a:b] = numpy.arange(12.0)
        numpy.testing.assert_array_equal(view.data.reshape(-1), numpy.arange(12.0), err_msg=step)
        net.learnable_params[1].reshape(5)          # ip_b's bias grows: a re-layout


def test_a_placed_parameter_leaves_the_layout_and_is_still_updated():
    net = flat_net()
    flat = net.flat
    flat.attach_history(1)
    rule = rule_for("SGD", "L2")
    blob = net.learnable_params[1]
    data, diff = numpy.full(blob.count, 2.0), numpy.full(blob.count, 1.0)
    blob.place(data, diff)
    assert not flat.in_layout(1) and flat.in_layout(0)
    update_params(rule, flat, range(4), 0)
    assert (data != 2.0).all()                      # updated where it now lives
    net.ClearParamDiffs()
    assert not diff.any()
    kept = flat.param_history[1][0].copy()
    net.learnable_params[2].reshape(3, 3)           # a re-layout leaves it where it was placed
    assert blob.data.base is data or numpy.shares_memory(blob.data, data)
    a, b = flat.param_range(1)
    assert numpy.shares_memory(flat.param_history[1][0], flat.history[0][a:b])
    numpy.testing.assert_array_equal(flat.param_history[1][0], kept)


PY_LAYER = """
from poseidon import engine


class KeptScale(engine.Layer):
    \"\"\"y = s * x, with s's array kept at set-up, as user code may.\"\"\"

    def setup(self, bottom, top):
        self.blobs.add_blob(1)
        self.kept = self.blobs[0].data
        self.kept[...] = 2.0

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data * self.kept[0]

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[...] += (top[0].diff * bottom[0].data).sum()
        bottom[0].diff[...] = top[0].diff * self.kept[0]
"""


def test_a_python_layers_parameters_keep_their_own_arrays(tmp_path, monkeypatch):
    (tmp_path / "flat_test_pylayer.py").write_text(PY_LAYER)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = NET.replace('layer { name: "relu"', 'layer { name: "scale" type: "Python" '
                       'bottom: "ip1" top: "scaled" python_param { module: "flat_test_pylayer" '
                       'layer: "KeptScale" } }\nlayer { name: "relu"').replace(
        'bottom: "ip1" top: "ip1" }', 'bottom: "scaled" top: "scaled" }').replace(
        'bottom: "ip1" top: "ip2"', 'bottom: "scaled" top: "ip2"')
    param = caffe_pb2.SolverParameter(base_lr=0.1, lr_policy="fixed", max_iter=2, display=0,
                                      snapshot_after_train=False, random_seed=1)
    param.net_param.CopyFrom(parse_net_text(text))
    solver = get_solver(param, dtype=numpy.float64)
    solver.net.params["ip1"][0].data[...] = 0.1     # every ReLU open: the scale gets a gradient
    layer = solver.net.layer_dict["scale"]
    pid = next(p for p, b in enumerate(solver.net.learnable_params) if b is layer.blobs[0])
    assert not solver.net.flat.has_range(pid) and layer.kept is layer.blobs[0].data
    solver.net.blobs["data"].data[...] = 1.0
    solver.step(2)
    assert layer.kept[0] != 2.0                     # updated where user code reads it
    layer.blobs[0].diff[...] = 1.0
    solver.net.ClearParamDiffs()
    assert layer.blobs[0].diff[0] == 0
    assert solver.net.flat.size == 26               # the others are still laid out flat


# ----- the rules over flat ranges ------------------------------------------------------------
def reference_step(kind, p, w, g, state, t, lr, decay):
    """Caffe's update of one parameter (float64, new arrays): returns (w, state)."""
    g = g + decay * (w if p.regularization_type == "L2" else numpy.sign(w))
    m, delta = p.momentum, p.delta
    if kind in ("SGD", "Nesterov"):
        h = m * state[0] + lr * g
        step = h if kind == "SGD" else (1 + m) * h - m * state[0]
        return w - step, [h]
    if kind in ("AdaGrad", "RMSProp"):
        d = 1.0 if kind == "AdaGrad" else p.rms_decay
        h = d * state[0] + (1.0 if kind == "AdaGrad" else 1 - d) * g * g
        return w - lr * g / (numpy.sqrt(h) + delta), [h]
    if kind == "AdaDelta":
        grads = m * state[0] + (1 - m) * g * g
        u = g * numpy.sqrt((state[1] + delta) / (grads + delta))
        return w - lr * u, [grads, m * state[1] + (1 - m) * u * u]
    b2 = p.momentum2
    first = m * state[0] + (1 - m) * g
    second = b2 * state[1] + (1 - b2) * g * g
    fix = math.sqrt(1 - b2 ** (t + 1)) / (1 - m ** (t + 1))
    return w - lr * fix * first / (numpy.sqrt(second) + delta), [first, second]


def reference_rate(p, it):
    return p.base_lr * (1 + p.gamma * it) ** (-p.power)


@pytest.mark.parametrize("regularization", ["L2", "L1"])
@pytest.mark.parametrize("kind", RULES)
def test_each_rule_over_the_flat_buffer_equals_the_per_blob_reference(kind, regularization):
    net = flat_net()
    flat = net.flat
    rule = rule_for(kind, regularization)
    p = rule.param
    flat.attach_history(rule.num_state)
    specs = net.learnable_param_specs
    ref_w = [b.data.copy() for b in net.learnable_params]
    ref_h = [[numpy.zeros_like(w) for _ in range(rule.num_state)] for w in ref_w]
    gen = numpy.random.default_rng(5)
    for it in range(4):
        grads = [gen.standard_normal(b.shape) for b in net.learnable_params]
        for blob, g in zip(net.learnable_params, grads):
            blob.diff[...] = g
        update_params(rule, flat, range(len(grads)), it, grad_scale=0.5)
        rate = reference_rate(p, it)
        for pid, g in enumerate(grads):
            ref_w[pid], ref_h[pid] = reference_step(kind, p, ref_w[pid], 0.5 * g, ref_h[pid], it,
                                                    rate * specs[pid].lr_mult,
                                                    p.weight_decay * specs[pid].decay_mult)
    for pid, blob in enumerate(net.learnable_params):
        numpy.testing.assert_allclose(blob.data, ref_w[pid], rtol=1e-12, atol=1e-14)
        for mine, ref in zip(flat.param_history[pid], ref_h[pid]):
            numpy.testing.assert_allclose(mine, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", RULES)
def test_a_layer_range_is_bitwise_the_per_blob_update(kind):
    """update_layer (what a worker calls with a layer's summed gradient) equals rule.update on
    each blob of the layer (what a KV server applies to its pairs)."""
    rule = rule_for(kind, "L2")
    net = flat_net()
    flat = net.flat
    flat.attach_history(rule.num_state)
    li = net.layer_names.index("ip1")
    start, stop = flat.layer_range(li)
    gen = numpy.random.default_rng(9)
    pids = [pid for pid, s in enumerate(net.learnable_param_specs) if s.layer_index == li]
    apart = {pid: (net.learnable_params[pid].data.copy(),
                   [h.copy() for h in flat.param_history[pid]]) for pid in pids}
    for it in range(3):
        summed = gen.standard_normal(stop - start).astype(numpy.float32).astype(numpy.float64)
        update_layer(rule, flat, li, it, grad=summed.copy(), grad_scale=0.25)
        for pid in pids:
            a, b = flat.param_range(pid)
            w, h = apart[pid]
            spec = net.learnable_param_specs[pid]
            rule.update(w, summed[a - start:b - start].reshape(w.shape).copy(), h, it,
                        spec.lr_mult, spec.decay_mult, 0.25)
    for pid in pids:
        numpy.testing.assert_array_equal(net.learnable_params[pid].data, apart[pid][0])
        for mine, ref in zip(flat.param_history[pid], apart[pid][1]):
            numpy.testing.assert_array_equal(mine, ref)


def test_update_layer_refuses_a_gradient_of_another_size():
    net = flat_net()
    net.flat.attach_history(1)
    with pytest.raises(ValueError, match="gradient has 3 elements"):
        update_layer(rule_for("SGD", "L2"), net.flat, 1, 0, grad=numpy.zeros(3))


def test_slice_mults_runs_merge_equal_neighbours():
    mults = SliceMults((0, 4, 6, 10, 10, 12), (1, 1, 2, 2, 2), (0, 0, 1, 1, 1))
    assert mults.runs() == [(0, 6, 1.0, 0.0), (6, 12, 2.0, 1.0)]
    with pytest.raises(ValueError):
        SliceMults((0, 4), (1, 2), (0, 0))


def test_slice_mults_runs_split_where_only_decay_mult_changes():
    """Neighbours with the same lr_mult but another decay_mult (a bias with decay_mult 0 after
    its weight) stay apart; neighbours equal in both merge."""
    mults = SliceMults((0, 6, 8, 20, 23), (1, 1, 1, 1), (1, 0, 1, 0))
    assert mults.runs() == [(0, 6, 1.0, 1.0), (6, 8, 1.0, 0.0), (8, 20, 1.0, 1.0),
                            (20, 23, 1.0, 0.0)]
    mults = SliceMults((0, 3, 5, 9), (2, 2, 2), (0, 0, 0.5))
    assert mults.runs() == [(0, 5, 2.0, 0.0), (5, 9, 2.0, 0.5)]


# two convolutions (no weight made from sufficient factors: every update goes through the flat
# buffers); each bias has its weight's lr_mult and decay_mult 0
BIAS_NET = """
name: "bias_decay"
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 2 dim: 2 dim: 4 dim: 4 }
                      shape { dim: 2 dim: 3 dim: 2 dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 1 decay_mult: 0 }
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.5 }
                            bias_filler { type: "constant" value: 0.3 } } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 1 decay_mult: 0 }
        convolution_param { num_output: 3 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 }
                            bias_filler { type: "constant" value: -0.4 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "conv2" bottom: "target" top: "loss" }
"""


def test_the_solver_leaves_a_bias_with_decay_mult_0_undecayed():
    """SGD with momentum and weight decay over the flat buffers, against the formulas applied
    blob by blob with each blob's own decay_mult: the biases (decay_mult 0, the same lr_mult as
    their weights) take no decay, although their neighbours in the buffer do."""
    base_lr, momentum, weight_decay, steps = 0.0625, 0.875, 0.25, 3
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=base_lr, lr_policy="fixed",
                                      momentum=momentum, weight_decay=weight_decay,
                                      max_iter=steps, display=0, snapshot_after_train=False)
    param.net_param.CopyFrom(parse_net_text(BIAS_NET))
    solver = get_solver(param, dtype=numpy.float64)
    net, flat = solver.net, solver.net.flat
    assert not solver.factored.active(solver.param)
    specs = net.learnable_param_specs
    assert [(s.lr_mult, s.decay_mult) for s in specs] == [(1.0, 1.0), (1.0, 0.0)] * 2
    assert flat.runs(range(len(specs)))[0] == [(0, flat.size)]   # one range of four slices
    rs = numpy.random.RandomState(7)
    net.blobs["data"].data[...] = rs.standard_normal(net.blobs["data"].shape)
    net.blobs["target"].data[...] = rs.standard_normal(net.blobs["target"].shape)
    values = [b.data.copy() for b in net.learnable_params]
    velocity = [numpy.zeros_like(v) for v in values]
    for _ in range(steps):
        net.ClearParamDiffs()
        net.ForwardBackward()                  # this step's gradient, at the current values
        for pid, blob in enumerate(net.learnable_params):
            g = blob.diff + weight_decay * specs[pid].decay_mult * values[pid]
            velocity[pid] = momentum * velocity[pid] + base_lr * specs[pid].lr_mult * g
            values[pid] = values[pid] - velocity[pid]
        solver.step(1)
        for pid, blob in enumerate(net.learnable_params):
            numpy.testing.assert_allclose(blob.data, values[pid], rtol=1e-12, atol=1e-14,
                                          err_msg=f"{specs[pid].name} after {solver.iter} steps")
    assert len(flat.mults(0, flat.size).runs()) == 4


def test_the_solver_keeps_history_as_views_of_the_flat_buffers():
    param = caffe_pb2.SolverParameter(type="Adam", base_lr=0.01, lr_policy="fixed", momentum=0.9,
                                      max_iter=2, display=0, snapshot_after_train=False)
    param.net_param.CopyFrom(parse_net_text(NET))
    solver = get_solver(param, dtype=numpy.float64)
    flat = solver.net.flat
    solver.net.blobs["data"].data[...] = 1.0
    solver.step(2)
    for pid, state in enumerate(solver.history):
        a, b = flat.param_range(pid)
        for k, h in enumerate(state):
            assert numpy.shares_memory(h, flat.history[k][a:b])
    assert any(numpy.abs(h).max() > 0 for h in flat.history)


# ----- the fused kernels ----------------------------------------------------------------------
def test_the_kernel_sources_compile_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    source = tmp_path / "rules.cu"
    source.write_text("".join(fused.ptx_source(kind, reg, ctype) for kind in fused.rule_names()
                              for reg in ("L2", "L1") for ctype in ("float", "double")))
    done = subprocess.run([nvcc, "--ptx", "-o", str(tmp_path / "rules.ptx"), str(source)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ptx = (tmp_path / "rules.ptx").read_text()
    assert all(f"update_{kind.lower()}_l1_double" in ptx for kind in RULES)


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """The kernel bodies built for the CPU with a C++ compiler (ptx_source(host=True))."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    folder = tmp_path_factory.mktemp("host_kernels")
    source = folder / "rules.cpp"
    source.write_text("#include <cmath>\n" + "".join(
        fused.ptx_source(kind, reg, "double", host=True) for kind in fused.rule_names()
        for reg in ("L2", "L1")))
    done = subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(folder / "rules.so"),
                           str(source)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(folder / "rules.so"))


@pytest.mark.parametrize("regularization", ["L2", "L1"])
@pytest.mark.parametrize("kind", RULES)
def test_the_kernel_body_computes_what_the_numpy_rule_does(host_kernels, kind, regularization):
    """The fused kernel's arithmetic, run on the CPU, against rules.apply's numpy path: several
    slices with their own multipliers, several iterations (the GPU test below runs the kernel
    itself where there is a device)."""
    rule = rule_for(kind, regularization)
    mults = SliceMults((0, 7, 9, 40, 41), (1.0, 2.0, 0.5, 3.0), (1.0, 0.0, 3.0, 0.5))
    gen = numpy.random.default_rng(4)
    w = gen.standard_normal(41)
    state = [numpy.zeros(41) for _ in range(rule.num_state)]
    kw, kstate = w.copy(), [s.copy() for s in state]
    function = getattr(host_kernels, f"update_{kind}_{regularization}_double".lower())
    pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)   # noqa: E731
    off = numpy.array(mults.offsets, numpy.int64)
    lr_mult, decay_mult = numpy.array(mults.lr_mult), numpy.array(mults.decay_mult)
    for it in range(3):
        g = gen.standard_normal(41)
        rule.apply(w, g.copy(), state, it, mults, grad_scale=0.5)
        names = fused.kernel_parts(kind, regularization)[3]
        constants = rule.constants(it, numpy.float64)
        scalars = [numpy.array([v]) for v in [rule.rate(it), 0.5, rule.weight_decay]
                   + [constants[n] for n in names]]
        function(pointer(g), pointer(off), pointer(lr_mult), pointer(decay_mult),
                 ctypes.c_int(4), *map(pointer, scalars), pointer(kw), *map(pointer, kstate),
                 ctypes.c_longlong(41))
    numpy.testing.assert_allclose(kw, w, rtol=1e-12, atol=1e-14)
    for mine, ref in zip(kstate, state):
        numpy.testing.assert_allclose(mine, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", RULES)
def test_the_fused_kernel_matches_numpy_on_a_gpu(kind):
    if not backend.gpu_available():
        pytest.skip("no CuPy or no CUDA device")
    cupy = backend.cupy
    rule = rule_for(kind, "L1")
    gen = numpy.random.default_rng(2)
    mults = SliceMults((0, 100, 130, 1000), (1.0, 2.0, 0.5), (1.0, 0.0, 3.0))
    w = gen.standard_normal(1000)
    state = [numpy.zeros(1000) for _ in range(rule.num_state)]
    dw, dstate = cupy.asarray(w), [cupy.asarray(s) for s in state]
    for it in range(3):
        g = gen.standard_normal(1000)
        rule.apply(w, g.copy(), state, it, mults, grad_scale=0.5)
        rule.apply(dw, cupy.asarray(g), dstate, it, mults, grad_scale=0.5)
    numpy.testing.assert_allclose(cupy.asnumpy(dw), w, rtol=1e-10, atol=1e-12)
