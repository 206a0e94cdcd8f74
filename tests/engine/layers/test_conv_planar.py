"""Forward in Caffe's column layout for narrow inputs (conv/planar.py, _forward_planar): which
layers take it, that it gives what the channels-last route gives on first-layer shapes, and that
the channels-last copy the weight gradient reads is made from the latest forward's input, and only
when a backward asks for it."""
import numpy
import pytest

from poseidon.engine import parallel
from poseidon.engine.layers.conv.columns import Im2colConvCore
from poseidon.engine.layers.im2col import Geometry


def _geom(k, s=1, p=0, d=1):
    return Geometry(k, k, s, s, p, p, d, d)


@pytest.mark.parametrize("channels,k,dtype,group,planar", [
    (3, 11, numpy.float32, 1, True),     # AlexNet's conv1: 33 numbers a window row
    (3, 5, numpy.float32, 1, True),      # cifar10_quick's conv1
    (4, 11, numpy.float32, 1, False),    # 44 numbers: 176 bytes
    (3, 7, numpy.float64, 1, False),     # 168 bytes
    (6, 3, numpy.float32, 2, False),     # groups keep the channels-last route
    (16, 3, numpy.float32, 1, False),    # 192 bytes
])
def test_planar_forward_is_taken_for_narrow_inputs_only(channels, k, dtype, group, planar):
    x = numpy.zeros((2, channels, 12, 12), dtype)
    assert Im2colConvCore(_geom(k), group)._planar(x) is planar


def _run(core, x, w, b, dy, want_dx=True):
    oh, ow = core.geom.conv_out(*x.shape[2:])
    y = numpy.empty((x.shape[0], w.shape[0], oh, ow), x.dtype)
    core.forward(x, w, y, b)
    dw = numpy.zeros_like(w)
    db = numpy.zeros_like(b)
    dx = numpy.empty_like(x) if want_dx else None
    core.backward(dy, w, weight_diff=dw, bias_diff=db, dx=dx)
    return [y, dw, db] + ([dx] if want_dx else [])


# (batch, channels, size, outputs, kernel, stride, pad, dilation): first layers, scaled down
SHAPES = [
    (5, 3, 23, 8, 11, 4, 0, 1),      # AlexNet-like 11x11/4
    (3, 3, 17, 6, 7, 2, 3, 1),       # ResNet/GoogLeNet-like 7x7/2, pad 3
    (4, 3, 9, 5, 5, 1, 2, 1),        # cifar10_quick-like 5x5, pad 2
    (2, 1, 11, 4, 3, 1, 2, 2),       # one channel, dilation 2
    (1, 3, 13, 4, 3, 2, 1, 1),       # batch 1: bands of output rows on two threads
]


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("block", ["whole", "tiny"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"k{s[4]}s{s[5]}n{s[0]}" for s in SHAPES])
def test_planar_forward_matches_channels_last(shape, block, workers, monkeypatch):
    n, c, size, o, k, s, p, d = shape
    monkeypatch.setattr(parallel.parallel(), "workers", workers)
    monkeypatch.setattr(Im2colConvCore, "COLUMN_BLOCK_BYTES", 1 << 30 if block == "whole" else 1)
    monkeypatch.setattr(Im2colConvCore, "MIN_CHUNK_CELLS", 1)
    monkeypatch.setattr(Im2colConvCore, "PLANAR_MAX_RUN_BYTES", 1 << 20)
    r = numpy.random.RandomState(3)
    x = r.standard_normal((n, c, size, size))
    w = r.standard_normal((o, c, k, k))
    b = r.standard_normal(o)
    geom = _geom(k, s, p, d)
    dy = r.standard_normal((n, o) + geom.conv_out(size, size))
    planar = Im2colConvCore(geom, 1)
    assert planar._planar(x)
    got = _run(planar, x, w, b, dy)
    monkeypatch.setattr(Im2colConvCore, "PLANAR_MAX_RUN_BYTES", 0)
    want = _run(Im2colConvCore(geom, 1), x, w, b, dy)
    for g, e in zip(got, want):
        numpy.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-11)
    # float32 too, within float32 rounding of the same sums
    monkeypatch.setattr(Im2colConvCore, "PLANAR_MAX_RUN_BYTES", 1 << 20)
    args32 = [a.astype(numpy.float32) for a in (x, w, b, dy)]
    got32 = _run(Im2colConvCore(geom, 1), *args32)
    for g, e in zip(got32, want):
        numpy.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-4 * numpy.abs(e).max())


def test_channels_last_copy_is_made_in_backward_from_the_latest_input(monkeypatch):
    """Forward-only passes never make it; each backward makes it from the input of the forward
    before it, not from an earlier batch's copy."""
    monkeypatch.setattr(parallel.parallel(), "workers", 2)
    geom = _geom(5, 1, 2)
    r = numpy.random.RandomState(4)
    x1, x2 = r.standard_normal((2, 4, 3, 8, 8)).astype(numpy.float32)
    w = r.standard_normal((6, 3, 5, 5)).astype(numpy.float32)
    b = numpy.zeros(6, numpy.float32)
    dy = r.standard_normal((4, 6, 8, 8)).astype(numpy.float32)
    core = Im2colConvCore(geom, 1)
    y = numpy.empty((4, 6, 8, 8), numpy.float32)
    core.forward(x1, w, y, b)
    assert "xpad0" not in core.buffers._arrays          # a forward-only pass makes no copy
    first = _run(core, x1, w, b, dy, want_dx=False)
    assert "xpad0" in core.buffers._arrays
    second = _run(core, x2, w, b, dy, want_dx=False)    # the copy of x1 exists: it must not be used
    monkeypatch.setattr(Im2colConvCore, "PLANAR_MAX_RUN_BYTES", 0)
    for x, got in ((x1, first), (x2, second)):
        want = _run(Im2colConvCore(geom, 1), x, w, b, dy, want_dx=False)
        for g, e in zip(got, want):
            numpy.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-4)
    assert not numpy.allclose(first[1], second[1])


@pytest.mark.parametrize("channels,stride,mode", [
    (3, 1, "planar"),        # a Deconvolution to an image, or an image's gradient: 3 outputs
    (3, 2, "planar"),
    (32, 1, "correlate"),
    (32, 2, "col2im"),
])
def test_input_gradient_route_follows_the_input_width(channels, stride, mode):
    core = Im2colConvCore(_geom(5, stride, 2), 1)
    weight = numpy.zeros((16, channels, 5, 5), numpy.float32)
    dy = numpy.zeros((2, 16, 6, 6), numpy.float32)
    assert core._data_grad_plan(dy, weight)["mode"] == mode
