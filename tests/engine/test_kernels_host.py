"""The kernels' index arithmetic, checked on the CPU: each layer's kernel branch runs the CUDA
sources built for the host (tests/engine/kernel_host.py) and must give what the layer's numpy branch
gives, on odd shapes, padding, strides larger than the kernel, ties and ignored labels; the
launches each step makes are checked too (docs/performance.md's table)."""
import numpy
import pytest

from poseidon.engine import kernels, rng
from poseidon.engine.kernels import counter_rng
from poseidon.engine.layer import TEST
from tests.engine import kernel_host
from tests.engine.kernel_host import assert_branches_agree, run_layer

pytestmark = pytest.mark.skipif(kernel_host.compiler() is None,
                                reason="no C++ compiler to build the kernels for the host")
RS = numpy.random.RandomState(3)


# ----- pooling ------------------------------------------------------------------------------------
POOLS = [
    ((2, 3, 7, 9), "kernel_size: 3 stride: 2 pad: 1"),
    ((2, 2, 6, 6), "kernel_size: 2 stride: 3"),          # stride > kernel; ceil: the last window
                                                         # starts past the image (no pixel)
    ((1, 2, 5, 8), "kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 1"),
    ((2, 3, 5, 5), "kernel_size: 3 stride: 1"),           # the numpy branch's separable MAX
    ((2, 2, 5, 5), "kernel_size: 3 stride: 2 pad: 2"),    # a window all padding but one row
    ((2, 2, 7, 7), "kernel_size: 3 stride: 2 round_mode: FLOOR"),
    ((2, 2, 4, 6), "global_pooling: true"),
]


@pytest.mark.parametrize("shape,extra", POOLS)
@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_pooling(shape, extra, method):
    # MAX: small integers, so most windows hold ties (the first maximum must win)
    x = (RS.randint(0, 3, shape) if method == "MAX" else RS.standard_normal(shape))
    text = f'type: "Pooling" pooling_param {{ pool: {method} {extra} }}'
    name = method.lower()
    assert_branches_agree(text, [x], exact_tops=method == "MAX", launches=([f"{name}_pool_forward"],
                                               [f"{name}_pool_backward"]))


@pytest.mark.parametrize("shape,extra", POOLS[:3])
def test_max_pooling_argmax_top(shape, extra):
    tops, _ = assert_branches_agree(f'type: "Pooling" pooling_param {{ {extra} }}',
                                    [RS.randint(0, 3, shape)], n_tops=2, exact_tops=True,
                                    launches=(["max_pool_forward"], ["max_pool_backward"]))
    if extra == POOLS[1][1]:
        assert (tops[1][..., -1] == -1).all()      # the windows without a pixel


# ----- SoftmaxWithLoss ----------------------------------------------------------------------------
def loss_case(scores_shape, label_shape, classes, ignore=None, ignored=0.3):
    scores = RS.standard_normal(scores_shape) * 3
    labels = RS.randint(0, classes, label_shape).astype(float)
    if ignore is not None:
        labels[RS.random_sample(label_shape) < ignored] = ignore
    return scores, labels


LOSSES = [
    ((5, 7), (5,), 7, "", None),
    ((2, 4, 3, 2), (2, 1, 3, 2), 4, "loss_param { ignore_label: 1 }", 1),
    ((2, 4, 3, 2), (2, 3, 2), 4, "loss_param { ignore_label: 2 normalization: FULL }", 2),
    ((3, 5, 4), (3, 4), 5, "loss_param { ignore_label: 0 normalization: BATCH_SIZE }", 0),
    ((3, 5, 4), (3, 4), 5, "loss_param { ignore_label: 9 normalization: NONE }", 9),
    ((4, 3, 5), (4, 3), 5, "softmax_param { axis: -1 } loss_param { normalize: false }", None),
]


@pytest.mark.parametrize("scores_shape,label_shape,classes,extra,ignore", LOSSES)
@pytest.mark.parametrize("n_tops", [1, 2])
def test_softmax_loss(scores_shape, label_shape, classes, extra, ignore, n_tops):
    bottoms = loss_case(scores_shape, label_shape, classes, ignore)
    assert_branches_agree(
        f'type: "SoftmaxWithLoss" {extra}', bottoms, n_tops=n_tops,
        top_diffs=lambda top: [numpy.float32(0.7)] + [0] * (len(top) - 1),
        propagate=[True, False],
        launches=(["softmax_loss_forward", "softmax_loss_normalize"],
                  ["softmax_loss_backward"]))


