"""Convolution and Deconvolution: forward against direct-loop references, float64 gradient checks,
parameter parsing and clear errors."""
import numpy
import pytest

from poseidon.engine import rng
from poseidon.engine.blob import Blob
from poseidon.engine.errors import LayerError
from poseidon.engine.layers.conv.columns import Im2colConvCore
from tests.engine.harness import check_gradient, make_layer, run_forward

@pytest.fixture(autouse=True, params=["one_chunk", "sample_chunks", "row_bands", "channels_last",
                                      "fourier_1", "fourier_2", "winograd_1", "winograd_2"])
def chunking(request, monkeypatch):
    """Run every test through the three ways im2col cuts a batch (see Im2colConvCore._chunks):
    one chunk on one thread, several whole samples per chunk on two threads, and bands of one
    output row, each with forward in Caffe's column layout where the input is narrow enough
    (Im2colConvCore._planar: most configurations here, 3 channels of float64); then the same
    two-thread chunks with forward always channels-last ("channels_last"); then the frequency
    route (conv/fourier.py) and Winograd's F(2x2, 3x3) (conv/winograd.py, one sample per chunk) on
    one and two threads, wherever they apply (the other layers stay on im2col)."""
    from poseidon.engine import parallel
    from poseidon.engine.layers.conv.winograd import WinogradConvCore
    route = request.param.split("_")[0]
    monkeypatch.setenv("POSEIDON_CONV", route if route in ("fourier", "winograd") else "im2col")
    if route == "winograd":
        monkeypatch.setattr(WinogradConvCore, "CHUNK_BYTES", 1)
        monkeypatch.setattr(WinogradConvCore, "MIN_TILES", 1)
    one = request.param in ("one_chunk", "fourier_1", "winograd_1")
    monkeypatch.setattr(parallel.parallel(), "workers", 1 if one else 2)
    monkeypatch.setattr(Im2colConvCore, "COLUMN_BLOCK_BYTES",
                        1 if request.param == "row_bands" else 1 << 30)
    monkeypatch.setattr(Im2colConvCore, "MIN_CHUNK_CELLS", 1)
    if request.param == "channels_last":
        monkeypatch.setattr(Im2colConvCore, "PLANAR_MAX_RUN_BYTES", 0)
    return request.param


FILLERS = ('weight_filler { type: "gaussian" std: 1 } '
           'bias_filler { type: "gaussian" std: 1 }')


def conv(extra, num_output=4, kind="Convolution", dtype=numpy.float64, fillers=FILLERS):
    rng.seed(11)
    return make_layer(f'type: "{kind}" convolution_param {{ num_output: {num_output} {extra} '
                      f'{fillers} }}', dtype=dtype)


