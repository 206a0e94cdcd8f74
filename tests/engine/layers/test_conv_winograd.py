"""Winograd's F(2x2, 3x3) convolution (engine/layers/conv/winograd.py): its transforms against
their definitions, the layer against im2col, which layers the cost rule sends there, and its
errors. (Forward against direct loops and float64 gradient checks run in test_conv.py, whose every
test also runs with POSEIDON_CONV=winograd.)"""
import numpy
import pytest

from poseidon.engine import parallel
from poseidon.engine.layers.conv.routes import fourier_pays, winograd_pays
from poseidon.engine.layers.conv.winograd import (WinogradConvCore, _Shape, pass_flops,
                                                  winograd_applies)
from poseidon.engine.layers.im2col import Geometry
from poseidon.engine.parallel import ScratchArena
from tests.engine.harness import run_forward
from tests.engine.layers.conv_routes import assert_routes_agree, conv_layer

THREE = Geometry(3, 3, 1, 1, 1, 1, 1, 1)


def test_kernel_transform_is_g_g_gt_and_its_transpose_is_the_adjoint():
    g = numpy.random.RandomState(0).standard_normal((3, 2, 3, 3))
    G = numpy.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])
    u = WinogradConvCore.kernel_transform(g, numpy)                      # (16, C, O)
    want = numpy.einsum("ai,ocij,bj->abco", G, g, G).reshape(16, 2, 3)
    numpy.testing.assert_allclose(u, want, rtol=1e-12, atol=1e-12)
    du = numpy.random.RandomState(1).standard_normal((16, 3, 2))           # (16, O, C)
    dg = WinogradConvCore.kernel_untransform(du, g.shape, numpy)
    # <U(g), dU> = <g, U^T(dU)>
    assert numpy.sum(u * du.transpose(0, 2, 1)) == pytest.approx(numpy.sum(g * dg))


