"""Softmax, SoftmaxWithLoss, EuclideanLoss and Accuracy, as in Caffe.

Scores are viewed as outer×C×inner around the class axis (outer = product of the axes before it, inner
= of those after); labels are class indices stored as floats, one per (outer, inner) position, truncated
to int as Caffe's static_cast does. Loss layers write a 0-axis top and scale their gradient by
top[0].diff (the loss weight the net put there).
"""
import numpy

from .. import kernels
from ..layer import Layer
from ..registry import register
from .normalization import reuse_buffer

FLT_MIN = float(numpy.finfo(numpy.float32).tiny)   # Caffe clamps p to FLT_MIN before log, any dtype
FULL, VALID, BATCH_SIZE, NONE = 0, 1, 2, 3          # LossParameter.NormalizationMode


def _class_axis(layer, blob, axis):
    """(axis, outer, C, inner) of a score blob around its class axis."""
    try:
        a = blob.canonical_axis(axis)
    except ValueError:
        raise layer.error(f"axis {axis} is out of range for a bottom of shape "
                          f"{tuple(blob.shape)}") from None
    return a, blob.count_range(0, a), blob.shape[a], blob.count_range(a + 1)


def _check_label_count(layer, scores, labels, axis, outer, inner):
    if labels.count != outer * inner:
        raise layer.error(
            f"label bottom of shape {tuple(labels.shape)} holds {labels.count} labels, but scores of "
            f"shape {tuple(scores.shape)} with class axis {axis} need {outer * inner} (one per "
            f"position outside the class axis: outer {outer} x inner {inner}), with integer values "
            f"in [0, {scores.shape[axis]})")


def _check_first_dim(layer, a, b):
    # Caffe's LossLayer::Reshape
    if a.ndim == 0 or b.ndim == 0 or a.shape[0] != b.shape[0]:
        raise layer.error(f"bottoms of shapes {tuple(a.shape)} and {tuple(b.shape)} must have the "
                          f"same first dimension (the batch)")


def _read_labels(layer, blob, outer, inner, classes, ignore):
    """Labels as int (outer, inner), a valid mask (None without ignore_label) and safe indices
    (ignored positions pointing at class 0). Out-of-range labels are an error."""
    xp = layer.xp
    lab = blob.data.reshape(outer, inner).astype(numpy.int64)
    valid = None if ignore is None else lab != ignore
    if xp is not numpy:                   # a negative label, seen unsigned, is >= classes too
        outside = lab.view(numpy.uint64) >= classes
        layer.defer_label_check(outside if valid is None else outside & valid)
        # indices kept in range until the check is read (ignored positions count for nothing)
        return lab, valid, xp.where(outside, 0, lab)
    bad = (lab < 0) | (lab >= classes)
    if valid is not None:
        bad &= valid
    if bool(bad.any()):
        value = blob.data.reshape(outer, inner)[bad][0]
        raise layer.error(f"label {float(value):g} is not a class index in [0, {classes}) (scores "
                          f"have {classes} classes){'' if ignore is None else f' nor the ignore_label {ignore}'}")
    safe = lab if valid is None else xp.where(valid, lab, 0)
    return lab, valid, safe


class DeviceLabelCheck:
    """The label check of a layer on a GPU: a device flag, set by any forward that met a label
    out of range and read by check_deferred (the solver calls it at each display, through
    Net.check_deferred), so a training step does not wait for the device to say that its labels
    were fine. On numpy the forward checks and stops at once (_read_labels)."""

    _bad_labels = None

    def defer_label_check(self, bad):
        if self._bad_labels is None:
            self._bad_labels = bad.any()
        else:
            self.xp.logical_or(self._bad_labels, bad.any(), out=self._bad_labels)

    def check_deferred(self):
        if self._bad_labels is None or not bool(self._bad_labels):
            return
        ignore = "" if self.ignore is None else f" nor the ignore_label {self.ignore}"
        raise self.error(f"a label is not a class index in [0, {self.classes}) (scores have "
                         f"{self.classes} classes){ignore}; on a GPU labels are checked on the "
                         f"device and read at each display, so it came in one of the "
                         f"iterations since the last: check the data's labels")


def _softmax(xp, x3, out3):
    """Softmax over axis 1 of outer×C×inner, stable (the max subtracted); out3 may be x3."""
    m = x3.max(axis=1, keepdims=True)
    xp.subtract(x3, m, out=out3)
    xp.exp(out3, out=out3)
    out3 /= out3.sum(axis=1, keepdims=True)


