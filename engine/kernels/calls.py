"""The layers' entry points to the kernels: one function per layer step, which turns the layer's
arrays and settings into the kernel's C arguments (numpy scalars of the exact C types) and
launches it through `run` (a runner from engine.kernels.runner_for).

Arrays are passed as pointers, so every array here must be C-contiguous: the layers pass blob
data and their own buffers, which are.
"""
import math

import numpy

i32, i64 = numpy.int32, numpy.int64


def _window(geom, out_h, out_w):
    return (i32(out_h), i32(out_w), i32(geom.kh), i32(geom.kw), i32(geom.sh), i32(geom.sw),
            i32(geom.ph), i32(geom.pw))


# ----- pooling ------------------------------------------------------------------------------------
def max_pool_forward(run, x, y, mask, top_mask, geom):
    """y and mask (int32, the argmax per window) from x; top_mask (the optional argmax top, as
    floats) when not None. 1 launch."""
    h, w = x.shape[2:]
    out_h, out_w = y.shape[2:]
    run("max_pool_forward", y.size, x, y, mask, y if top_mask is None else top_mask,
        i32(top_mask is not None), i64(y.size), i32(h), i32(w), *_window(geom, out_h, out_w))


def max_pool_backward(run, dy, mask, dx, geom):
    h, w = dx.shape[2:]
    out_h, out_w = dy.shape[2:]
    run("max_pool_backward", dx.size, dy, mask, dx, i64(dx.size), i32(h), i32(w),
        *_window(geom, out_h, out_w))


def ave_pool_forward(run, x, y, geom):
    h, w = x.shape[2:]
    out_h, out_w = y.shape[2:]
    run("ave_pool_forward", y.size, x, y, i64(y.size), i32(h), i32(w),
        *_window(geom, out_h, out_w))


def ave_pool_backward(run, dy, dx, geom):
    h, w = dx.shape[2:]
    out_h, out_w = dy.shape[2:]
    run("ave_pool_backward", dx.size, dy, dx, i64(dx.size), i32(h), i32(w),
        *_window(geom, out_h, out_w))


# ----- SoftmaxWithLoss ----------------------------------------------------------------------------
def _ignore(ignore_label):
    return i32(ignore_label is not None), i32(0 if ignore_label is None else ignore_label)


def softmax_loss_forward(run, scores, labels, prob, terms, sums, loss, normalizer, shape3,
                         ignore_label, mode):
    """prob (the softmax), loss (a 0-axis array: the normalized loss, NaN if a label is no class
    index) and normalizer (shape (1,), kept for backward); terms (3, positions) and sums (3,)
    are scratch. shape3 = (outer, classes, inner). 3 launches: positions, their sum, the
    division."""
    outer, classes, inner = shape3
    positions = outer * inner
    has, ignore = _ignore(ignore_label)
    run("softmax_loss_forward", positions, scores, labels, prob, terms, i64(positions),
        i32(classes), i32(inner), has, ignore)
    terms.sum(axis=1, out=sums)
    run("softmax_loss_normalize", 1, sums, loss, normalizer, i32(mode), has, i64(outer),
        i64(positions))


def softmax_loss_backward(run, prob, labels, loss_weight, normalizer, dx, shape3, ignore_label):
    """dx = (prob - onehot(label)) * loss_weight / normalizer, 0 where ignored. 1 launch."""
    _, classes, inner = shape3
    has, ignore = _ignore(ignore_label)
    run("softmax_loss_backward", dx.size, prob, labels, loss_weight, normalizer, dx,
        i64(dx.size), i32(classes), i32(inner), has, ignore)


# ----- convolution's columns and GEMM epilogue ----------------------------------------------------
def _conv_geometry(geom):
    return (i32(geom.kh), i32(geom.kw), i32(geom.sh), i32(geom.sw), i32(geom.ph), i32(geom.pw),
            i32(geom.dh), i32(geom.dw))


def im2col(run, x, col, geom, first_row, channel_major=False):
    """col (samples, rows, out_w, group, kh, kw, C/group) from x (samples, C, H, W), output rows
    first_row .. first_row + rows (engine/layers/im2col.py's layout); channel_major: the last
    three axes (C/group, kh, kw), a weight blob's order. 1 launch."""
    c, h, w = x.shape[1:]
    rows, out_w, group = col.shape[1:4]
    run("im2col_nhwc", col.size, x, col, i64(col.size), i32(c), i32(h), i32(w),
        i32(first_row), i32(rows), i32(out_w), i32(group), *_conv_geometry(geom),
        i32(channel_major))


def col2im(run, col, dx, geom, out_h, out_w, channel_major=False):
    """dx (samples, C, H, W) = the adjoint of im2col over all output rows, from columns laid out
    group first, (group, samples * out_h * out_w, kh * kw * C/group) (channel_major: C/group
    before kh, kw): the GEMM's output in the input gradient. 1 launch."""
    c, h, w = dx.shape[1:]
    run("col2im_nhwc", dx.size, col, dx, i64(dx.size), i32(c), i32(h), i32(w), i32(out_h),
        i32(out_w), i32(col.shape[0]), *_conv_geometry(geom), i32(channel_major))