@pytest.mark.parametrize("workers", [2, 3])
def test_kernel_transforms_split_over_threads_equal_one_call(workers, monkeypatch):
    """The transforms cut their channels over the threads (16 at least a range): with 40 input
    and 50 output channels, 2 and 3 threads give one thread's numbers."""
    from poseidon.engine import parallel
    rs = numpy.random.RandomState(2)
    g = rs.standard_normal((50, 40, 3, 3))
    du = rs.standard_normal((16, 50, 40))
    monkeypatch.setattr(parallel.parallel(), "workers", 1)
    u1 = WinogradConvCore.kernel_transform(g, numpy)
    dg1 = WinogradConvCore.kernel_untransform(du, g.shape, numpy)
    monkeypatch.setattr(parallel.parallel(), "workers", workers)
    numpy.testing.assert_allclose(WinogradConvCore.kernel_transform(g, numpy), u1,
                                  rtol=1e-13, atol=1e-13)
    numpy.testing.assert_allclose(WinogradConvCore.kernel_untransform(du, g.shape, numpy), dg1,
                                  rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("h,w,pad", [(5, 6, 1), (4, 4, 0), (7, 3, 2)])
def test_input_transform_and_its_transpose_are_adjoint(h, w, pad):
    """<V(x), dV> = <x, V^T(dV)> through the parity-split padded buffer: the input gradient is
    the exact transpose of what forward computed."""
    geom = Geometry(3, 3, 1, 1, pad, pad, 1, 1)
    s = _Shape(geom, h, w)
    rs = numpy.random.RandomState(2)
    n, c = 2, 3
    x = rs.standard_normal((n, c, h, w))
    xq = numpy.zeros((n, s.hq, 2, s.wh, c))
    s.fill(x, xq)
    dxq = numpy.zeros_like(xq)
    dx = numpy.empty_like(x)
    with ScratchArena(numpy).frame() as take:
        v = WinogradConvCore._input_transform(xq, s, 0, n, take).copy()
        dv = rs.standard_normal(v.shape)
        WinogradConvCore._input_untransform(dv, dxq, s, 0, n, take)
    s.unfill(dxq, dx)
    assert numpy.sum(v * dv) == pytest.approx(numpy.sum(x * dx))


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("extra,shape,num_output", [
    ("kernel_size: 3 pad: 1", (5, 6, 8, 8), 7),
    ("kernel_size: 3", (4, 2, 7, 9), 3),
    ("kernel_size: 3 pad: 2", (3, 3, 5, 4), 2),
    ("kernel_size: 3 pad: 1 bias_term: false", (2, 4, 1, 3), 5),
])
def test_winograd_matches_im2col_forward_and_backward(extra, shape, num_output, workers,
                                                      monkeypatch):
    monkeypatch.setattr(parallel.parallel(), "workers", workers)
    monkeypatch.setattr(WinogradConvCore, "MIN_TILES", 1)
    monkeypatch.setattr(WinogradConvCore, "CHUNK_BYTES", 1)      # one sample per chunk
    assert_routes_agree(extra, shape, num_output, ("im2col", "winograd"), monkeypatch, 1e-10)


def test_float32_winograd_is_as_close_to_float64_as_im2col(monkeypatch):
    """Rounding: float32 Winograd stays within float32's reach of the float64 result (relative
    to the largest value), forward and both gradients, on a VGG-like 3x3 layer."""
    monkeypatch.setenv("POSEIDON_CONV", "winograd")
    x = numpy.random.RandomState(4).standard_normal((2, 32, 14, 14))
    dy = numpy.random.RandomState(5).standard_normal((2, 32, 14, 14))
    got = {}
    for dtype in (numpy.float64, numpy.float32):
        layer = conv_layer("kernel_size: 3 pad: 1", 32, dtype=dtype)
        bottom, top = run_forward(layer, [x], dtype=dtype)
        assert layer.core.algorithm == "winograd" and top[0].data.dtype == dtype
        top[0].diff[...] = dy
        layer.backward(top, [True], bottom)
        got[dtype] = [top[0].data, bottom[0].diff, layer.blobs[0].diff]
    for a64, a32 in zip(got[numpy.float64], got[numpy.float32]):
        assert numpy.abs(a32 - a64).max() < 1e-5 * numpy.abs(a64).max()


def test_backward_without_forward_is_refused():
    core = WinogradConvCore(THREE)
    w = numpy.ones((2, 3, 3, 3))
    with pytest.raises(RuntimeError, match="backward without a forward"):
        core.backward(numpy.ones((4, 2, 5, 5)), w, weight_diff=numpy.zeros_like(w))


@pytest.mark.parametrize("geom,group,why", [
    (Geometry(3, 3, 2, 2, 1, 1, 1, 1), 1, "stride"),
    (Geometry(3, 3, 1, 1, 2, 2, 2, 2), 1, "dilation"),
    (Geometry(5, 5, 1, 1, 2, 2, 1, 1), 1, "5x5 kernel"),
    (Geometry(3, 3, 1, 1, 1, 1, 1, 1), 2, "groups"),
])
def test_winograd_does_not_apply(geom, group, why):
    assert not winograd_applies(geom, group), why
    with pytest.raises(ValueError, match="3x3 kernel, stride 1"):
        WinogradConvCore(geom, group)


def test_cost_rule_on_the_shapes_it_was_fitted_on():
    """Where it was measured (2 thread ranges): VGG19's 128-512-channel layers go to Winograd;
    64-96 channels (the bench's VGG block), 12x12 and 7x7 planes, 10 samples of 14x14 (245 tiles
    a thread) and cifar10_quick's layers stay where they were."""
    for n, c, o, hw in [(8, 128, 128, 112), (8, 256, 256, 56), (8, 512, 512, 28),
                        (16, 512, 512, 14), (32, 128, 256, 14), (12, 512, 512, 14)]:
        assert winograd_pays(THREE, 1, n, c, o, hw, hw, ranges=2), (n, c, o, hw)
    for n, c, o, hw in [(16, 64, 64, 56), (16, 96, 96, 28), (16, 64, 128, 56), (32, 128, 128, 12),
                        (32, 160, 320, 7), (10, 512, 512, 14), (100, 32, 32, 16)]:
        assert not winograd_pays(THREE, 1, n, c, o, hw, hw, ranges=2), (n, c, o, hw)
    assert not winograd_pays(Geometry(5, 5, 1, 1, 2, 2, 1, 1), 1, 32, 256, 256, 28, 28, ranges=2)
    assert pass_flops(2, 3, 4, 5, 6) == (2.0 * 16 * (2 * 3 * 3) * 3 * 4,
                                         2 * 2.0 * 16 * (2 * 3 * 3) * 3 * 4)


def test_layer_choice_follows_setting_and_rules(monkeypatch):
    """auto: the frequency route where its rule pays, then Winograd where its rule pays, im2col
    elsewhere; POSEIDON_CONV=winograd forces it where it applies; Caffe's engine keeps im2col."""
    monkeypatch.delenv("POSEIDON_CONV", raising=False)
    monkeypatch.setattr(parallel.parallel(), "workers", 2)
    x = numpy.zeros((8, 128, 16, 16), numpy.float32)
    assert winograd_pays(THREE, 1, 8, 128, 128, 16, 16, ranges=2)
    assert not fourier_pays(THREE, 1, 8, 128, 128, 16, 16, ranges=2)
    layer = conv_layer("kernel_size: 3 pad: 1", 128, dtype=numpy.float32)
    run_forward(layer, [x], dtype=numpy.float32)
    assert layer.core.algorithm == "winograd"
    narrow = conv_layer("kernel_size: 3 pad: 1", 16, dtype=numpy.float32)
    run_forward(narrow, [x], dtype=numpy.float32)
    assert narrow.core.algorithm == "im2col"                       # 16 outputs: too narrow
    caffe = conv_layer("kernel_size: 3 pad: 1 engine: CAFFE", 128, dtype=numpy.float32)
    run_forward(caffe, [x], dtype=numpy.float32)
    assert caffe.core.algorithm == "im2col"
    monkeypatch.setenv("POSEIDON_CONV", "winograd")
    forced = conv_layer("kernel_size: 3 pad: 1", 16, dtype=numpy.float32)
    run_forward(forced, [x], dtype=numpy.float32)
    assert forced.core.algorithm == "winograd"
    strided = conv_layer("kernel_size: 3 pad: 1 stride: 2", 16, dtype=numpy.float32)
    run_forward(strided, [x], dtype=numpy.float32)
    assert strided.core.algorithm == "im2col"                      # forced, but does not apply