@register("Softmax")
class SoftmaxLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom, top):
        self.shape3 = _class_axis(self, bottom[0], self.param.softmax_param.axis)[1:]
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        _softmax(self.xp, bottom[0].data.reshape(self.shape3), top[0].data.reshape(self.shape3))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data.reshape(self.shape3)
        dy = top[0].diff.reshape(self.shape3)
        dx = bottom[0].diff.reshape(self.shape3)
        s = (dy * y).sum(axis=1, keepdims=True)   # outer×1×inner
        self.xp.subtract(dy, s, out=dx)
        dx *= y                                    # dx = (dy − Σ_c dy·y)·y


@register("SoftmaxWithLoss")
class SoftmaxWithLossLayer(DeviceLabelCheck, Layer):
    """Multinomial logistic loss of the softmax; optional top[1] = the probabilities (no gradient)."""

    exact_bottoms = 2
    min_tops = 1
    max_tops = 2
    is_loss = True

    def layer_setup(self, bottom, top):
        lp = self.param.loss_param
        self.ignore = int(lp.ignore_label) if lp.HasField("ignore_label") else None
        if not lp.HasField("normalization") and lp.HasField("normalize"):
            self.normalization = VALID if lp.normalize else BATCH_SIZE
        else:
            self.normalization = int(lp.normalization)
        self.prob = None

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def reshape(self, bottom, top):
        scores, labels = bottom
        _check_first_dim(self, scores, labels)
        axis, outer, classes, inner = _class_axis(self, scores, self.param.softmax_param.axis)
        _check_label_count(self, scores, labels, axis, outer, inner)
        self.outer, self.classes, self.inner = outer, classes, inner
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape(scores.shape)
        if self.prob is None or self.prob.shape != scores.shape:
            xp = self.xp
            self.prob = xp.empty(scores.shape, self.dtype)
            self._rows = xp.arange(outer)[:, None]    # index grids for picking p[o, label, i]
            self._cols = xp.arange(inner)[None, :]

    def _normalizer(self, valid_count):
        n = {FULL: self.outer * self.inner, BATCH_SIZE: self.outer, NONE: 1}.get(self.normalization)
        if n is None:   # VALID
            if valid_count is None:
                n = self.outer * self.inner
            else:
                return self.xp.maximum(valid_count, 1).astype(self.dtype)
        return float(max(n, 1))

    def forward(self, bottom, top):
        xp = self.xp
        shape3 = (self.outer, self.classes, self.inner)
        run = kernels.runner_for(bottom[0].data)
        if run is not None:
            self._forward_kernels(run, bottom, top, shape3)
            return
        p3 = self.prob.reshape(shape3)
        _softmax(xp, bottom[0].data.reshape(shape3), p3)
        _, valid, safe = _read_labels(self, bottom[1], self.outer, self.inner, self.classes,
                                      self.ignore)
        picked = p3[self._rows, safe, self._cols]                       # outer×inner
        logp = xp.log(xp.maximum(picked, self.dtype.type(FLT_MIN)))
        if valid is not None:
            logp = xp.where(valid, logp, self.dtype.type(0))
        self._valid, self._safe = valid, safe
        self._norm = self._normalizer(None if valid is None else valid.sum())
        top[0].data[...] = -logp.sum() / self._norm
        if len(top) > 1:
            top[1].data[...] = self.prob

    def _forward_kernels(self, run, bottom, top, shape3):
        """The fused kernels (CuPy): softmax, per-position loss, their sum and the division in 3
        launches, nothing read back. A label that is no class index makes the loss NaN (the
        array path raises instead, which needs the labels on the host)."""
        xp = self.xp
        positions = self.outer * self.inner
        terms = reuse_buffer(self, "_terms_buf", (3, positions), self.dtype, xp)
        sums = reuse_buffer(self, "_sums_buf", (3,), self.dtype, xp)
        self._norm_device = reuse_buffer(self, "_norm_buf", (1,), self.dtype, xp)
        kernels.calls.softmax_loss_forward(run, bottom[0].data, bottom[1].data, self.prob,
                                           terms, sums, top[0].data, self._norm_device, shape3,
                                           self.ignore, self.normalization)
        if len(top) > 1:
            top[1].data[...] = self.prob

    def bad_labels(self):
        """How many labels of the last kernel forward were no class index (what made its loss
        NaN): for whoever finds the NaN to name the cause. Reads the device; 0 after an array
        forward, which raises on such a label instead."""
        sums = getattr(self, "_sums_buf", None)
        return 0 if sums is None else int(sums[2])

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            raise self.error("cannot backpropagate to the label bottom (bottom 1): set "
                             "propagate_down: false for it")
        if not propagate_down[0]:
            return
        run = kernels.runner_for(bottom[0].diff)
        if run is not None:
            kernels.calls.softmax_loss_backward(
                run, self.prob, bottom[1].data, top[0].diff, self._norm_device, bottom[0].diff,
                (self.outer, self.classes, self.inner), self.ignore)
            return
        dx = bottom[0].diff.reshape(self.outer, self.classes, self.inner)
        dx[...] = self.prob.reshape(dx.shape)
        dx[self._rows, self._safe, self._cols] -= 1                       # p − onehot(label)
        if self._valid is not None:
            dx *= self._valid[:, None, :]                                 # ignored: no gradient
        dx *= top[0].diff / self._norm


