"""Layers that move data around without learning: Concat, Slice, Split, Flatten, Reshape, Crop, Eltwise.

Caffe semantics (concat_layer.cpp, slice_layer.cpp, split_layer.cpp, flatten_layer.cpp,
reshape_layer.cpp, crop_layer.cpp, eltwise_layer.cpp):
- Concat: along `axis` (default 1, negative counts from the end) or legacy `concat_dim` (not both);
  every other dimension must agree. One bottom: the top shares its data and diff.
- Slice: along `axis` (default 1) or legacy `slice_dim` (not both), at `slice_point`s (one fewer than
  tops, strictly increasing, inside the axis) or in equal parts. One top: shares data and diff.
- Split: every top shares the bottom's data; backward *sums* the tops' diffs into the bottom diff.
- Flatten: axes axis..end_axis (defaults 1, -1) become one; Reshape: `shape` replaces axes
  axis..axis+num_axes-1 (defaults 0, -1; a negative axis counts from the end, -1 = after the last
  axis), 0 copies the bottom's dimension, one -1 is inferred. Both are views: the top shares the
  bottom's data and diff, so forward and backward have nothing to do.
- Crop: bottom[0] cropped to bottom[1]'s size on the axes from `axis` (default 2) on, at `offset`
  (none: 0, one: for every cropped axis, else one per cropped axis). No gradient for bottom[1].
- Eltwise: SUM (default; `coeff` none or one per bottom), PROD, MAX (the first pair's tie goes to
  bottom[1], later ties keep the earlier bottom; the gradient goes to the winner only).
"""
import numpy

from .. import kernels
from ..layer import Layer
from ..registry import register
from ..parallel import split_rows


def _canonical(layer, blob, axis, what="axis"):
    try:
        return blob.canonical_axis(int(axis))
    except ValueError:
        raise layer.error(f"{what} {axis} is out of range for an input of shape {blob.shape} "
                          f"({blob.ndim} axes)") from None


def _alias(top, bottom, shape):
    """Make `top` a view of `bottom` with another shape: data and diff shared (Caffe's
    ShareData/ShareDiff). Blob.share_* keep the source's shape, so the views are set here."""
    top._data = bottom.data.reshape(shape)
    top._diff = bottom.diff.reshape(shape)


def _legacy_axis(layer, blob, has_legacy, legacy, has_axis, axis, legacy_name):
    if has_legacy and has_axis:
        raise layer.error(f"give either axis or the deprecated {legacy_name}, not both")
    if has_legacy:
        if not 0 <= legacy < blob.ndim:
            raise layer.error(f"{legacy_name} {legacy} is out of range for an input of shape "
                              f"{blob.shape}")
        return int(legacy)
    return _canonical(layer, blob, axis)


# ------------------------------------------------------------------------------------------------
@register("Concat")
class ConcatLayer(Layer):
    min_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.concat_param
        if p.HasField("axis") and p.HasField("concat_dim"):
            raise self.error("give either axis or the deprecated concat_dim, not both")

    def reshape(self, bottom, top):
        p = self.param.concat_param
        b0 = bottom[0]
        self.axis = _legacy_axis(self, b0, p.HasField("concat_dim"), p.concat_dim,
                                 p.HasField("axis"), p.axis, "concat_dim")
        shape = list(b0.shape)
        for i, b in enumerate(bottom[1:], 1):
            if b.ndim != b0.ndim or any(b.shape[j] != b0.shape[j]
                                        for j in range(b0.ndim) if j != self.axis):
                raise self.error(f"bottom[{i}] has shape {b.shape} but bottom[0] has {b0.shape}: all "
                                 f"inputs must agree on every axis except the concat axis "
                                 f"{self.axis}")
            shape[self.axis] += b.shape[self.axis]
        if len(bottom) == 1:
            _alias(top[0], b0, b0.shape)
            return
        top[0].reshape(shape)
        lead = (slice(None),) * self.axis
        self._slices, start = [], 0
        for b in bottom:
            end = start + b.shape[self.axis]
            self._slices.append(lead + (slice(start, end),))
            start = end

    def forward(self, bottom, top):
        if len(bottom) == 1:
            return
        y = top[0].data
        run = kernels.runner_for(y)
        for b, sl in zip(bottom, self._slices):
            if run is not None:
                kernels.calls.concat_copy(run, b.data, y, self.axis, sl[-1].start, True)
            else:
                y[sl] = b.data

    def backward(self, top, propagate_down, bottom):
        if len(bottom) == 1:
            return
        dy = top[0].diff
        run = kernels.runner_for(dy)
        for b, sl, down in zip(bottom, self._slices, propagate_down):
            if down and run is not None:
                kernels.calls.concat_copy(run, b.diff, dy, self.axis, sl[-1].start, False)
            elif down:
                b.diff[...] = dy[sl]


