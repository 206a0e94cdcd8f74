"""Pooling: forward/backward against a loop transcription of Caffe's pooling_layer.cpp, float64
gradient checks (tie-free inputs for MAX), Caffe's size rules and clear errors."""
import math

import numpy
import pytest

from poseidon.engine.blob import Blob
from poseidon.engine.errors import LayerError
from tests.engine.harness import check_gradient, make_layer, run_forward

FLT_MAX = float(numpy.finfo(numpy.float32).max)


def pool(extra):
    return make_layer(f'type: "Pooling" pooling_param {{ {extra} }}')


def ref_pool(x, method, kh, kw, sh=1, sw=1, ph=0, pw=0, ceil=True, global_pooling=False, dy=None):
    """Caffe's CPU loops. Returns (top, argmax mask, bottom gradient for top gradient dy)."""
    n, c, h, w = x.shape
    if global_pooling:
        kh, kw = h, w
    rnd = math.ceil if ceil else math.floor
    out_h = int(rnd((h + 2 * ph - kh) / sh)) + 1
    out_w = int(rnd((w + 2 * pw - kw) / sw)) + 1
    if ph or pw:
        if (out_h - 1) * sh >= h + ph:
            out_h -= 1
        if (out_w - 1) * sw >= w + pw:
            out_w -= 1
    top = numpy.zeros((n, c, out_h, out_w))
    mask = numpy.full((n, c, out_h, out_w), -1.0)
    dx = numpy.zeros_like(x)
    for s in range(n):
        for ch in range(c):
            for r in range(out_h):
                for q in range(out_w):
                    hstart, wstart = r * sh - ph, q * sw - pw
                    if method == "MAX":
                        hend, wend = min(hstart + kh, h), min(wstart + kw, w)
                        hstart, wstart = max(hstart, 0), max(wstart, 0)
                        best, arg = -FLT_MAX, -1
                        for hh in range(hstart, hend):
                            for ww in range(wstart, wend):
                                if x[s, ch, hh, ww] > best:
                                    best, arg = x[s, ch, hh, ww], hh * w + ww
                        top[s, ch, r, q], mask[s, ch, r, q] = best, arg
                        if dy is not None and arg >= 0:
                            dx[s, ch, arg // w, arg % w] += dy[s, ch, r, q]
                    else:
                        hend, wend = min(hstart + kh, h + ph), min(wstart + kw, w + pw)
                        size = (hend - hstart) * (wend - wstart)
                        hstart, wstart = max(hstart, 0), max(wstart, 0)
                        hend, wend = min(hend, h), min(wend, w)
                        acc = 0.0
                        for hh in range(hstart, hend):
                            for ww in range(wstart, wend):
                                acc += x[s, ch, hh, ww]
                                if dy is not None:
                                    dx[s, ch, hh, ww] += dy[s, ch, r, q] / size
                        top[s, ch, r, q] = acc / size
    return top, mask, dx


def distinct(shape, seed=0):
    """Values without ties (a scaled random permutation), so MAX's finite differences are valid."""
    n = int(numpy.prod(shape))
    return numpy.random.RandomState(seed).permutation(n).reshape(shape) * 0.1 - n * 0.05


# (name, bottom shape, prototxt, reference keyword arguments)
CONFIGS = [
    ("max_ceil_overshoot", (2, 3, 6, 6), "pool: MAX kernel_size: 3 stride: 2",
     dict(method="MAX", kh=3, kw=3, sh=2, sw=2)),
    ("max_pad", (2, 3, 5, 5), "pool: MAX kernel_size: 3 stride: 2 pad: 1",
     dict(method="MAX", kh=3, kw=3, sh=2, sw=2, ph=1, pw=1)),
    ("max_pad_clip_rule", (2, 2, 6, 4), "pool: MAX kernel_size: 3 stride: 3 pad: 2",
     dict(method="MAX", kh=3, kw=3, sh=3, sw=3, ph=2, pw=2)),
    ("max_exact_tiles", (2, 3, 4, 6), "pool: MAX kernel_size: 2 stride: 2",
     dict(method="MAX", kh=2, kw=2, sh=2, sw=2)),
    ("max_gaps", (2, 2, 7, 7), "pool: MAX kernel_size: 2 stride: 3",
     dict(method="MAX", kh=2, kw=2, sh=3, sw=3)),
    ("max_separate_hw", (2, 3, 7, 6),
     "pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0",
     dict(method="MAX", kh=3, kw=2, sh=2, sw=1, ph=1, pw=0)),
    ("max_floor", (2, 3, 6, 6), "pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR",
     dict(method="MAX", kh=3, kw=3, sh=2, sw=2, ceil=False)),
    ("max_empty_windows", (1, 2, 5, 5), "pool: MAX kernel_size: 1 stride: 3",
     dict(method="MAX", kh=1, kw=1, sh=3, sw=3)),
    ("max_kernel_larger_than_input", (2, 2, 3, 3), "pool: MAX kernel_size: 4 stride: 2",
     dict(method="MAX", kh=4, kw=4, sh=2, sw=2)),
    # stride 1 (GoogLeNet's pools): the separable path, rows then columns
    ("max_stride1_pad", (2, 3, 6, 7), "pool: MAX kernel_size: 3 stride: 1 pad: 1",
     dict(method="MAX", kh=3, kw=3, ph=1, pw=1)),
    ("max_stride1_rect", (2, 2, 5, 6),
     "pool: MAX kernel_h: 2 kernel_w: 3 stride: 1 pad_h: 1 pad_w: 2",
     dict(method="MAX", kh=2, kw=3, ph=1, pw=2)),
    ("max_stride1_no_pad", (2, 2, 6, 5), "pool: MAX kernel_size: 3 stride: 1",
     dict(method="MAX", kh=3, kw=3)),
    ("max_global", (2, 3, 4, 5), "pool: MAX global_pooling: true",
     dict(method="MAX", kh=0, kw=0, global_pooling=True)),
    ("ave_ceil_overshoot", (2, 3, 6, 6), "pool: AVE kernel_size: 3 stride: 2",
     dict(method="AVE", kh=3, kw=3, sh=2, sw=2)),
    ("ave_pad", (2, 3, 5, 5), "pool: AVE kernel_size: 3 stride: 2 pad: 1",
     dict(method="AVE", kh=3, kw=3, sh=2, sw=2, ph=1, pw=1)),
    ("ave_pad_overshoot", (2, 2, 6, 6), "pool: AVE kernel_size: 3 stride: 2 pad: 1",
     dict(method="AVE", kh=3, kw=3, sh=2, sw=2, ph=1, pw=1)),
    ("ave_pad_clip_rule", (2, 2, 6, 4), "pool: AVE kernel_size: 3 stride: 3 pad: 2",
     dict(method="AVE", kh=3, kw=3, sh=3, sw=3, ph=2, pw=2)),
    ("ave_exact_tiles", (2, 3, 4, 6), "pool: AVE kernel_size: 2",
     dict(method="AVE", kh=2, kw=2, sh=1, sw=1)),
    ("ave_tiles_stride", (2, 3, 4, 6), "pool: AVE kernel_size: 2 stride: 2",
     dict(method="AVE", kh=2, kw=2, sh=2, sw=2)),
    ("ave_gaps", (2, 2, 7, 7), "pool: AVE kernel_size: 2 stride: 3",
     dict(method="AVE", kh=2, kw=2, sh=3, sw=3)),
    ("ave_separate_hw", (2, 3, 7, 6),
     "pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0",
     dict(method="AVE", kh=3, kw=2, sh=2, sw=1, ph=1, pw=0)),
    ("ave_floor", (2, 3, 7, 7), "pool: AVE kernel_size: 3 stride: 2 pad: 1 round_mode: FLOOR",
     dict(method="AVE", kh=3, kw=3, sh=2, sw=2, ph=1, pw=1, ceil=False)),
    ("ave_stride1_pad", (2, 3, 6, 7), "pool: AVE kernel_size: 3 stride: 1 pad: 1",
     dict(method="AVE", kh=3, kw=3, ph=1, pw=1)),
    ("ave_global", (2, 3, 4, 5), "pool: AVE global_pooling: true",
     dict(method="AVE", kh=0, kw=0, global_pooling=True)),
    ("ave_kernel_larger_than_input", (2, 2, 3, 3), "pool: AVE kernel_size: 4 stride: 2",
     dict(method="AVE", kh=4, kw=4, sh=2, sw=2)),
]
IDS = [c[0] for c in CONFIGS]


@pytest.mark.parametrize("name,shape,extra,kw", CONFIGS, ids=IDS)
def test_forward_and_backward_match_caffe_loops(name, shape, extra, kw):
    x = distinct(shape)
    layer = pool(extra)
    bottom, top = run_forward(layer, [x])
    dy = numpy.random.RandomState(1).standard_normal(top[0].shape)
    expected, _, expected_dx = ref_pool(x, dy=dy, **kw)
    assert top[0].shape == expected.shape
    numpy.testing.assert_allclose(top[0].data, expected, rtol=1e-12, atol=1e-12)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    numpy.testing.assert_allclose(bottom[0].diff, expected_dx, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("run_samples", [1, 2])
@pytest.mark.parametrize("name,shape,extra,kw", CONFIGS, ids=IDS)
def test_runs_of_samples_match_caffe_loops(name, shape, extra, kw, run_samples, monkeypatch):
    """The grid passes taken a run of samples at a time (pooling_plan.CHUNK_BYTES), twice, the
    second time with ties: a run's offsets reach into the next run's cells, left from the pass
    before."""
    from poseidon.engine.layers import pooling_plan
    rs = numpy.random.RandomState(6)
    shape = (5,) + shape[1:]
    layer = pool(extra)
    bottom, top = run_forward(layer, [distinct(shape, seed=7)])
    plan = layer._plan
    monkeypatch.setattr(pooling_plan, "CHUNK_BYTES",
                        run_samples * plan.grid_size(1, shape[1]) * 8)
    if not plan.global_reduce:
        assert len(plan.chunks(5, shape[1], 8, numpy)) == -(-5 // run_samples)
    for x in (distinct(shape, seed=8), rs.randint(0, 3, size=shape).astype(float)):
        bottom[0].data[...] = x
        layer.forward(bottom, top)
        dy = rs.standard_normal(top[0].shape)
        expected, _, expected_dx = ref_pool(x, dy=dy, **kw)
        numpy.testing.assert_allclose(top[0].data, expected, rtol=1e-12, atol=1e-12)
        top[0].diff[...] = dy
        layer.backward(top, [True], bottom)
        numpy.testing.assert_allclose(bottom[0].diff, expected_dx, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,shape,extra,kw", CONFIGS, ids=IDS)
def test_gradient(name, shape, extra, kw):
    if name == "max_empty_windows":
        pytest.skip("empty windows output -FLT_MAX: finite differences of the objective lose all "
                    "precision (the backward is compared with Caffe's loops above)")
    check_gradient(pool(extra), [distinct(shape, seed=2)])


@pytest.mark.parametrize("name,shape,extra,kw", [c for c in CONFIGS if c[3]["method"] == "MAX"],
                         ids=[c[0] for c in CONFIGS if c[3]["method"] == "MAX"])
def test_max_argmax_top(name, shape, extra, kw):
    x = distinct(shape, seed=3)
    x[0, 0] = 1.0     # a plane of ties: the first element of each window wins
    _, top = run_forward(pool(extra), [x], n_tops=2)
    expected, mask, _ = ref_pool(x, **kw)
    numpy.testing.assert_allclose(top[0].data, expected)
    numpy.testing.assert_array_equal(top[1].data, mask)
    if name != "max_empty_windows":   # see test_gradient
        check_gradient(pool(extra), [distinct(shape, seed=4)], n_tops=2, top_indices=[0])


@pytest.mark.parametrize("name,shape,extra,kw", [c for c in CONFIGS if c[3]["method"] == "MAX"],
                         ids=[c[0] for c in CONFIGS if c[3]["method"] == "MAX"])
def test_max_ties_route_gradient_to_first_maximum(name, shape, extra, kw):
    rs = numpy.random.RandomState(5)
    x = rs.randint(0, 3, size=shape).astype(float)   # many ties
    layer = pool(extra)
    bottom, top = run_forward(layer, [x])
    dy = rs.standard_normal(top[0].shape)
    expected, _, expected_dx = ref_pool(x, dy=dy, **kw)
    numpy.testing.assert_allclose(top[0].data, expected)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    numpy.testing.assert_allclose(bottom[0].diff, expected_dx, rtol=1e-12, atol=1e-12)


def test_max_padding_never_wins():
    x = -1.0 - distinct((1, 1, 4, 4)) ** 2          # all negative
    _, top = run_forward(pool("pool: MAX kernel_size: 3 stride: 1 pad: 1"), [x])
    assert (top[0].data < 0).all()


def test_max_backward_survives_in_place_change_of_top():
    """A later in-place layer (Scale, Dropout...) may rewrite top.data before backward."""
    x = distinct((2, 2, 6, 6))
    layer = pool("pool: MAX kernel_size: 3 stride: 2")
    bottom, top = run_forward(layer, [x])
    dy = numpy.random.RandomState(6).standard_normal(top[0].shape)
    _, _, expected_dx = ref_pool(x, "MAX", 3, 3, 2, 2, dy=dy)
    top[0].data[...] *= 2.0
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    numpy.testing.assert_allclose(bottom[0].diff, expected_dx)


def test_caffe_size_examples():
    # cifar10_quick pool1: MAX k3 s2 on 32 -> 16 (floor would give 15); pool3 AVE k3 s2 on 8 -> 4
    for h, extra, out in [(32, "pool: MAX kernel_size: 3 stride: 2", 16),
                          (32, "pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR", 15),
                          (112, "pool: MAX kernel_size: 3 stride: 2", 56),
                          (16, "pool: AVE kernel_size: 3 stride: 2", 8)]:
        _, top = run_forward(pool(extra), [numpy.zeros((1, 1, h, h))])
        assert top[0].shape == (1, 1, out, out), extra


def test_ave_divisor_counts_pad_but_not_overshoot():
    # cifar10_quick pool2 geometry (AVE k3 s2 on 16 -> 8): the last row/column windows hold
    # 2 real cells per dimension and are divided by 2 per dimension -> mean of ones stays 1.
    _, top = run_forward(pool("pool: AVE kernel_size: 3 stride: 2"), [numpy.ones((1, 1, 16, 16))])
    numpy.testing.assert_allclose(top[0].data, 1.0)
    # With pad 1 on 4x4, k3 s2: out = ceil(3/2)+1 = 3; window starts -1, 1, 3; ends clipped at
    # H + p = 5: sizes 3, 3, 2 per dim; real cells 2, 3, 1.
    _, top = run_forward(pool("pool: AVE kernel_size: 3 stride: 2 pad: 1"),
                         [numpy.ones((1, 1, 4, 4))])
    real = numpy.array([2, 3, 1])
    size = numpy.array([3, 3, 2])
    numpy.testing.assert_allclose(top[0].data[0, 0],
                                  numpy.outer(real, real) / numpy.outer(size, size))


def test_global_pooling_follows_reshape():
    layer = pool("pool: AVE global_pooling: true")
    x = numpy.arange(2 * 3 * 4 * 4, dtype=float).reshape(2, 3, 4, 4)
    bottom, top = run_forward(layer, [x])
    numpy.testing.assert_allclose(top[0].data[..., 0, 0], x.mean(axis=(2, 3)))
    b = Blob((2, 3, 6, 2), numpy.float64)
    b.data[...] = 1.5
    layer.reshape([b], top)
    layer.forward([b], top)
    assert top[0].shape == (2, 3, 1, 1)
    numpy.testing.assert_allclose(top[0].data, 1.5)


def test_float32_stays_float32():
    x = distinct((2, 3, 8, 8)).astype(numpy.float32)
    for extra in ("pool: MAX kernel_size: 3 stride: 2",
                  "pool: AVE kernel_size: 3 stride: 2 pad: 1"):
        layer = make_layer(f'type: "Pooling" pooling_param {{ {extra} }}', dtype=numpy.float32)
        bottom, top = run_forward(layer, [x], dtype=numpy.float32)
        assert top[0].data.dtype == numpy.float32
        top[0].diff[...] = 1
        layer.backward(top, [True], bottom)
        assert bottom[0].diff.dtype == numpy.float32 and bottom[0].diff.any()


ERRORS = [
    ("pool: STOCHASTIC kernel_size: 2", 1, (1, 1, 4, 4), "STOCHASTIC"),
    ("pool: AVE kernel_size: 2", 2, (1, 1, 4, 4), "second top"),
    ("pool: MAX global_pooling: true kernel_size: 2", 1, (1, 1, 4, 4), "global_pooling"),
    ("pool: MAX global_pooling: true stride: 2", 1, (1, 1, 4, 4), "pad 0 and stride 1"),
    ("pool: MAX kernel_size: 2 pad: 2", 1, (1, 1, 4, 4), "smaller than the kernel"),
    ("pool: MAX stride: 2", 1, (1, 1, 4, 4), "no kernel size"),
    ("pool: MAX kernel_h: 2", 1, (1, 1, 4, 4), "no kernel size"),
    ("pool: MAX kernel_size: 2 kernel_h: 2 kernel_w: 2", 1, (1, 1, 4, 4), "not both"),
    ("pool: MAX kernel_size: 2 pad_h: 1", 1, (1, 1, 4, 4), "pad_h and pad_w"),
    ("pool: MAX kernel_size: 2 stride: 0", 1, (1, 1, 4, 4), "stride"),
    ("pool: MAX kernel_size: 2", 1, (4, 4), "4-axis"),
    ("pool: MAX kernel_size: 5 round_mode: FLOOR", 1, (1, 1, 4, 4), "output would be"),
]


@pytest.mark.parametrize("extra,n_tops,shape,message", ERRORS)
def test_errors(extra, n_tops, shape, message):
    with pytest.raises(LayerError, match=message):
        run_forward(pool(extra), [numpy.zeros(shape)], n_tops=n_tops)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("extra", ["pool: MAX kernel_size: 3 stride: 2",
                                   "pool: MAX kernel_size: 3 stride: 1 pad: 1",
                                   "pool: AVE kernel_size: 3 stride: 2 pad: 1",
                                   "pool: MAX kernel_size: 2 stride: 3",
                                   "pool: AVE kernel_size: 2 stride: 2"])
def test_batch_split_over_threads_matches_caffe_loops(extra, workers, monkeypatch):
    """A batch of 9 (split into sample ranges on the worker threads) against Caffe's loops, with
    integer-valued inputs so MAX has ties."""
    from poseidon.engine import parallel
    monkeypatch.setattr(parallel.parallel(), "workers", workers)
    rs = numpy.random.RandomState(3)
    x = rs.randint(-3, 4, size=(9, 2, 7, 8)).astype(numpy.float64)
    dy_layer = pool(extra)
    bottom, top = run_forward(dy_layer, [x])
    dy = rs.standard_normal(top[0].shape)
    top[0].diff[...] = dy
    dy_layer.backward(top, [True], bottom)
    words = extra.split()
    kw = dict(kh=int(words[words.index("kernel_size:") + 1]))
    kw["kw"] = kw["kh"]
    s = int(words[words.index("stride:") + 1]) if "stride:" in words else 1
    p = int(words[words.index("pad:") + 1]) if "pad:" in words else 0
    ref_top, _, ref_dx = ref_pool(x, words[1], kw["kh"], kw["kw"], s, s, p, p, dy=dy)
    numpy.testing.assert_allclose(top[0].data, ref_top, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(bottom[0].diff, ref_dx, rtol=1e-12, atol=1e-12)


def test_input_size_change_rebuilds_the_padded_buffers():
    """After a reshape to another image size the padding cells are neutral again."""
    layer = pool("pool: MAX kernel_size: 3 stride: 2")
    rs = numpy.random.RandomState(4)
    x1 = rs.standard_normal((2, 2, 7, 7)) + 100
    bottom, top = run_forward(layer, [x1])
    x2 = rs.standard_normal((2, 2, 6, 6)) - 100
    bottom[0].reshape(x2.shape)
    bottom[0].data[...] = x2
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    numpy.testing.assert_allclose(top[0].data, ref_pool(x2, "MAX", 3, 3, 2, 2)[0])
