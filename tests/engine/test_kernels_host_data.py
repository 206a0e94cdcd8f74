"""The data-moving kernels checked on the CPU through the host build (tests/engine/kernel_host.py):
im2col / col2im against engine/layers/im2col.py's strided view and adjoint, the GEMM epilogue
(bias, ReLU, NCHW) against numpy and through a Convolution, Eltwise, Concat and Slice against
their layers' numpy branch."""
import numpy
import pytest

from poseidon.engine import rng
from poseidon.engine.kernels import calls
from poseidon.engine.layers.im2col import Geometry, nhwc_col2im, nhwc_window_view
from tests.engine import kernel_host
from tests.engine.kernel_host import assert_branches_agree, run_layer

pytestmark = pytest.mark.skipif(kernel_host.compiler() is None,
                                reason="no C++ compiler to build the kernels for the host")
RS = numpy.random.RandomState(5)
F32 = numpy.float32

# (N, C, H, W), Geometry(kh, kw, sh, sw, ph, pw, dh, dw), group
CONVS = [
    ((2, 3, 7, 6), Geometry(3, 3, 1, 1, 1, 1, 1, 1), 1),
    ((1, 4, 9, 8), Geometry(3, 2, 2, 3, 1, 0, 1, 1), 2),     # rectangular, strided
    ((2, 2, 8, 9), Geometry(2, 2, 3, 3, 0, 1, 1, 1), 1),     # stride > kernel
    ((1, 6, 9, 9), Geometry(3, 3, 1, 2, 2, 2, 2, 2), 3),     # dilated, grouped
]


def reference_columns(x, geom, group):
    """The numpy im2col: the padded channels-last copy, then the strided window view."""
    n, c, h, w = x.shape
    out_h, out_w = geom.conv_out(h, w)
    src = numpy.zeros((n, h + 2 * geom.ph, w + 2 * geom.pw, c), x.dtype)
    src[:, geom.ph:geom.ph + h, geom.pw:geom.pw + w] = x.transpose(0, 2, 3, 1)
    return nhwc_window_view(src, geom, out_h, out_w, group, numpy)