# ------------------------------------------------------------------------------------------------
@register("Slice")
class SliceLayer(Layer):
    exact_bottoms = 1
    min_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.slice_param
        if p.HasField("axis") and p.HasField("slice_dim"):
            raise self.error("give either axis or the deprecated slice_dim, not both")
        self.points = [int(s) for s in p.slice_point]
        if self.points and len(self.points) != len(top) - 1:
            raise self.error(f"gives {len(self.points)} slice_point(s) for {len(top)} tops: give "
                             f"one fewer than the tops ({len(top) - 1}) or none for equal parts")
        prev = 0
        for s in self.points:
            if s <= prev:
                raise self.error(f"slice_point values must be strictly increasing and positive, got "
                                 f"{self.points}")
            prev = s

    def reshape(self, bottom, top):
        p = self.param.slice_param
        b = bottom[0]
        self.axis = _legacy_axis(self, b, p.HasField("slice_dim"), p.slice_dim,
                                 p.HasField("axis"), p.axis, "slice_dim")
        size = b.shape[self.axis]
        if self.points:
            if self.points[-1] >= size:
                raise self.error(f"slice_point {self.points[-1]} is outside axis {self.axis} of size "
                                 f"{size} (input shape {b.shape})")
            bounds = [0] + self.points + [size]
        else:
            if size % len(top):
                raise self.error(f"{len(top)} tops do not evenly divide axis {self.axis} of size "
                                 f"{size}: give slice_point values")
            step = size // len(top)
            bounds = [i * step for i in range(len(top) + 1)]
        if len(top) == 1:
            _alias(top[0], b, b.shape)
            return
        lead = (slice(None),) * self.axis
        self._slices = []
        for t, start, end in zip(top, bounds[:-1], bounds[1:]):
            shape = list(b.shape)
            shape[self.axis] = end - start
            t.reshape(shape)
            self._slices.append(lead + (slice(start, end),))

    def forward(self, bottom, top):
        if len(top) == 1:
            return
        x = bottom[0].data
        run = kernels.runner_for(x)
        for t, sl in zip(top, self._slices):
            if run is not None:
                kernels.calls.concat_copy(run, t.data, x, self.axis, sl[-1].start, False)
            else:
                t.data[...] = x[sl]

    def backward(self, top, propagate_down, bottom):
        if len(top) == 1 or not propagate_down[0]:
            return
        dx = bottom[0].diff
        run = kernels.runner_for(dx)
        for t, sl in zip(top, self._slices):
            if run is not None:
                kernels.calls.concat_copy(run, t.diff, dx, self.axis, sl[-1].start, True)
            else:
                dx[sl] = t.diff


# ------------------------------------------------------------------------------------------------
@register("Split")
class SplitLayer(Layer):
    exact_bottoms = 1
    min_tops = 1

    def reshape(self, bottom, top):
        for i, t in enumerate(top):
            if t is bottom[0]:
                raise self.error(f"top[{i}] is its bottom: Split does not work in place")
            t.reshape(bottom[0].shape)
            t.share_data(bottom[0])

    def forward(self, bottom, top):
        pass  # the tops share the bottom's data

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        split_rows(self._backward_rows, [bottom[0].diff] + [t.diff for t in top], self.xp)

    def _backward_rows(self, dx, *dys):
        if len(dys) == 1:
            dx[...] = dys[0]
            return
        self.xp.add(dys[0], dys[1], out=dx)
        for d in dys[2:]:
            dx += d


# ------------------------------------------------------------------------------------------------
@register("Flatten")
class FlattenLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom, top):
        if top[0] is bottom[0]:
            raise self.error("does not work in place: give the top its own name")
        p = self.param.flatten_param
        b = bottom[0]
        start = _canonical(self, b, p.axis)
        end = _canonical(self, b, p.end_axis, "end_axis")
        if end < start:
            raise self.error(f"end_axis {p.end_axis} comes before axis {p.axis} for an input of "
                             f"shape {b.shape}")
        shape = b.shape[:start] + (int(numpy.prod(b.shape[start:end + 1])),) + b.shape[end + 1:]
        _alias(top[0], b, shape)

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass  # the diffs are shared