def ref_conv(x, w, b, kh, kw, sh=1, sw=1, ph=0, pw=0, dh=1, dw=1, group=1):
    """Direct loops: y[n,o,r,c] = b[o] + sum_{ci,i,j} w[o,ci,i,j] x[n, g*Cg+ci, r*sh-ph+i*dh, ..]
    (zero outside the image)."""
    n, c, h, wd = x.shape
    o = w.shape[0]
    cg, og = c // group, o // group
    out_h = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    out_w = (wd + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    y = numpy.zeros((n, o, out_h, out_w))
    for s in range(n):
        for oc in range(o):
            g = oc // og
            for r in range(out_h):
                for q in range(out_w):
                    acc = 0.0 if b is None else b[oc]
                    for ci in range(cg):
                        for i in range(kh):
                            for j in range(kw):
                                hh = r * sh - ph + i * dh
                                ww = q * sw - pw + j * dw
                                if 0 <= hh < h and 0 <= ww < wd:
                                    acc += w[oc, ci, i, j] * x[s, g * cg + ci, hh, ww]
                    y[s, oc, r, q] = acc
    return y


def ref_deconv(x, w, b, kh, kw, sh=1, sw=1, ph=0, pw=0, dh=1, dw=1, group=1):
    """Direct scatter: each input pixel adds x * w[c, o] into the output at r*s - p + i*d."""
    n, c, h, wd = x.shape
    og = w.shape[1]
    cg = c // group
    o = og * group
    out_h = sh * (h - 1) + dh * (kh - 1) + 1 - 2 * ph
    out_w = sw * (wd - 1) + dw * (kw - 1) + 1 - 2 * pw
    y = numpy.zeros((n, o, out_h, out_w))
    for s in range(n):
        for ci in range(c):
            g = ci // cg
            for r in range(h):
                for q in range(wd):
                    for oo in range(og):
                        for i in range(kh):
                            for j in range(kw):
                                hh = r * sh - ph + i * dh
                                ww = q * sw - pw + j * dw
                                if 0 <= hh < out_h and 0 <= ww < out_w:
                                    y[s, g * og + oo, hh, ww] += x[s, ci, r, q] * w[ci, oo, i, j]
    if b is not None:
        y += b.reshape(1, -1, 1, 1)
    return y


# (name, bottom shape, num_output, prototxt extra, reference keyword arguments)
CONV_CONFIGS = [
    ("basic", (2, 3, 5, 5), 4, "kernel_size: 3", dict(kh=3, kw=3)),
    ("pad_stride", (2, 3, 5, 5), 4, "kernel_size: 3 pad: 1 stride: 2",
     dict(kh=3, kw=3, sh=2, sw=2, ph=1, pw=1)),
    ("group2", (2, 4, 5, 5), 6, "kernel_size: 3 pad: 1 group: 2",
     dict(kh=3, kw=3, ph=1, pw=1, group=2)),
    ("dilation2", (2, 3, 5, 5), 4, "kernel_size: 3 pad: 2 dilation: 2",
     dict(kh=3, kw=3, ph=2, pw=2, dh=2, dw=2)),
    ("separate_hw", (2, 3, 6, 5), 4,
     "kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 0 stride_h: 2 stride_w: 1",
     dict(kh=3, kw=2, sh=2, sw=1, ph=1, pw=0)),
    ("repeated_hw", (2, 3, 6, 5), 4,
     "kernel_size: 3 kernel_size: 2 pad: 1 pad: 0 stride: 2 stride: 1 dilation: 1 dilation: 2",
     dict(kh=3, kw=2, sh=2, sw=1, ph=1, pw=0, dh=1, dw=2)),
    ("pad_k_minus_1", (2, 3, 4, 6), 3, "kernel_h: 3 kernel_w: 2 pad_h: 2 pad_w: 1",
     dict(kh=3, kw=2, ph=2, pw=1)),
    ("no_bias", (2, 3, 5, 5), 4, "kernel_size: 3 pad: 1 bias_term: false",
     dict(kh=3, kw=3, ph=1, pw=1)),
    ("pad2_odd", (2, 3, 5, 6), 4, "kernel_size: 3 pad: 2", dict(kh=3, kw=3, ph=2, pw=2)),
    ("pointwise_group", (2, 4, 3, 4), 6, "kernel_size: 1 group: 2", dict(kh=1, kw=1, group=2)),
    # planes small against the channels: the 1x1 weight gradient as one product over the batch
    ("pointwise_small_plane", (3, 8, 2, 1), 8, "kernel_size: 1", dict(kh=1, kw=1)),
    ("pointwise_small_plane_group", (3, 16, 1, 3), 16, "kernel_size: 1 group: 2",
     dict(kh=1, kw=1, group=2)),
    ("pad_beyond_kernel", (2, 3, 4, 4), 2, "kernel_size: 1 pad: 1", dict(kh=1, kw=1, ph=1, pw=1)),
    # strided 1x1 (ResNet's downsampling): the pointwise GEMMs on the cells the kernel meets
    ("pointwise_stride2", (2, 3, 5, 5), 4, "kernel_size: 1 stride: 2", dict(kh=1, kw=1, sh=2, sw=2)),
    ("pointwise_stride_hw_group", (2, 4, 7, 6), 6,
     "kernel_size: 1 stride_h: 3 stride_w: 2 dilation: 2 group: 2",
     dict(kh=1, kw=1, sh=3, sw=2, dh=2, dw=2, group=2)),
    ("stride_dilation_group", (2, 4, 7, 6), 2,
     "kernel_size: 2 stride: 2 dilation: 2 pad: 1 group: 2",
     dict(kh=2, kw=2, sh=2, sw=2, ph=1, pw=1, dh=2, dw=2, group=2)),
]
CONV_IDS = [c[0] for c in CONV_CONFIGS]


@pytest.mark.parametrize("name,shape,num_output,extra,kw", CONV_CONFIGS, ids=CONV_IDS)
def test_conv_forward(name, shape, num_output, extra, kw):
    x = numpy.random.RandomState(0).standard_normal(shape)
    layer = conv(extra, num_output)
    _, top = run_forward(layer, [x])
    w = layer.blobs[0].data
    b = layer.blobs[1].data if "bias_term: false" not in extra else None
    assert len(layer.blobs) == (1 if b is None else 2)
    assert w.shape == (num_output, shape[1] // kw.get("group", 1), kw["kh"], kw["kw"])
    expected = ref_conv(x, w, b, **kw)
    assert top[0].shape == expected.shape
    numpy.testing.assert_allclose(top[0].data, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,shape,num_output,extra,kw", CONV_CONFIGS, ids=CONV_IDS)
def test_conv_gradient(name, shape, num_output, extra, kw):
    x = numpy.random.RandomState(1).standard_normal(shape)
    check_gradient(conv(extra, num_output), [x])


@pytest.mark.parametrize("batch", [1, 3])
def test_strided_pointwise_input_gradient_overwrites_the_diff(batch):
    """A strided 1x1 layer's input gradient is W^T dy at the cells its kernel meets and zero
    between them, whatever the diff held before (the backward overwrites it)."""
    layer = conv("kernel_size: 1 stride_h: 2 stride_w: 3 group: 2", 6)
    x = numpy.random.RandomState(4).standard_normal((batch, 4, 7, 8))
    bottom, top = run_forward(layer, [x])
    assert top[0].shape == (batch, 6, 4, 3)
    dy = numpy.random.RandomState(5).standard_normal(top[0].shape)
    top[0].diff[...] = dy
    bottom[0].diff[...] = numpy.nan
    layer.backward(top, [True], bottom)
    w = layer.blobs[0].data.reshape(2, 3, 2)                  # (group, O/g, C/g)
    expected = numpy.zeros(x.shape)
    expected[:, :, ::2, ::3] = numpy.einsum(
        "goc,ngohw->ngchw", w, dy.reshape(batch, 2, 3, 4, 3)).reshape(batch, 4, 4, 3)
    numpy.testing.assert_allclose(bottom[0].diff, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,shape,num_output,extra,kw", CONV_CONFIGS, ids=CONV_IDS)
def test_weight_gradient_same_with_and_without_input_gradient(name, shape, num_output, extra,
                                                              kw):
    """With the input gradient, stride-1 layers take the weight gradient from the unrolled top
    gradient (flipped); without it, from the unrolled input: both are the same sums."""
    x = numpy.random.RandomState(8).standard_normal(shape)
    grads = []
    for want_dx in (True, False):
        layer = conv(extra, num_output)
        bottom, top = run_forward(layer, [x])
        top[0].diff[...] = numpy.random.RandomState(9).standard_normal(top[0].shape)
        layer.backward(top, [want_dx], bottom)
        grads.append([p.diff.copy() for p in layer.blobs])
        assert bottom[0].diff.any() == want_dx
    for a, b in zip(*grads):
        numpy.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_conv_float32_matches_float64():
    x = numpy.random.RandomState(2).standard_normal((3, 4, 9, 9))
    extra = "kernel_size: 3 pad: 1 stride: 1"
    _, top64 = run_forward(conv(extra, 5), [x])
    layer = conv(extra, 5, dtype=numpy.float32)
    bottom, top32 = run_forward(layer, [x], dtype=numpy.float32)
    assert top32[0].data.dtype == numpy.float32
    numpy.testing.assert_allclose(top32[0].data, top64[0].data, rtol=1e-4, atol=1e-4)
    top32[0].diff[...] = 1
    layer.backward(top32, [True], bottom)
    assert layer.blobs[0].diff.dtype == numpy.float32
    assert bottom[0].diff.dtype == numpy.float32 and bottom[0].diff.any()


def _blob(a, dtype):
    b = Blob(a.shape, dtype)
    b.data[...] = a
    return b


def test_conv_two_bottoms_share_weights():
    rs = numpy.random.RandomState(3)
    x1, x2 = rs.standard_normal((2, 2, 4, 4)), rs.standard_normal((2, 2, 4, 4))
    layer = conv("kernel_size: 3 pad: 1", 3)
    _, top = run_forward(layer, [x1, x2], n_tops=2)
    w, b = layer.blobs[0].data, layer.blobs[1].data
    for x, t in zip((x1, x2), top):
        numpy.testing.assert_allclose(t.data, ref_conv(x, w, b, 3, 3, ph=1, pw=1), rtol=1e-10,
                                      atol=1e-10)
    check_gradient(conv("kernel_size: 3 pad: 1", 3), [x1, x2], n_tops=2)


def test_conv_param_grads_accumulate():
    x = numpy.random.RandomState(4).standard_normal((2, 3, 5, 5))
    layer = conv("kernel_size: 3", 2)
    bottom, top = run_forward(layer, [x])
    top[0].diff[...] = 1
    for p in layer.blobs:
        p.diff[...] = 0
    layer.backward(top, [False], bottom)
    once = [p.diff.copy() for p in layer.blobs]
    layer.backward(top, [False], bottom)
    for p, d in zip(layer.blobs, once):
        numpy.testing.assert_allclose(p.diff, 2 * d)


def test_conv_default_filler_is_zero_and_reshape_follows_input():
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 }')
    _, top = run_forward(layer, [numpy.ones((1, 1, 4, 4))])
    assert not layer.blobs[0].data.any() and not top[0].data.any()
    bottom = [_blob(numpy.ones((3, 1, 7, 6)), numpy.float64)]
    layer.reshape(bottom, top)
    assert top[0].shape == (3, 2, 5, 4)


# ----- deconvolution ------------------------------------------------------------------------------
DECONV_CONFIGS = [
    ("basic", (2, 3, 4, 4), 2, "kernel_size: 3", dict(kh=3, kw=3)),
    ("stride2_pad1", (2, 3, 4, 4), 2, "kernel_size: 3 stride: 2 pad: 1",
     dict(kh=3, kw=3, sh=2, sw=2, ph=1, pw=1)),
    ("group_dilation", (2, 4, 4, 3), 6, "kernel_size: 3 dilation: 2 pad: 1 group: 2",
     dict(kh=3, kw=3, ph=1, pw=1, dh=2, dw=2, group=2)),
    ("separate_hw_no_bias", (2, 3, 3, 4), 2,
     "kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 1 pad_h: 0 pad_w: 1 bias_term: false",
     dict(kh=2, kw=3, sh=2, sw=1, ph=0, pw=1)),
    ("pointwise", (2, 3, 3, 3), 4, "kernel_size: 1", dict(kh=1, kw=1)),
    ("pointwise_stride2", (2, 3, 3, 4), 4, "kernel_size: 1 stride: 2", dict(kh=1, kw=1, sh=2, sw=2)),
    ("upsample4", (1, 2, 3, 3), 2, "kernel_size: 8 stride: 4 pad: 2 group: 2",
     dict(kh=8, kw=8, sh=4, sw=4, ph=2, pw=2, group=2)),
]


@pytest.mark.parametrize("name,shape,num_output,extra,kw", DECONV_CONFIGS,
                         ids=[c[0] for c in DECONV_CONFIGS])
def test_deconv_forward(name, shape, num_output, extra, kw):
    x = numpy.random.RandomState(5).standard_normal(shape)
    layer = conv(extra, num_output, kind="Deconvolution")
    _, top = run_forward(layer, [x])
    w = layer.blobs[0].data
    assert w.shape == (shape[1], num_output // kw.get("group", 1), kw["kh"], kw["kw"])
    b = layer.blobs[1].data if "bias_term: false" not in extra else None
    expected = ref_deconv(x, w, b, **kw)
    assert top[0].shape == expected.shape
    numpy.testing.assert_allclose(top[0].data, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,shape,num_output,extra,kw", DECONV_CONFIGS,
                         ids=[c[0] for c in DECONV_CONFIGS])
def test_deconv_gradient(name, shape, num_output, extra, kw):
    if name == "upsample4":
        shape = (1, 2, 2, 2)
    x = numpy.random.RandomState(6).standard_normal(shape)
    check_gradient(conv(extra, num_output, kind="Deconvolution"), [x])


def test_deconv_is_transpose_of_conv():
    """<conv(x), y> == <x, deconv(y)> with the same weights (and no bias)."""
    rs = numpy.random.RandomState(7)
    extra = "kernel_size: 3 stride: 2 pad: 1 bias_term: false"
    c = conv(extra, 3)
    x = rs.standard_normal((2, 2, 7, 7))
    _, cy = run_forward(c, [x])
    y = rs.standard_normal(cy[0].shape)
    d = make_layer(f'type: "Deconvolution" convolution_param {{ num_output: 2 {extra} }}')
    bottom = [_blob(y, numpy.float64)]
    top = [Blob((), numpy.float64)]
    d.setup(bottom, top)
    d.blobs[0].data[...] = c.blobs[0].data
    d.forward(bottom, top)
    assert top[0].shape == x.shape
    numpy.testing.assert_allclose((cy[0].data * y).sum(), (x * top[0].data).sum(), rtol=1e-10)


# ----- errors -------------------------------------------------------------------------------------
ERRORS = [
    ("kernel_size: 3 group: 2", 4, (1, 3, 5, 5), "not divisible by group"),
    ("kernel_size: 3 group: 2", 3, (1, 4, 5, 5), "num_output 3 is not divisible by group 2"),
    ("pad: 1", 4, (1, 3, 5, 5), "no kernel size"),
    ("kernel_h: 3", 4, (1, 3, 5, 5), "kernel"),
    ("kernel_size: 3 kernel_h: 3 kernel_w: 3", 4, (1, 3, 5, 5), "one form"),
    ("kernel_size: 3 kernel_size: 3 kernel_size: 3", 4, (1, 3, 5, 5), "once per spatial"),
    ("kernel_size: 7", 4, (1, 3, 5, 5), "output would be"),
    ("kernel_size: 3 dilation: 3", 4, (1, 3, 5, 5), "output would be"),
    ("kernel_size: 3 axis: 2", 4, (1, 3, 5, 5), "only axis 1"),
    ("kernel_size: 3 stride: 0", 4, (1, 3, 5, 5), "stride"),
    ("kernel_size: 3", 4, (1, 3, 5, 5, 5), "2-D"),
    ("kernel_size: 3", 4, (3, 5, 5), "2-D"),
    ("kernel_size: 3", 0, (1, 3, 5, 5), "num_output"),
]


@pytest.mark.parametrize("extra,num_output,shape,message", ERRORS)
def test_conv_errors(extra, num_output, shape, message):
    layer = conv(extra, num_output, fillers="")
    with pytest.raises(LayerError, match=message):
        run_forward(layer, [numpy.zeros(shape)])


def test_conv_channel_change_after_setup_is_refused():
    layer = conv("kernel_size: 3", 2)
    bottom, top = run_forward(layer, [numpy.zeros((1, 3, 5, 5))])
    with pytest.raises(LayerError, match="channel count may not change"):
        layer.reshape([_blob(numpy.zeros((1, 4, 5, 5)), numpy.float64)], top)


def test_deconv_errors():
    with pytest.raises(LayerError, match="not divisible by group"):
        run_forward(conv("kernel_size: 2 group: 2", 4, kind="Deconvolution"),
                    [numpy.zeros((1, 3, 4, 4))])
    with pytest.raises(LayerError, match="output would be"):
        run_forward(conv("kernel_size: 1 pad: 1", 4, kind="Deconvolution"),
                    [numpy.zeros((1, 3, 1, 1))])


# ----- batch blocks and worker threads (engine.parallel) ------------------------------------------
BLOCK_CONFIGS = [c for c in CONV_CONFIGS if c[0] in (
    "basic", "pad_stride", "group2", "dilation2", "stride_dilation_group", "pointwise_group",
    "pointwise_small_plane", "pointwise_small_plane_group", "pointwise_stride2",
    "pointwise_stride_hw_group")]


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("name,shape,num_output,extra,kw", BLOCK_CONFIGS,
                         ids=[c[0] for c in BLOCK_CONFIGS])
def test_conv_blocks_and_threads_match_reference(name, shape, num_output, extra, kw, workers,
                                                 monkeypatch):
    """A batch of 7 cut into one-sample blocks on 1-3 threads: forward matches the loops, and
    backward (weights, bias, input) matches the same layer run as one batch-wide block."""
    from poseidon.engine import parallel
    batch = (7,) + shape[1:]
    x = numpy.random.RandomState(5).standard_normal(batch)
    dy_seed = numpy.random.RandomState(6)

    def run(block_bytes, n_workers):
        monkeypatch.setattr(Im2colConvCore, "COLUMN_BLOCK_BYTES", block_bytes)
        monkeypatch.setattr(Im2colConvCore, "MIN_CHUNK_CELLS", 1)
        monkeypatch.setattr(parallel.parallel(), "workers", n_workers)
        layer = conv(extra, num_output)
        bottom, top = run_forward(layer, [x])
        top[0].diff[...] = dy_seed.standard_normal(top[0].shape) if not hasattr(run, "dy") \
            else run.dy
        run.dy = top[0].diff.copy()
        layer.backward(top, [True], bottom)
        return (top[0].data.copy(), bottom[0].diff.copy(),
                [b.diff.copy() for b in layer.blobs], layer)

    y1, dx1, dp1, layer = run(1, workers)
    w = layer.blobs[0].data
    b = layer.blobs[1].data if "bias_term: false" not in extra else None
    numpy.testing.assert_allclose(y1, ref_conv(x, w, b, **kw), rtol=1e-10, atol=1e-10)
    y0, dx0, dp0, _ = run(1 << 30, 1)
    numpy.testing.assert_allclose(y1, y0, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(dx1, dx0, rtol=1e-12, atol=1e-12)
    for a, c in zip(dp1, dp0):
        numpy.testing.assert_allclose(a, c, rtol=1e-10, atol=1e-10)


def test_conv_threads_are_deterministic(monkeypatch):
    """Same input twice on two threads with blocks: bitwise the same weight gradient (im2col, or
    the frequency route or Winograd under the fourier_* and winograd_* modes of the fixture)."""
    from poseidon.engine import parallel
    monkeypatch.setattr(Im2colConvCore, "COLUMN_BLOCK_BYTES", 1)
    monkeypatch.setattr(Im2colConvCore, "MIN_CHUNK_CELLS", 1)
    monkeypatch.setattr(parallel.parallel(), "workers", 2)
    x = numpy.random.RandomState(7).standard_normal((9, 3, 6, 6)).astype(numpy.float32)
    grads = []
    for _ in range(2):
        layer = conv("kernel_size: 3 pad: 1", 4, dtype=numpy.float32)
        bottom, top = run_forward(layer, [x], dtype=numpy.float32)
        top[0].diff[...] = 1
        layer.backward(top, [True], bottom)
        grads.append(layer.blobs[0].diff.copy())
    assert numpy.array_equal(grads[0], grads[1])
