"""Update rules and learning-rate policies against plain references written from Caffe's formulas
(sgd_solver.cpp, nesterov/adagrad/rmsprop/adadelta/adam_solver.cpp; see caffe-facts.md (d))."""
import math
import pickle

import numpy
import pytest
from google.protobuf import text_format

from poseidon.engine.errors import ModelError
from poseidon.engine.proto import caffe_pb2
from poseidon.engine.solvers import lr_policy
from poseidon.engine.solvers.rules import clip_factor, clip_scale, global_norm_sq, make_rule


def solver_param(text):
    return text_format.Parse(text, caffe_pb2.SolverParameter())


# ----- plain references (float64, one formula per line, new arrays every time) ---------------------
def ref_rate(p, it):
    lr, policy = p["base_lr"], p["lr_policy"]
    if policy == "fixed":
        return lr
    if policy == "step":
        return lr * p["gamma"] ** (it // p["stepsize"])
    if policy == "exp":
        return lr * p["gamma"] ** it
    if policy == "inv":
        return lr * (1 + p["gamma"] * it) ** (-p["power"])
    if policy == "multistep":
        # Caffe: current_step advances by one per call while it >= stepvalue[current_step]
        step = 0
        for i in range(it + 1):
            if step < len(p["stepvalue"]) and i >= p["stepvalue"][step]:
                step += 1
        return lr * p["gamma"] ** step
    if policy == "poly":
        return lr * (1 - it / p["max_iter"]) ** p["power"]
    if policy == "sigmoid":
        return lr * (1 / (1 + math.exp(-p["gamma"] * (it - p["stepsize"]))))
    raise AssertionError(policy)


def ref_update(kind, p, w, g, hist, it, lr_mult, decay_mult, grad_scale):
    """Returns new (w, hist) for one Caffe iteration on float64 copies."""
    g = g * grad_scale
    decay = p.get("weight_decay", 0.0) * decay_mult
    if p.get("regularization_type", "L2") == "L2":
        g = g + decay * w
    else:
        g = g + decay * numpy.sign(w)
    lr = ref_rate(p, it) * lr_mult
    m = p.get("momentum", 0.0)
    delta = p.get("delta", 1e-8)
    if kind == "SGD":
        h = m * hist[0] + lr * g
        return w - h, [h]
    if kind == "Nesterov":
        h_old = hist[0]
        h = m * h_old + lr * g
        return w - ((1 + m) * h - m * h_old), [h]
    if kind == "AdaGrad":
        h = hist[0] + g * g
        return w - lr * g / (numpy.sqrt(h) + delta), [h]
    if kind == "RMSProp":
        d = p.get("rms_decay", 0.99)
        h = d * hist[0] + (1 - d) * g * g
        return w - lr * g / (numpy.sqrt(h) + delta), [h]
    if kind == "AdaDelta":
        hg = m * hist[0] + (1 - m) * g * g
        u = g * numpy.sqrt((hist[1] + delta) / (hg + delta))
        hu = m * hist[1] + (1 - m) * u * u
        return w - lr * u, [hg, hu]
    if kind == "Adam":
        b1, b2 = m, p.get("momentum2", 0.999)
        mm = b1 * hist[0] + (1 - b1) * g
        v = b2 * hist[1] + (1 - b2) * g * g
        t = it + 1
        return w - lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * mm / (numpy.sqrt(v) + delta), [mm, v]
    raise AssertionError(kind)


def to_text(p, kind):
    lines = [f'type: "{kind}"']
    for k, v in p.items():
        if isinstance(v, list):
            lines += [f"{k}: {x}" for x in v]
        elif isinstance(v, str):
            lines.append(f'{k}: "{v}"')
        else:
            lines.append(f"{k}: {v!r}")
    return "\n".join(lines)


def f32(x):
    """The value a proto float field holds."""
    return float(numpy.float32(x))


CASES = {
    "SGD": dict(base_lr=0.1, lr_policy="step", gamma=0.5, stepsize=2, momentum=0.9),
    "Nesterov": dict(base_lr=0.05, lr_policy="inv", gamma=0.1, power=0.75, momentum=0.95),
    "AdaGrad": dict(base_lr=0.2, lr_policy="fixed", delta=1e-6),
    "RMSProp": dict(base_lr=0.01, lr_policy="exp", gamma=0.9, rms_decay=0.95, delta=1e-6),
    "AdaDelta": dict(base_lr=1.0, lr_policy="fixed", momentum=0.9, delta=1e-6),
    "Adam": dict(base_lr=0.01, lr_policy="multistep", gamma=0.3, stepvalue=[2, 4], momentum=0.9,
                 momentum2=0.999, delta=1e-8),
}

VARIANTS = [
    # (weight_decay, regularization, lr_mult, decay_mult, grad_scale)
    (0.0, "L2", 1.0, 1.0, 1.0),
    (0.01, "L2", 1.0, 1.0, 1.0),
    (0.02, "L1", 2.0, 0.5, 1.0),
    (0.005, "L2", 0.5, 2.0, 0.25),
]


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_rule_matches_reference(kind, variant):
    decay, reg, lr_mult, decay_mult, grad_scale = VARIANTS[variant]
    p = dict(CASES[kind], weight_decay=decay, regularization_type=reg)
    rule = make_rule(solver_param(to_text(p, kind)))
    assert rule.type == kind
    assert rule.num_state == (2 if kind in ("AdaDelta", "Adam") else 1)
    pf = {k: ([f32(x) for x in v] if isinstance(v, list) and k != "stepvalue" else
              f32(v) if isinstance(v, float) else v) for k, v in p.items()}
    rs = numpy.random.RandomState(variant)
    shape = (3, 4)
    w = rs.standard_normal(shape)
    state = rule.init_state(shape, numpy, numpy.float64)
    assert len(state) == rule.num_state and all((s == 0).all() for s in state)
    ref_w, ref_h = w.copy(), [numpy.zeros(shape) for _ in range(rule.num_state)]
    for it in range(6):
        g = rs.standard_normal(shape)
        assert rule.rate(it) == pytest.approx(ref_rate(pf, it), rel=1e-12)
        rule.update(w, g.copy(), state, it, lr_mult, decay_mult, grad_scale)
        ref_w, ref_h = ref_update(kind, pf, ref_w, g, ref_h, it, lr_mult, decay_mult, grad_scale)
        numpy.testing.assert_allclose(w, ref_w, rtol=1e-12, atol=1e-14)
        for s, r in zip(state, ref_h):
            numpy.testing.assert_allclose(s, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_rule_float32_in_place_and_sliceable(kind):
    """Works in the value's dtype, in place, and a slice updated alone equals the slice of the whole
    (what a KV-store server holding part of a parameter relies on)."""
    p = dict(CASES[kind], weight_decay=0.01)
    rule = make_rule(solver_param(to_text(p, kind)))
    rs = numpy.random.RandomState(1)
    w = rs.standard_normal((6, 5)).astype(numpy.float32)
    parts = [w[:2].copy(), w[2:].copy()]
    state = rule.init_state(w.shape, numpy, numpy.float32)
    part_states = [rule.init_state(x.shape, numpy, numpy.float32) for x in parts]
    data_ptr = w.__array_interface__["data"][0]
    for it in range(4):
        g = rs.standard_normal(w.shape).astype(numpy.float32)
        pieces = [g[:2].copy(), g[2:].copy()]
        rule.update(w, g, state, it, 1.0, 1.0, 0.5)
        for x, gx, sx in zip(parts, pieces, part_states):
            rule.update(x, gx, sx, it, 1.0, 1.0, 0.5)
        assert w.dtype == numpy.float32 and all(s.dtype == numpy.float32 for s in state)
        assert w.__array_interface__["data"][0] == data_ptr
        numpy.testing.assert_array_equal(numpy.concatenate(parts), w)


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("threads", [1, 2])
def test_large_update_with_a_padded_gradient_equals_the_contiguous_one(kind, threads, monkeypatch):
    """A parameter of BLOCKED_MIN elements or more is updated in blocks; a gradient whose rows are
    padded apart (engine/solvers/factored.py's scratch) is cut into blocks of rows instead of flat
    ones. Both give the parameters and state of the whole-array update, bitwise."""
    from poseidon.engine import parallel
    from poseidon.engine.solvers import rules
    monkeypatch.setattr(rules, "BLOCKED_MIN", 64)
    monkeypatch.setattr(rules, "BLOCK", 24)                 # 3 rows of 8 a block
    monkeypatch.setattr(parallel.parallel(), "workers", threads)
    rule = make_rule(solver_param(to_text(dict(CASES[kind], weight_decay=0.01), kind)))
    rs = numpy.random.RandomState(2)
    w = rs.standard_normal((20, 8))
    runs = {how: (w.copy(), rule.init_state(w.shape, numpy, numpy.float64))
            for how in ("whole", "flat blocks", "row blocks")}
    for it in range(3):
        g = rs.standard_normal(w.shape)
        padded = numpy.empty((20, 9))[:, :8]
        padded[...] = g
        assert not padded.flags.c_contiguous
        rule._update(runs["whole"][0], g.copy(), runs["whole"][1], it, 1.0, 1.0, 0.5,
                     rule.rate(it))
        rule.update(runs["flat blocks"][0], g.copy(), runs["flat blocks"][1], it, 1.0, 1.0, 0.5)
        rule.update(runs["row blocks"][0], padded, runs["row blocks"][1], it, 1.0, 1.0, 0.5)
    for how in ("flat blocks", "row blocks"):
        numpy.testing.assert_array_equal(runs[how][0], runs["whole"][0])
        for a, b in zip(runs[how][1], runs["whole"][1]):
            numpy.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("blocked", [False, True])
def test_a_kept_gradient_is_left_alone_and_changes_nothing_else(kind, variant, blocked,
                                                               monkeypatch):
    """keep_grad (a KV server updating from a worker's diff in shared memory,
    dist/transport/onehost/kvshm.py): the gradient is not written, and value and state are bitwise
    those of the usual update, with and without weight decay or a gradient scale, whole or in
    blocks."""
    from poseidon.engine.solvers import rules
    if blocked:
        monkeypatch.setattr(rules, "BLOCKED_MIN", 64)
        monkeypatch.setattr(rules, "BLOCK", 24)
    decay, reg, lr_mult, decay_mult, grad_scale = VARIANTS[variant]
    rule = make_rule(solver_param(to_text(dict(CASES[kind], weight_decay=decay,
                                                regularization_type=reg), kind)))
    rs = numpy.random.RandomState(variant)
    w = rs.standard_normal(100).astype(numpy.float32)
    usual = (w.copy(), rule.init_state(w.shape, numpy, numpy.float32))
    kept = (w.copy(), rule.init_state(w.shape, numpy, numpy.float32))
    for it in range(3):
        g = rs.standard_normal(100).astype(numpy.float32)
        live = g.copy()
        rule.update(usual[0], g.copy(), usual[1], it, lr_mult, decay_mult, grad_scale)
        rule.update(kept[0], live, kept[1], it, lr_mult, decay_mult, grad_scale, keep_grad=True)
        numpy.testing.assert_array_equal(live, g)
        numpy.testing.assert_array_equal(kept[0], usual[0])
        for a, b in zip(kept[1], usual[1]):
            numpy.testing.assert_array_equal(a, b)


def test_lr_mult_zero_freezes():
    rule = make_rule(solver_param('base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.1'))
    w = numpy.ones(4)
    state = rule.init_state(w.shape, numpy, w.dtype)
    rule.update(w, numpy.full(4, 3.0), state, 0, lr_mult=0.0)
    assert (w == 1).all()


def test_legacy_solver_type_and_errors():
    rule = make_rule(solver_param('solver_type: NESTEROV base_lr: 0.1 lr_policy: "fixed"'))
    assert rule.type == "Nesterov"
    assert make_rule(solver_param('solver_type: ADAM base_lr: 0.1 lr_policy: "fixed"')).num_state == 2
    with pytest.raises(ModelError, match="cannot both"):
        make_rule(solver_param('solver_type: ADAM type: "Adam" base_lr: 0.1 lr_policy: "fixed"'))
    with pytest.raises(ModelError, match="unknown solver type 'sgd'.*SGD"):
        make_rule(solver_param('type: "sgd" base_lr: 0.1 lr_policy: "fixed"'))
    with pytest.raises(ModelError, match="momentum cannot be used with AdaGrad"):
        make_rule(solver_param('type: "AdaGrad" momentum: 0.9 base_lr: 0.1 lr_policy: "fixed"'))
    with pytest.raises(ModelError, match="rms_decay"):
        make_rule(solver_param('type: "RMSProp" rms_decay: 1.5 base_lr: 0.1 lr_policy: "fixed"'))
    with pytest.raises(ModelError, match="regularization_type 'L3'"):
        make_rule(solver_param('base_lr: 0.1 lr_policy: "fixed" weight_decay: 0.1 '
                               'regularization_type: "L3"'))


def test_rule_pickles():
    rule = make_rule(solver_param('type: "Adam" base_lr: 0.1 lr_policy: "step" gamma: 0.1 '
                                  'stepsize: 10 momentum: 0.9 net_param { name: "big" }'))
    copy = pickle.loads(pickle.dumps(rule))
    assert copy.type == "Adam" and copy.rate(25) == rule.rate(25)
    assert not copy.param.HasField("net_param")


# ----- learning-rate policies -----------------------------------------------------------------------
POLICY_CASES = [
    ('lr_policy: "fixed" base_lr: 0.01', dict(lr_policy="fixed", base_lr=0.01)),
    ('lr_policy: "step" base_lr: 0.01 gamma: 0.1 stepsize: 100',
     dict(lr_policy="step", base_lr=0.01, gamma=0.1, stepsize=100)),
    ('lr_policy: "exp" base_lr: 0.01 gamma: 0.999', dict(lr_policy="exp", base_lr=0.01, gamma=0.999)),
    ('lr_policy: "inv" base_lr: 0.01 gamma: 0.0001 power: 0.75',
     dict(lr_policy="inv", base_lr=0.01, gamma=0.0001, power=0.75)),
    ('lr_policy: "multistep" base_lr: 0.01 gamma: 0.5 stepvalue: 50 stepvalue: 120 stepvalue: 121',
     dict(lr_policy="multistep", base_lr=0.01, gamma=0.5, stepvalue=[50, 120, 121])),
    ('lr_policy: "poly" base_lr: 0.01 power: 0.5 max_iter: 1000',
     dict(lr_policy="poly", base_lr=0.01, power=0.5, max_iter=1000)),
    ('lr_policy: "sigmoid" base_lr: 0.01 gamma: -0.05 stepsize: 200',
     dict(lr_policy="sigmoid", base_lr=0.01, gamma=-0.05, stepsize=200)),
]


@pytest.mark.parametrize("text,ref", POLICY_CASES, ids=[r["lr_policy"] for _, r in POLICY_CASES])
def test_lr_policy(text, ref):
    p = solver_param(text)
    ref = {k: (f32(v) if isinstance(v, float) else v) for k, v in ref.items()}
    for it in (0, 1, 49, 50, 99, 100, 119, 120, 121, 122, 250, 999):
        assert lr_policy.learning_rate(p, it) == pytest.approx(ref_rate(ref, it), rel=1e-12, abs=0)


def test_current_step():
    p = solver_param('lr_policy: "multistep" base_lr: 1 gamma: 0.1 stepvalue: 10 stepvalue: 20')
    assert [lr_policy.current_step(p, i) for i in (0, 9, 10, 19, 20, 99)] == [0, 0, 1, 1, 2, 2]
    p = solver_param('lr_policy: "step" base_lr: 1 gamma: 0.1 stepsize: 7')
    assert lr_policy.current_step(p, 20) == 2


@pytest.mark.parametrize("text,match", [
    ('lr_policy: "cosine" base_lr: 0.1', "unknown learning rate policy 'cosine'"),
    ('base_lr: 0.1', "lr_policy is unset"),
    ('lr_policy: "step" base_lr: 0.1 gamma: 0.1', "needs stepsize"),
    ('lr_policy: "step" base_lr: 0.1 gamma: 0.1 stepsize: 0', "stepsize > 0"),
    ('lr_policy: "inv" base_lr: 0.1 gamma: 0.1', "needs power"),
    ('lr_policy: "multistep" base_lr: 0.1 gamma: 0.1', "needs stepvalue"),
    ('lr_policy: "poly" base_lr: 0.1 power: 1', "needs max_iter"),
])
def test_lr_policy_errors(text, match):
    with pytest.raises(ModelError, match=match):
        lr_policy.learning_rate(solver_param(text), 0)
    with pytest.raises(ModelError, match=match):
        make_rule(solver_param(text))


# ----- clipping ---------------------------------------------------------------------------------------
def test_clip_scale_over_all_grads():
    grads = [numpy.array([3.0, 0.0]), numpy.array([[0.0, 4.0]], dtype=numpy.float32)]
    assert global_norm_sq(grads) == pytest.approx(25.0)
    assert clip_scale(solver_param("clip_gradients: 2.5"), grads) == pytest.approx(0.5)
    assert clip_scale(solver_param("clip_gradients: 10"), grads) == 1.0
    assert clip_scale(solver_param(""), grads) == 1.0          # default -1: off
    assert clip_scale(solver_param("clip_gradients: 1"), grads, norm_sq=100.0) == pytest.approx(0.1)
    assert clip_factor(-1, 1e6) == 1.0
    assert global_norm_sq([]) == 0.0