# ------------------------------------------------------------------------------------------------
@register("Reshape")
class ReshapeLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        dims = [int(d) for d in self.param.reshape_param.shape.dim]
        self.dims = dims
        self.copy_axes = [i for i, d in enumerate(dims) if d == 0]
        inferred = [i for i, d in enumerate(dims) if d == -1]
        bad = [d for d in dims if d < -1]
        if bad:
            raise self.error(f"shape {dims} has {bad[0]}: dimensions must be positive, 0 (copy the "
                             f"bottom's) or -1 (infer)")
        if len(inferred) > 1:
            raise self.error(f"shape {dims} has {len(inferred)} dimensions of -1: at most one can "
                             f"be inferred")
        self.inferred = inferred[0] if inferred else None
        self.constant = int(numpy.prod([d for d in dims if d > 0]))

    def reshape(self, bottom, top):
        if top[0] is bottom[0]:
            raise self.error("does not work in place: give the top its own name")
        p = self.param.reshape_param
        b = bottom[0]
        nd = b.ndim
        start = p.axis if p.axis >= 0 else nd + p.axis + 1
        if not 0 <= start <= nd:
            raise self.error(f"axis {p.axis} is out of range for an input of shape {b.shape}")
        if p.num_axes < -1:
            raise self.error(f"num_axes must be >= 0, or -1 for all; got {p.num_axes}")
        end = nd if p.num_axes == -1 else start + p.num_axes
        if end > nd:
            raise self.error(f"axis {p.axis} + num_axes {p.num_axes} goes past the {nd} axes of the "
                             f"input of shape {b.shape}")
        shape = list(b.shape[:start]) + list(self.dims) + list(b.shape[end:])
        for i in self.copy_axes:
            if start + i >= nd:
                raise self.error(f"shape {self.dims} has a 0 at position {i} but the input of shape "
                                 f"{b.shape} has no axis {start + i} to copy")
            shape[start + i] = b.shape[start + i]
        if self.inferred is not None:
            known = self.constant * b.count_range(0, start) * b.count_range(end)
            for i in self.copy_axes:
                known *= shape[start + i]
            if known == 0 or b.count % known:
                raise self.error(f"cannot infer the -1 in shape {self.dims}: the input's "
                                 f"{b.count} elements (shape {b.shape}) are not a multiple of the "
                                 f"other dimensions' product {known}")
            shape[start + self.inferred] = b.count // known
        if int(numpy.prod(shape)) != b.count:
            raise self.error(f"shape {tuple(shape)} holds {int(numpy.prod(shape))} elements but the "
                             f"input of shape {b.shape} has {b.count}: give reshape_param a "
                             f"shape of {b.count} elements (0 copies an axis, -1 infers one)")
        _alias(top[0], b, tuple(shape))

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass  # the diffs are shared