def bias_relu_nchw(run, gemm, bias, out, cell_offset, relu=False, negative_slope=0.0):
    """out (samples, group * per_group, H, W) at cells cell_offset .. of each plane = gemm
    (group, samples * cells, per_group) + bias, ReLU'd with relu. 1 launch."""
    group, cells, per_group = gemm.shape
    samples = out.shape[0]
    plane = out.shape[2] * out.shape[3]
    count = gemm.size
    run("bias_relu_nchw", count, gemm, gemm if bias is None else bias, i32(bias is not None),
        out, i64(count), i32(group), i32(per_group), i64(cells // samples), i64(plane),
        i64(cell_offset), i32(relu), run.real(negative_slope))


def bias_relu_rows(run, y, bias, relu=False, negative_slope=0.0):
    """y (rows, width) += bias, ReLU'd with relu, in place. 1 launch."""
    run("bias_relu_rows", y.size, y, y if bias is None else bias, i32(bias is not None),
        i64(y.size), i32(y.shape[-1]), i32(relu), run.real(negative_slope))


# ----- LRN across channels ------------------------------------------------------------------------
def lrn_forward(run, x, scale, y, size, alpha, beta, k):
    n, c = x.shape[:2]
    run("lrn_forward", x.size, x, scale, y, i64(x.size), i32(c), i64(x.size // (n * c)),
        i32(size), run.real(alpha / size), run.real(k), run.real(beta))


def lrn_backward(run, x, y, scale, dy, dx, size, alpha, beta):
    n, c = x.shape[:2]
    run("lrn_backward", x.size, x, y, scale, dy, dx, i64(x.size), i32(c),
        i64(x.size // (n * c)), i32(size), run.real(2.0 * alpha * beta / size), run.real(beta))


# ----- Eltwise ------------------------------------------------------------------------------------
GROUP = 4   # bottoms a launch (separate pointer arguments)


def _groups(arrays):
    """The arrays in runs of GROUP, each padded with its first array to GROUP pointers:
    (start, used, the GROUP pointers)."""
    for start in range(0, len(arrays), GROUP):
        part = list(arrays[start:start + GROUP])
        yield start, len(part), part + [part[0]] * (GROUP - len(part))


def eltwise_sum(run, y, xs, coeffs):
    for start, used, part in _groups(xs):
        c = list(coeffs[start:start + used]) + [0.0] * (GROUP - used)
        run("eltwise_sum", y.size, y, *part, *(run.real(v) for v in c), i32(used),
            i32(start > 0), i64(y.size))


def eltwise_prod(run, y, xs):
    for start, used, part in _groups(xs):
        run("eltwise_prod", y.size, y, *part, i32(used), i32(start > 0), i64(y.size))


def eltwise_max(run, y, mask, xs):
    """mask: int32, the index of the bottom holding each maximum."""
    for start, used, part in _groups(xs):
        run("eltwise_max", y.size, y, mask, *part, i32(used), i32(start), i32(start > 0),
            i64(y.size))


def eltwise_sum_backward(run, dy, dx, coefficient):
    run("eltwise_sum_backward", dx.size, dy, dx, run.real(coefficient), i64(dx.size))


def eltwise_max_backward(run, dy, mask, dx, bottom):
    run("eltwise_max_backward", dx.size, dy, mask, dx, i32(bottom), i64(dx.size))


def eltwise_prod_backward(run, dy, dx, others):
    """dx = dy * the product of the other bottoms (none: dy itself)."""
    if not others:
        eltwise_sum_backward(run, dy, dx, 1.0)
    for start, used, part in _groups(others):
        run("eltwise_prod_backward", dx.size, dy, dx, *part, i32(used), i32(start > 0),
            i64(dx.size))


# ----- Concat and Slice ---------------------------------------------------------------------------
def concat_copy(run, part, whole, axis, offset, to_whole):
    """Copy part (a block of `whole` along `axis`, starting at index `offset` of that axis) into
    whole (to_whole) or out of it. 1 launch."""
    inner = math.prod(whole.shape[axis + 1:])
    run("concat_copy", part.size, part, whole, i64(part.size), i64(part.shape[axis] * inner),
        i64(whole.shape[axis] * inner), i64(offset * inner), i32(to_whole))


# ----- Dropout ------------------------------------------------------------------------------------
def dropout(run, x, y, draw, threshold, scale, backward=False):
    """y = x * scale where the draw keeps the unit (counter_rng.keep_mask), else 0; backward
    recomputes the same mask. `draw`: a uint64 array (seed, iteration) in the arrays' memory,
    read by the kernel (a graph's replay sees the values written since). 1 launch."""
    run("dropout_backward" if backward else "dropout_forward", x.size, x, y, i64(x.size),
        draw, numpy.uint32(threshold), run.real(scale))