@register("EuclideanLoss")
class EuclideanLossLayer(Layer):
    """loss = Σ (a − b)² / (2·N), N = the first dimension; gradients ±(a − b)·weight/N."""

    exact_bottoms = 2
    exact_tops = 1
    is_loss = True

    def reshape(self, bottom, top):
        a, b = bottom
        _check_first_dim(self, a, b)
        if a.count != b.count:
            raise self.error(f"bottoms of shapes {tuple(a.shape)} and {tuple(b.shape)} must have "
                             f"the same number of elements per sample")
        top[0].reshape(())
        if getattr(self, "_diff", None) is None or self._diff.shape != a.shape:
            self._diff = self.xp.empty(a.shape, self.dtype)

    def forward(self, bottom, top):
        d = self._diff
        self.xp.subtract(bottom[0].data, bottom[1].data.reshape(d.shape), out=d)
        flat = d.reshape(-1)
        top[0].data[...] = self.xp.dot(flat, flat) / (2.0 * d.shape[0])

    def backward(self, top, propagate_down, bottom):
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                alpha = top[0].diff * self.dtype.type(sign / bottom[i].shape[0])
                self.xp.multiply(self._diff, alpha, out=bottom[i].diff.reshape(self._diff.shape))


@register("Accuracy")
class AccuracyLayer(DeviceLabelCheck, Layer):
    """Fraction of (non-ignored) positions whose true class is among the top_k scores; a class scoring
    >= the true one ranks above it (ties count against). Optional top[1]: accuracy per class (C,)."""

    exact_bottoms = 2
    min_tops = 1
    max_tops = 2

    def layer_setup(self, bottom, top):
        ap = self.param.accuracy_param
        self.top_k = int(ap.top_k)
        self.ignore = int(ap.ignore_label) if ap.HasField("ignore_label") else None

    def allow_force_backward(self, bottom_index):
        return False

    def reshape(self, bottom, top):
        scores, labels = bottom
        axis, outer, classes, inner = _class_axis(self, scores, self.param.accuracy_param.axis)
        _check_label_count(self, scores, labels, axis, outer, inner)
        if not 1 <= self.top_k <= classes:
            raise self.error(f"top_k {self.top_k} must be between 1 and the number of classes "
                             f"({classes}, axis {axis} of scores of shape {tuple(scores.shape)})")
        self.outer, self.classes, self.inner = outer, classes, inner
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape((classes,))

    def forward(self, bottom, top):
        xp = self.xp
        s3 = bottom[0].data.reshape(self.outer, self.classes, self.inner)
        _, valid, safe = _read_labels(self, bottom[1], self.outer, self.inner, self.classes,
                                      self.ignore)
        rows, cols = xp.arange(self.outer)[:, None], xp.arange(self.inner)[None, :]
        true = s3[rows, safe, cols]                                     # outer×inner
        at_least = (s3 >= true[:, None, :]).sum(axis=1)                 # true class included
        correct = at_least <= self.top_k
        if valid is not None:
            correct &= valid
            count = valid.sum()
        else:
            count = self.outer * self.inner
        top[0].data[...] = correct.sum() / xp.maximum(count, 1)       # 0 when nothing counted
        if len(top) > 1:
            flat = safe.reshape(-1)
            seen = xp.bincount(flat, weights=None if valid is None else
                               valid.reshape(-1).astype(self.dtype), minlength=self.classes)
            hit = xp.bincount(flat, weights=correct.reshape(-1).astype(self.dtype),
                              minlength=self.classes)
            top[1].data[...] = hit / xp.maximum(seen, 1)

    def backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            raise self.error("has no gradient: set propagate_down: false for its bottoms")