@pytest.mark.parametrize("mode", ["VALID", "FULL", "BATCH_SIZE"])
def test_softmax_loss_every_label_ignored(mode):
    scores, labels = loss_case((4, 3), (4,), 3)
    labels[:] = 2
    tops, grads = assert_branches_agree(
        f'type: "SoftmaxWithLoss" loss_param {{ ignore_label: 2 normalization: {mode} }}',
        [scores, labels], top_diffs=lambda top: [numpy.float32(1)], propagate=[True, False])
    assert tops[0] == 0 and not grads[0].any()


def test_softmax_loss_bad_label_makes_the_loss_nan():
    """The kernel branch reads no label on the host: a label that is no class index makes the
    loss NaN (the numpy branch raises), and its position gets no gradient."""
    scores, labels = loss_case((3, 4), (3,), 4)
    labels[1] = 7
    labels[2] = -1
    layers = []
    tops, grads, _, _ = run_layer('type: "SoftmaxWithLoss"', [scores, labels], use_kernels=True,
                                  top_diffs=lambda top: [numpy.float32(1)],
                                  propagate=[True, False], prepare=layers.append)
    assert numpy.isnan(tops[0])
    assert not grads[0][1:].any() and grads[0][0].any()
    assert layers[0].bad_labels() == 2


# ----- LRN ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,extra", [
    ((2, 7, 3, 4), "local_size: 5 alpha: 0.3 beta: 0.75 k: 2"),
    ((1, 4, 5, 3), "local_size: 3 alpha: 1.5 beta: 0.6 k: 1"),
    ((2, 2, 2, 3), "local_size: 7 alpha: 0.1 beta: 0.75 k: 1"),   # window wider than the channels
])
def test_lrn_across_channels(shape, extra):
    assert_branches_agree(f'type: "LRN" lrn_param {{ {extra} }}', [RS.standard_normal(shape)],
                          launches=(["lrn_forward"], ["lrn_backward"]))


def test_lrn_within_channel_keeps_the_array_code():
    _, _, fwd, bwd = run_layer('type: "LRN" lrn_param { norm_region: WITHIN_CHANNEL }',
                               [RS.standard_normal((1, 2, 4, 4))], use_kernels=True)
    assert fwd == bwd == []


# ----- Dropout ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.5, 0.2, 0.0])
def test_dropout_mask_is_the_counter_generator(ratio):
    """The kernel's mask is counter_rng's, bit for bit, for the seed drawn from engine.rng."""
    x = RS.standard_normal((3, 5, 7, 11))
    rng.seed(11)
    seed = int(numpy.random.default_rng(11).integers(1 << 63))
    tops, grads, fwd, bwd = run_layer(
        f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}', [x], use_kernels=True,
        top_diffs=lambda top: [numpy.ones(top[0].shape)])
    keep = counter_rng.keep_mask(x.size, seed, 0, ratio).reshape(x.shape)
    scale = numpy.float32(1 / (1 - ratio))
    numpy.testing.assert_array_equal(tops[0], numpy.where(keep, x.astype(numpy.float32) * scale,
                                                          0))
    numpy.testing.assert_array_equal(grads[0], numpy.where(keep, scale, 0))
    assert (fwd, bwd) == (["dropout_forward"], ["dropout_backward"])
    assert abs(keep.mean() - (1 - ratio)) < 0.05


def test_dropout_draws_differ_by_iteration_and_seed():
    masks = [counter_rng.keep_mask(4096, s, i, 0.5) for s, i in ((1, 0), (1, 1), (2, 0))]
    assert all((a != b).mean() > 0.4 for a, b in ((masks[0], masks[1]), (masks[0], masks[2])))


def test_dropout_in_test_phase_launches_nothing():
    x = RS.standard_normal((2, 3))
    tops, _, fwd, bwd = run_layer('type: "Dropout"', [x], use_kernels=True, phase=TEST)
    numpy.testing.assert_array_equal(tops[0], x.astype(numpy.float32))
    assert fwd == bwd == []


def test_the_numpy_branch_stays_where_no_runner_is_set():
    assert kernels.runner_for(numpy.zeros(3, numpy.float32)) is None
    with kernels.host_runner(kernel_host.runner):
        assert kernels.runner_for(numpy.zeros(3, numpy.float32)) is not None
        assert kernels.runner_for(numpy.zeros(3, numpy.int32)) is None