# ------------------------------------------------------------------------------------------------
@register("Crop")
class CropLayer(Layer):
    exact_bottoms = 2
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.crop_param
        nd = bottom[0].ndim
        self.start = _canonical(self, bottom[0], p.axis)
        self.offsets = [int(o) for o in p.offset]
        if len(self.offsets) > 1 and self.start + len(self.offsets) != nd:
            raise self.error(f"gives {len(self.offsets)} offsets for the {nd - self.start} axes "
                             f"from axis {self.start} of the {nd}-axis input: give one offset, or "
                             f"one per cropped axis")

    def reshape(self, bottom, top):
        a, ref = bottom
        if ref.ndim < a.ndim:
            raise self.error(f"bottom[1] (shape {ref.shape}) has fewer axes than bottom[0] "
                             f"(shape {a.shape})")
        shape, sl = list(a.shape), []
        for i in range(a.ndim):
            if i < self.start:
                sl.append(slice(None))
                continue
            off = 0
            if len(self.offsets) == 1:
                off = self.offsets[0]
            elif self.offsets:
                off = self.offsets[i - self.start]
            size = ref.shape[i]
            if a.shape[i] - off < size:
                raise self.error(f"the crop of axis {i} to size {size} at offset {off} does not fit "
                                 f"in bottom[0]'s size {a.shape[i]} (shape {a.shape})")
            shape[i] = size
            sl.append(slice(off, off + size))
        self._slices = tuple(sl)
        top[0].reshape(shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data[self._slices]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            dx = bottom[0].diff
            dx.fill(0)
            dx[self._slices] = top[0].diff
        if propagate_down[1]:
            bottom[1].diff.fill(0)  # only its shape is used


# ------------------------------------------------------------------------------------------------
@register("Eltwise")
class EltwiseLayer(Layer):
    min_bottoms = 2
    exact_tops = 1

    PROD, SUM, MAX = 0, 1, 2

    def layer_setup(self, bottom, top):
        p = self.param.eltwise_param
        self.op = int(p.operation)
        coeffs = [float(c) for c in p.coeff]
        if coeffs and len(coeffs) != len(bottom):
            raise self.error(f"gives {len(coeffs)} coeff values for {len(bottom)} bottoms: give one "
                             f"per bottom (or none)")
        if coeffs and self.op == self.PROD:
            raise self.error("coeff is only for operation SUM, not PROD")
        self.coeffs = coeffs or [1.0] * len(bottom)

    def reshape(self, bottom, top):
        b0 = bottom[0]
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != b0.shape:
                raise self.error(f"bottom[{i}] has shape {b.shape} but bottom[0] has {b0.shape}: "
                                 f"all inputs must have the same shape")
        if any(top[0] is b for b in bottom):
            raise self.error("does not work in place: give the top its own name")
        top[0].reshape(b0.shape)
        if self.op == self.MAX:
            # the fused kernels write an int32 mask; the array path's takes the fewest bytes
            dt = (numpy.uint8 if len(bottom) < 256 and kernels.runner_for(b0.data) is None
                  else numpy.int32)
            m = getattr(self, "_mask", None)
            if m is None or m.shape != b0.shape or m.dtype != dt:
                self._mask = self.xp.empty(b0.shape, dt)

    def forward(self, bottom, top):
        """One range of samples per core (split_rows)."""
        run = kernels.runner_for(top[0].data)
        if run is not None:   # fused: one launch per four bottoms
            y, xs = top[0].data, [b.data for b in bottom]
            if self.op == self.SUM:
                kernels.calls.eltwise_sum(run, y, xs, self.coeffs)
            elif self.op == self.PROD:
                kernels.calls.eltwise_prod(run, y, xs)
            else:
                kernels.calls.eltwise_max(run, y, self._mask, xs)
            return
        arrays = [top[0].data] + [b.data for b in bottom]
        if self.op == self.MAX:
            arrays.append(self._mask)
        split_rows(self._forward_rows, arrays, self.xp)

    def _forward_rows(self, y, *xs):
        xp = self.xp
        if self.op == self.SUM:
            for i, (x, c) in enumerate(zip(xs, self.coeffs)):
                if i == 0:
                    if c == 1:
                        xp.copyto(y, x)
                    else:
                        xp.multiply(x, c, out=y)
                elif c == 1:
                    y += x
                else:
                    y += c * x
        elif self.op == self.PROD:
            xp.multiply(xs[0], xs[1], out=y)
            for x in xs[2:]:
                y *= x
        else:
            *xs, mask = xs
            a, b = xs[0], xs[1]
            # Caffe: a > b picks bottom 0, otherwise (ties included) bottom 1; a later bottom
            # wins only when strictly greater than the running maximum.
            xp.less_equal(a, b, out=mask)
            xp.maximum(a, b, out=y)
            for k, d in enumerate(xs[2:], 2):
                xp.copyto(mask, k, where=d > y)
                xp.maximum(y, d, out=y)

    def backward(self, top, propagate_down, bottom):
        run = kernels.runner_for(top[0].diff)
        for i, b in enumerate(bottom):
            if not propagate_down[i]:
                continue
            if run is not None:
                self._backward_kernel(run, i, b.diff, top[0].diff, bottom)
                continue
            if self.op == self.SUM:
                arrays = [b.diff, top[0].diff]
            elif self.op == self.PROD:
                arrays = [b.diff, top[0].diff] + [o.data for j, o in enumerate(bottom) if j != i]
            else:
                arrays = [b.diff, top[0].diff, self._mask]
            split_rows(lambda dx, dy, *rest, i=i: self._backward_rows(i, dx, dy, rest), arrays,
                       self.xp)

    def _backward_kernel(self, run, i, dx, dy, bottom):
        """Bottom i's gradient with the fused kernels: one launch (PROD: per four others)."""
        if self.op == self.SUM:
            kernels.calls.eltwise_sum_backward(run, dy, dx, self.coeffs[i])
        elif self.op == self.PROD:
            kernels.calls.eltwise_prod_backward(run, dy, dx,
                                                [o.data for j, o in enumerate(bottom) if j != i])
        else:
            kernels.calls.eltwise_max_backward(run, dy, self._mask, dx, i)

    def _backward_rows(self, i, dx, dy, rest):
        xp = self.xp
        if self.op == self.SUM:
            c = self.coeffs[i]
            if c == 1:
                xp.copyto(dx, dy)
            else:
                xp.multiply(dy, c, out=dx)
        elif self.op == self.PROD:
            # product of the other bottoms (no division: right with zeros too)
            xp.multiply(dy, rest[0], out=dx)
            for o in rest[1:]:
                dx *= o
        else:
            xp.multiply(dy, rest[0] == i, out=dx)
