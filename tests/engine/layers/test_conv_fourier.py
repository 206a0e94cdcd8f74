"""The frequency-domain convolution (engine/layers/conv/fourier.py): its transforms against
numpy's FFT, the layer against im2col, which layers the cost rule sends where, and its errors.
(Forward against direct loops and float64 gradient checks run in test_conv.py, whose every test
also runs with POSEIDON_CONV=fourier.)"""
import numpy
import pytest

from poseidon.engine import gemm
from poseidon.engine.errors import LayerError
from poseidon.engine import parallel
from poseidon.engine.layers.conv.fourier import (FourierConvCore, _Plan, fourier_applies,
                                                 fourier_flops)
from poseidon.engine.layers.conv.routes import fourier_pays, fourier_pays_on_gpu
from poseidon.engine.layers.im2col import Geometry
from poseidon.engine.parallel import ScratchArena
from tests.engine.harness import run_forward
from tests.engine.layers.conv_routes import assert_routes_agree, conv_layer


def test_transform_is_the_zero_padded_dft():
    """_to_freq of (B, C, h, w) planes equals numpy's rfft2 of the planes zero-padded to the
    transform size, laid out (F, B, C)."""
    geom = Geometry(5, 3, 1, 1, 2, 1, 1, 1)
    h, w = 7, 6
    plan = _Plan(geom, h, w, numpy.float64, numpy)
    a = numpy.random.RandomState(0).standard_normal((3, 4, h, w))
    with ScratchArena(numpy).frame() as take:
        got = FourierConvCore._to_freq(a, plan.of_input, plan, take).copy()
    padded = numpy.zeros((3, 4, plan.ph, plan.pw))
    padded[:, :, :h, :w] = a
    want = numpy.fft.rfft2(padded).reshape(3, 4, plan.freqs).transpose(2, 0, 1)
    numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_inverse_undoes_the_transform_on_the_cells_asked_for():
    geom = Geometry(3, 3, 1, 1, 1, 1, 1, 1)
    h, w = 5, 8
    plan = _Plan(geom, h, w, numpy.float64, numpy)
    a = numpy.random.RandomState(1).standard_normal((2, 3, h, w))
    back = numpy.empty_like(a)
    with ScratchArena(numpy).frame() as take:
        spec = FourierConvCore._to_freq(a, plan.of_input, plan, take)
        FourierConvCore._from_freq(spec, plan.to_input, plan, take, back)
    numpy.testing.assert_allclose(back, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("extra,shape,num_output", [
    ("kernel_size: 5 pad: 2", (5, 6, 8, 8), 7),
    ("kernel_size: 5 pad: 2 group: 2", (4, 6, 9, 7), 4),   # AlexNet's conv2, in small
    ("kernel_size: 3", (4, 2, 6, 9), 3),
    ("kernel_h: 4 kernel_w: 2 pad_h: 3 pad_w: 0", (3, 3, 5, 4), 2),
])
def test_fourier_matches_im2col_forward_and_backward(extra, shape, num_output, workers,
                                                     monkeypatch):
    monkeypatch.setattr(parallel.parallel(), "workers", workers)
    assert_routes_agree(extra, shape, num_output, ("im2col", "fourier"), monkeypatch, 1e-9)


def test_float32_fourier_is_as_close_to_float64_as_im2col(monkeypatch):
    """Rounding: the float32 frequency route stays within float32's reach of the float64 result
    (relative to the largest output), on cifar10_quick's conv2 shape."""
    monkeypatch.setenv("POSEIDON_CONV", "fourier")
    x = numpy.random.RandomState(4).standard_normal((4, 32, 16, 16))
    _, top64 = run_forward(conv_layer("kernel_size: 5 pad: 2", 32), [x])
    layer = conv_layer("kernel_size: 5 pad: 2", 32, dtype=numpy.float32)
    _, top32 = run_forward(layer, [x], dtype=numpy.float32)
    assert layer.core.algorithm == "fourier" and top32[0].data.dtype == numpy.float32
    scale = numpy.abs(top64[0].data).max()
    assert numpy.abs(top32[0].data - top64[0].data).max() < 1e-5 * scale


# ----- which layers go where ---------------------------------------------------------------------
FIVE = Geometry(5, 5, 1, 1, 2, 2, 1, 1)


def test_cost_rule_on_the_shapes_it_was_fitted_on():
    """The rule's outcome where it was measured (2 thread ranges): cifar10_quick's conv2 and conv3
    go to the frequency route (a quarter of im2col's FLOPs); conv1 (3 input channels, 32 outputs:
    the output's inverse transform dominates), a 3x3 layer on 56x56 planes, and VGG's 512-channel
    layer at batch 10 (the weight spectrum's traffic dominates) stay on im2col; that layer at
    batch 64 goes to the frequency route."""
    three = Geometry(3, 3, 1, 1, 1, 1, 1, 1)
    assert fourier_pays(FIVE, 1, 100, 32, 32, 16, 16, ranges=2)
    assert fourier_pays(FIVE, 1, 100, 32, 64, 8, 8, ranges=2)
    assert not fourier_pays(FIVE, 1, 100, 3, 32, 32, 32, ranges=2)
    assert not fourier_pays(three, 1, 16, 64, 64, 56, 56, ranges=2)
    assert not fourier_pays(three, 1, 10, 512, 512, 14, 14, ranges=2)
    assert fourier_pays(three, 1, 64, 512, 512, 14, 14, ranges=2)
    # AlexNet / CaffeNet conv2 (5x5, 2 groups of 48 -> 128, 27x27) at its batch of 256
    assert fourier_pays(FIVE, 2, 256, 96, 256, 27, 27, ranges=2)
    direct, fourier, spectrum = fourier_flops(FIVE, 100, 32, 32, 16, 16, ranges=2)
    assert direct == 3 * 2 * 100 * 16 * 16 * 32 * 32 * 25
    assert fourier < 0.25 * direct
    assert spectrum == 3 * 2 * (18 * 10) * 32 * 32 * 8


def test_gpu_cost_rule_on_the_shapes_it_was_measured_on():
    """CuPy's rule (measured on an H100 and an H200): VGG19's 3x3 layers on planes of 28-224 px
    at batch 32 and GoogLeNet's conv2 go to the frequency route; VGG19's first layer (3
    channels), its 14 px layers, cifar10_quick's layers (planes of 32 px and less), 1x1 layers,
    strided ones and layers whose im2col columns are small (a 64-channel 56 px block at batch
    16) stay on im2col."""
    three = Geometry(3, 3, 1, 1, 1, 1, 1, 1)
    for c, o, side in ((64, 64, 224), (64, 128, 112), (256, 256, 56), (512, 512, 28)):
        assert fourier_pays_on_gpu(three, 1, 32, c, o, side, side), (c, o, side)
    assert fourier_pays_on_gpu(three, 1, 128, 64, 192, 56, 56)
    assert not fourier_pays_on_gpu(three, 1, 32, 3, 64, 224, 224)
    assert not fourier_pays_on_gpu(three, 1, 32, 512, 512, 14, 14)
    assert not fourier_pays_on_gpu(FIVE, 1, 100, 3, 32, 32, 32)
    assert not fourier_pays_on_gpu(FIVE, 1, 100, 32, 32, 16, 16)
    assert not fourier_pays_on_gpu(Geometry(1, 1, 1, 1, 0, 0, 1, 1), 1, 32, 256, 64, 56, 56)
    assert not fourier_pays_on_gpu(Geometry(3, 3, 2, 2, 1, 1, 1, 1), 1, 32, 64, 64, 56, 56)
    # the columns' size: the same layer at batch 16 (29 M numbers) and 64 (116 M)
    assert not fourier_pays_on_gpu(three, 1, 16, 64, 64, 56, 56)
    assert fourier_pays_on_gpu(three, 1, 64, 64, 64, 56, 56)
    assert not fourier_pays_on_gpu(three, 1, 16, 128, 128, 28, 28)
    # the channel floor counts one group's channels
    assert not fourier_pays_on_gpu(three, 4, 64, 64, 64, 56, 56)
    # the FLOP ceiling: 32 -> 32 on 224 px needs 3.4x im2col's FLOPs, 32 -> 256 on 112 px 1.15x
    assert not fourier_pays_on_gpu(three, 1, 32, 32, 32, 224, 224)
    assert fourier_pays_on_gpu(three, 1, 32, 32, 256, 112, 112)


@pytest.mark.parametrize("geom,group,why", [
    (Geometry(3, 3, 2, 2, 1, 1, 1, 1), 1, "stride"),
    (Geometry(3, 3, 1, 1, 2, 2, 2, 2), 1, "dilation"),
    (Geometry(3, 3, 1, 1, 3, 3, 1, 1), 1, "pad beyond kernel - 1"),
    (Geometry(7, 7, 1, 1, 0, 0, 1, 1), 1, "kernel larger than input + pad"),
])
def test_fourier_does_not_apply(geom, group, why):
    assert not fourier_applies(geom, group, 5, 5), why


def test_layer_choice_follows_setting_and_caffe_engine(monkeypatch):
    x = numpy.zeros((32, 32, 16, 16))
    monkeypatch.delenv("POSEIDON_CONV", raising=False)
    layer = conv_layer("kernel_size: 5 pad: 2", 32)
    run_forward(layer, [x])
    assert layer.core.algorithm == "fourier"          # auto, by the cost rule
    caffe = conv_layer("kernel_size: 5 pad: 2 engine: CAFFE", 32)
    run_forward(caffe, [x])
    assert caffe.core.algorithm == "im2col"           # Caffe's own engine asked for
    strided = conv_layer("kernel_size: 5 pad: 2 stride: 2", 32)
    monkeypatch.setenv("POSEIDON_CONV", "fourier")
    run_forward(strided, [x])
    assert strided.core.algorithm == "im2col"         # forced, but it does not apply
    monkeypatch.setenv("POSEIDON_CONV", "direct")
    with pytest.raises(LayerError, match="POSEIDON_CONV='direct'.*auto, im2col, fourier, winograd"):
        run_forward(conv_layer("kernel_size: 5 pad: 2", 32), [x])


def test_backward_without_forward_or_with_other_threads_is_refused(monkeypatch):
    core = FourierConvCore(Geometry(3, 3, 1, 1, 1, 1, 1, 1))
    w = numpy.ones((2, 3, 3, 3))
    dy = numpy.ones((4, 2, 5, 5))
    with pytest.raises(RuntimeError, match="backward without a forward"):
        core.backward(dy, w, weight_diff=numpy.zeros_like(w))
    monkeypatch.setattr(parallel.parallel(), "workers", 1)
    core.forward(numpy.ones((4, 3, 5, 5)), w, numpy.empty((4, 2, 5, 5)))
    monkeypatch.setattr(parallel.parallel(), "workers", 2)
    with pytest.raises(RuntimeError, match="cut the batch differently"):
        core.backward(dy, w, weight_diff=numpy.zeros_like(w))


def test_scratch_frames_reuse_space_nest_and_grow_safely():
    arena = ScratchArena(numpy)
    with arena.frame() as take:
        a = take((10,), numpy.float64)
        a[...] = 1
        with arena.frame() as inner:
            b = inner((4, 4), numpy.complex64)
            b[...] = 2
            big = inner((100000,), numpy.float32)   # grows the arena: a and b stay intact
            big[...] = 3
        assert numpy.all(a == 1) and numpy.all(b == 2)
        c = take((10,), numpy.float64)             # the inner frame's space is free again
        assert not numpy.shares_memory(a, c)
    with arena.frame() as take:
        d = take((10,), numpy.float64)
    with arena.frame() as take:
        assert numpy.shares_memory(d, take((10,), numpy.float64))   # same place, no new memory


def test_layers_share_scratch_so_memory_does_not_grow_with_depth(monkeypatch):
    """Ten identical Fourier layers keep only their own X^ and weight-sized partials: the
    scratch arena of this thread is the one place the spectra live."""
    from poseidon.engine import parallel as module
    monkeypatch.setenv("POSEIDON_CONV", "fourier")
    monkeypatch.setattr(module.parallel(), "workers", 1)
    x = numpy.random.RandomState(0).standard_normal((2, 16, 8, 8))
    sizes = []
    for _ in range(10):
        layer = conv_layer("kernel_size: 3 pad: 1", 16)
        bottom, top = run_forward(layer, [x])
        top[0].diff[...] = 1
        layer.backward(top, [True], bottom)
        sizes.append(module.scratch(numpy)._flat.size)
        own = sum(a.nbytes for b in layer.core._wbuf.values()
                  for a in b._arrays.values())
        spectrum = layer.core._plan(8, 8, numpy.float64, numpy).freqs * 16 * 16 * 16
        assert own < 2 * x.nbytes + spectrum   # X^ + partials, not several weight spectra
    assert len(set(sizes[1:])) == 1


def test_meter_counts_complex_products_as_four_real_ones():
    assert gemm.product_flops((3, 4), (4, 5)) == 2 * 3 * 4 * 5
    assert gemm.product_flops((7, 3, 4), (7, 4, 5), complex_values=True) == 7 * 8 * 3 * 4 * 5