@pytest.mark.parametrize("channel_major", [False, True])
@pytest.mark.parametrize("shape,geom,group", CONVS)
def test_im2col_matches_the_window_view(shape, geom, group, channel_major):
    x = RS.standard_normal(shape).astype(F32)
    view = reference_columns(x, geom, group)
    if channel_major:   # (..., kh, kw, C/g) -> (..., C/g, kh, kw)
        view = view.transpose(0, 1, 2, 3, 6, 4, 5)
    run = kernel_host.runner(F32)
    out_h = view.shape[1]
    for r0, r1 in ((0, out_h), (1, out_h), (out_h // 2, out_h // 2 + 1)):   # bands of rows
        col = numpy.full((shape[0], r1 - r0) + view.shape[2:], numpy.nan, F32)
        calls.im2col(run, x, col, geom, r0, channel_major)
        numpy.testing.assert_array_equal(col, view[:, r0:r1])


@pytest.mark.parametrize("shape,geom,group", CONVS)
def test_col2im_is_the_adjoint(shape, geom, group):
    """From the GEMM's group-first layout, against nhwc_col2im of the same columns."""
    n, c, h, w = shape
    cols = reference_columns(numpy.zeros(shape, F32), geom, group)
    out_h, out_w = cols.shape[1:3]
    gemm = RS.standard_normal((group, n * out_h * out_w, cols[0, 0, 0, 0].size)).astype(F32)
    col = gemm.reshape((group, n) + cols.shape[1:3] + cols.shape[4:]).transpose(
        1, 2, 3, 0, 4, 5, 6)
    padded = numpy.empty((n, h + 2 * geom.ph, w + 2 * geom.pw, c), F32)
    nhwc_col2im(col, padded, geom)
    want = padded[:, geom.ph:geom.ph + h, geom.pw:geom.pw + w].transpose(0, 3, 1, 2)
    dx = numpy.full(shape, numpy.nan, F32)
    calls.col2im(kernel_host.runner(F32), gemm, dx, geom, out_h, out_w)
    numpy.testing.assert_allclose(dx, want, rtol=1e-6, atol=1e-6)
    # the same columns with each cell's numbers in the weight's order (C/g, kh, kw)
    major = numpy.ascontiguousarray(gemm.reshape(
        group, -1, geom.kh, geom.kw, c // group).transpose(0, 1, 4, 2, 3)).reshape(gemm.shape)
    dx[...] = numpy.nan
    calls.col2im(kernel_host.runner(F32), major, dx, geom, out_h, out_w, channel_major=True)
    numpy.testing.assert_allclose(dx, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("relu,slope", [(False, 0.0), (True, 0.0), (True, 0.1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_relu_nchw_writes_the_gemm_rows_into_nchw(relu, slope, with_bias):
    m, group, per_group, out_h, out_w, r0, r1 = 2, 3, 2, 5, 4, 1, 4
    cells = (r1 - r0) * out_w
    gemm = RS.standard_normal((group, m * cells, per_group)).astype(F32)
    bias = RS.standard_normal(group * per_group).astype(F32) if with_bias else None
    out = numpy.full((m, group * per_group, out_h, out_w), 9, F32)
    calls.bias_relu_nchw(kernel_host.runner(F32), gemm, bias, out, r0 * out_w, relu, slope)
    want = gemm.reshape(group, m, cells, per_group).transpose(1, 0, 3, 2).reshape(m, -1, cells)
    if with_bias:
        want = want + bias[:, None]
    if relu:
        want = numpy.where(want > 0, want, want * F32(slope))
    got = out.reshape(m, group * per_group, -1)
    numpy.testing.assert_allclose(got[..., r0 * out_w:r1 * out_w], want, rtol=1e-6)
    assert (got[..., :r0 * out_w] == 9).all() and (got[..., r1 * out_w:] == 9).all()


@pytest.mark.parametrize("relu", [False, True])
def test_bias_relu_rows(relu):
    y = RS.standard_normal((5, 7)).astype(F32)
    bias = RS.standard_normal(7).astype(F32)
    want = y + bias
    want = numpy.maximum(want, 0) if relu else want
    calls.bias_relu_rows(kernel_host.runner(F32), y, bias, relu)
    numpy.testing.assert_allclose(y, want, rtol=1e-6)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("bias", ["true", "false"])
@pytest.mark.parametrize("group", [1, 2])
def test_convolution_through_the_layer(bias, group, chunks, monkeypatch):
    """A strided convolution on the im2col route: its GEMM rows written to NCHW with the bias by
    bias_relu_nchw, its input gradient gathered by col2im_nhwc; the batch in one chunk, or one
    sample a chunk (columns past GPU_BLOCK_BYTES)."""
    monkeypatch.setenv("POSEIDON_CONV", "im2col")
    if chunks > 1:
        from poseidon.engine.layers.conv.columns import Im2colConvCore
        monkeypatch.setattr(Im2colConvCore, "GPU_BLOCK_BYTES", 1)
    text = (f'type: "Convolution" convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 '
            f'stride: 2 group: {group} bias_term: {bias} weight_filler {{ type: "gaussian" }} '
            f'bias_filler {{ type: "gaussian" }} }}')
    seeded = []

    def prepare(layer):   # both branches get the same weights
        rng.seed(0)
        seeded.append(layer)

    x = RS.standard_normal((2, 12, 7, 6))   # 3 x 12 floats a window row: past the planar route
    want, want_grads, _, _ = run_layer(text, [x], prepare=prepare)
    got, grads, fwd, bwd = run_layer(text, [x], use_kernels=True, prepare=prepare)
    for a, b in zip(seeded[0].blobs, seeded[1].blobs):
        numpy.testing.assert_array_equal(a.data, b.data)
        numpy.testing.assert_allclose(b.diff, a.diff, rtol=1e-5, atol=1e-6 * abs(a.diff).max())
    # the GEMMs add in another order (the kernel route's columns are channel-major): float32
    # rounding of sums whose terms reach the outputs' largest magnitude
    for a, b in ((got[0], want[0]), (grads[0], want_grads[0])):
        numpy.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * numpy.abs(b).max())
    # the kernel route (engine/layers/conv/kernel_route.py): the whole batch, one launch each
    assert fwd == ["im2col_nhwc", "bias_relu_nchw"] * chunks
    assert bwd == ["im2col_nhwc", "col2im_nhwc"] * chunks


@pytest.mark.parametrize("group", [1, 2])
def test_deconvolution_through_the_kernel_route(group, monkeypatch):
    """Deconvolution runs the convolution's passes transposed: forward the kernel route's input
    gradient (GEMM, col2im), backward its forward (im2col, GEMM, epilogue) and weight gradient
    (im2col again), against its numpy branch."""
    monkeypatch.setenv("POSEIDON_CONV", "im2col")
    text = (f'type: "Deconvolution" convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 '
            f'stride: 2 group: {group} weight_filler {{ type: "gaussian" }} '
            f'bias_filler {{ type: "gaussian" }} }}')
    x = RS.standard_normal((2, 6, 4, 5))
    layers = []

    def prepare(layer):
        rng.seed(0)
        layers.append(layer)

    want, want_grads, _, _ = run_layer(text, [x], prepare=prepare)
    got, grads, fwd, bwd = run_layer(text, [x], use_kernels=True, prepare=prepare)
    pairs = [(got[0], want[0]), (grads[0], want_grads[0])]
    pairs += [(k.diff, n.diff) for k, n in zip(layers[1].blobs, layers[0].blobs)]
    for a, b in pairs:                                    # output, input and parameter gradients
        numpy.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * numpy.abs(b).max())
    assert fwd == ["col2im_nhwc"]
    assert bwd == ["im2col_nhwc", "bias_relu_nchw", "im2col_nhwc"]


@pytest.mark.parametrize("layer_type", ["Convolution", "InnerProduct"])
@pytest.mark.parametrize("slope", [0.0, 0.2])
def test_a_fused_relu_is_the_relu_layer(layer_type, slope, monkeypatch):
    """A layer that runs the ReLU after it (engine/layers/fusion.py) gives, on both branches,
    the layer's own output rectified and gradients through the ReLU's mask."""
    monkeypatch.setenv("POSEIDON_CONV", "im2col")
    param = ("convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2"
             if layer_type == "Convolution" else "inner_product_param { num_output: 5")
    text = (f'type: "{layer_type}" {param} weight_filler {{ type: "gaussian" }} '
            f'bias_filler {{ type: "gaussian" }} }}')
    x = RS.standard_normal((2, 12, 7, 6))
    plain_top, _, _, _ = run_layer(text, [x], prepare=lambda layer: rng.seed(0))
    y = plain_top[0]
    rectified = numpy.where(y > 0, y, y * slope)
    dy = RS.standard_normal(y.shape)
    masked = dy * numpy.where(y > 0, 1.0, slope)
    _, want_grads, _, _ = run_layer(text, [x], prepare=lambda layer: rng.seed(0),
                                    top_diffs=lambda tops: [masked])

    def fused(layer):
        rng.seed(0)
        assert layer.take_relu(slope)

    for kernels_on in (False, True):
        tops, grads, fwd, _ = run_layer(text, [x], prepare=fused, use_kernels=kernels_on,
                                        top_diffs=lambda tops: [dy])
        for a, b in ((tops[0], rectified), (grads[0], want_grads[0])):
            numpy.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * numpy.abs(b).max())
        if kernels_on:   # the ReLU costs no launch of its own
            assert fwd == (["im2col_nhwc", "bias_relu_nchw"] if layer_type == "Convolution"
                           else ["bias_relu_rows"])


# ----- Eltwise ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bottoms", [2, 3, 6])
@pytest.mark.parametrize("op,extra", [("SUM", ""), ("SUM", "coeff"), ("PROD", ""), ("MAX", "")])
def test_eltwise(op, extra, bottoms):
    shape = (2, 3, 4, 5)
    if op == "MAX":   # small integers: ties between bottoms everywhere
        xs = [RS.randint(0, 3, shape) for _ in range(bottoms)]
    else:
        xs = [RS.standard_normal(shape) for _ in range(bottoms)]
    coeffs = " ".join(f"coeff: {c}" for c in RS.uniform(-2, 2, bottoms)) if extra else ""
    name = op.lower()
    forward = -(-bottoms // 4)                                  # four bottoms a launch
    per_bottom = -(-(bottoms - 1) // 4) if op == "PROD" else 1  # PROD: four other bottoms a launch
    assert_branches_agree(
        f'type: "Eltwise" eltwise_param {{ operation: {op} {coeffs} }}', xs,
        exact_tops=op == "MAX", exact_grads=op == "MAX",
        launches=([f"eltwise_{name}"] * forward,
                  [f"eltwise_{name}_backward"] * (per_bottom * bottoms)))


# ----- Concat and Slice ---------------------------------------------------------------------------
@pytest.mark.parametrize("axis,sizes", [(1, (2, 3, 1)), (2, (4, 1)), (0, (1, 2, 2)), (-1, (3, 2))])
def test_concat(axis, sizes):
    base = [2, 3, 4, 5]
    xs = []
    for s in sizes:
        shape = list(base)
        shape[axis] = s
        xs.append(RS.standard_normal(shape))
    assert_branches_agree(f'type: "Concat" concat_param {{ axis: {axis} }}', xs,
                          exact_tops=True, exact_grads=True,
                          launches=(["concat_copy"] * len(xs), ["concat_copy"] * len(xs)))


@pytest.mark.parametrize("axis,points,tops", [(1, "slice_point: 1 slice_point: 4", 3),
                                              (3, "", 3), (0, "slice_point: 1", 2)])
def test_slice(axis, points, tops):
    x = RS.standard_normal((3, 6, 2, 9))
    assert_branches_agree(f'type: "Slice" slice_param {{ axis: {axis} {points} }}', [x],
                          n_tops=tops, exact_tops=True, exact_grads=True,
                          launches=(["concat_copy"] * tops, ["concat_copy"] * tops))
