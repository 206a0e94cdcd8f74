"""One flat buffer for all of a net's parameters, one for their gradients, one per solver history.

Why: an update that walks the parameters blob by blob pays a kernel launch (or a Python call)
per blob and per pass of the rule; a distributed sync of layer l wants its parameters as one
contiguous range, and clearing the gradients wants one fill. So every learnable blob's `data` and
`diff` are views of slices of two flat buffers, laid out in backward order, as DDP lays out its
buckets: the last layer's parameters first, each layer's parameters one contiguous range (in the
order of its blobs), so the layer whose backward finishes first owns the first range.

    flat = FlatParams(net)          # done by the Solver at set-up; net.flat = flat
    flat.data, flat.diff            # 1-D arrays; blob.data is a view of flat.data[a:b]
    flat.layer_range(li)            # (start, stop) of layer li's parameters
    flat.attach_history(2)          # the rule's history: flat buffers, views per blob

A blob whose element count changes is re-laid out: new buffers, the other blobs' values,
gradients and history copied over, every view re-made. A blob moved elsewhere by `Blob.place`
(a KV server's shared memory) leaves the layout: `in_layout(pid)` says so, and callers update
it on its own. A Python layer's parameters never join it (user code may keep their arrays).
"""
import numpy

from .backend import get_array_module


class SliceMults:
    """The lr_mult and decay_mult of each slice of a flat range: slice k covers elements
    offsets[k] to offsets[k + 1] (relative to the range's start). A fused kernel finds an
    element's slice from the offsets; the numpy path walks `runs()` of equal multipliers."""

    __slots__ = ("offsets", "lr_mult", "decay_mult", "_device")

    def __init__(self, offsets, lr_mult, decay_mult):
        if len(offsets) != len(lr_mult) + 1 or len(lr_mult) != len(decay_mult):
            raise ValueError(f"{len(offsets)} offsets need {len(offsets) - 1} multipliers each, "
                             f"got {len(lr_mult)} lr_mult and {len(decay_mult)} decay_mult")
        self.offsets = tuple(int(o) for o in offsets)
        self.lr_mult = tuple(float(m) for m in lr_mult)
        self.decay_mult = tuple(float(m) for m in decay_mult)
        self._device = {}       # the device copies a fused kernel reads, by (device, dtype)

    @classmethod
    def single(cls, count, lr_mult=1.0, decay_mult=1.0):
        return cls((0, int(count)), (lr_mult,), (decay_mult,))

    @property
    def size(self):
        return self.offsets[-1]

    def runs(self):
        """(start, stop, lr_mult, decay_mult) over maximal runs of slices with equal multipliers."""
        out = []
        for k, (lr, dm) in enumerate(zip(self.lr_mult, self.decay_mult)):
            lo, hi = self.offsets[k], self.offsets[k + 1]
            if out and out[-1][2:] == (lr, dm) and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi, lr, dm)
            elif hi > lo:
                out.append((lo, hi, lr, dm))
        return out

    def on_device(self, xp, dtype, device_key):
        """(offsets, lr_mult, decay_mult) as device arrays (int64, dtype, dtype), made once."""
        key = (device_key, numpy.dtype(dtype).str)
        arrays = self._device.get(key)
        if arrays is None:
            arrays = self._device[key] = (xp.asarray(numpy.array(self.offsets, numpy.int64)),
                                          xp.asarray(numpy.array(self.lr_mult, dtype)),
                                          xp.asarray(numpy.array(self.decay_mult, dtype)))
        return arrays

    def __repr__(self):
        return f"SliceMults({len(self.lr_mult)} slices over {self.size} elements)"


class FlatParams:
    """The flat data, diff and history buffers of a net's learnable parameters (see the module
    docstring). Built once the parameters have their initial values: the values are copied in."""

    def __init__(self, net):
        self.net = net
        self.xp, self.dtype = net.xp, numpy.dtype(net.dtype)
        params, specs = net.learnable_params, net.learnable_param_specs
        # a Python layer's parameters keep their own arrays: user code may hold on to them
        self.apart = [pid for pid in range(len(params))
                      if getattr(net.layers[specs[pid].layer_index], "type", None) == "Python"]
        # backward order: the last layer's parameters first, a layer's blobs in their own order
        self.order = sorted((pid for pid in range(len(params)) if pid not in self.apart),
                            key=lambda pid: (-specs[pid].layer_index, pid))
        self.num_state = 0
        self.history = []          # flat history buffers, one per rule state
        self.param_history = [[] for _ in params]   # per parameter: views of the history
        self.data = self.diff = None
        self._counts = {pid: params[pid].count for pid in self.order}
        self._layout(sharers=self._find_sharers())

    # ----- layout --------------------------------------------------------------------------------
    def _find_sharers(self):
        """For each parameter, the other blobs of the net that view its storage (a parameter
        shared by name with another shape)."""
        params = self.net.learnable_params
        out = {pid: [] for pid in self.order}
        storage = {id(params[pid].storage): pid for pid in self.order}
        for layer in self.net.layers:
            for b in layer.blobs:
                pid = storage.get(id(b.storage))
                if pid is not None and b is not params[pid] and b not in out[pid]:
                    out[pid].append(b)
        return out

    def _layout(self, sharers, fresh=()):
        """Allocate the buffers for self._counts, copy the parameters' contents in (zeros for
        the parameters in `fresh`, whose size changed) and make every blob a view. A parameter
        placed elsewhere keeps its data and diff there; its history stays in the buffers."""
        params = self.net.learnable_params
        self.offsets, off = {}, 0
        for pid in self.order:
            self.offsets[pid] = off
            off += self._counts[pid]
        self.size = off
        old_history = [list(h) for h in self.param_history]
        data, diff = self._zeros(), self._zeros()
        self.history = [self._zeros() for _ in range(self.num_state)]
        for pid in self.order:
            a, b = self.param_range(pid)
            if pid in fresh:
                continue
            if params[pid].in_flat_params(self) is not False:
                data[a:b] = params[pid].data.reshape(-1)
                diff[a:b] = params[pid].diff.reshape(-1)
            for h, old in zip(self.history, old_history[pid]):
                h[a:b] = old.reshape(-1)
        self.data, self.diff = data, diff
        self._mults = {}
        for pid in self.order:
            self._attach(pid, sharers.get(pid, ()))

    def _zeros(self):
        return self.xp.zeros(max(self.size, 1), self.dtype)[:self.size]

    def _attach(self, pid, sharers):
        blob = self.net.learnable_params[pid]
        a, b = self.param_range(pid)
        self.param_history[pid][:] = [h[a:b].reshape(blob.shape) for h in self.history]
        if blob.in_flat_params(self) is False:
            return                  # moved elsewhere (Blob.place): its values stay there
        blob.take_flat(self, self.data[a:b], self.diff[a:b])
        for other in sharers:
            other.follow(blob)

    def resize(self, blob, shape, count):
        """Blob.reshape of a parameter to another element count: lay every buffer out again."""
        pid = next(p for p in self.order if self.net.learnable_params[p] is blob)
        sharers = self._find_sharers()
        blob.forget_flat(shape, count)
        self._counts[pid] = count
        self._layout(sharers, fresh={pid})

    def attach_history(self, num_state):
        """Flat history buffers for a rule of `num_state` arrays per parameter (zeros); returns
        the per-parameter views, Caffe's history_ (a list per parameter, in rule order). The
        values and gradients stay where they are."""
        self.num_state = int(num_state)
        self.history = [self._zeros() for _ in range(self.num_state)]
        params = self.net.learnable_params
        for pid in self.order:
            a, b = self.param_range(pid)
            self.param_history[pid][:] = [h[a:b].reshape(params[pid].shape) for h in self.history]
        for pid in self.apart:
            self.param_history[pid][:] = [self.xp.zeros(params[pid].shape, self.dtype)
                                          for _ in range(self.num_state)]
        return self.param_history

    # ----- ranges -------------------------------------------------------------------------------
    def in_layout(self, pid):
        return self.net.learnable_params[pid].in_flat_params(self) is True

    def has_range(self, pid):
        """Whether parameter pid has a range in the buffers (kept for it even while `place`
        holds it elsewhere); a Python layer's parameters have none."""
        return pid in self.offsets

    def param_range(self, pid):
        a = self.offsets[pid]
        return a, a + self._counts[pid]

    def layer_range(self, li):
        """(start, stop) of layer li's own parameters ((0, 0) for a layer that owns none)."""
        specs = self.net.learnable_param_specs
        mine = [pid for pid in self.order if specs[pid].layer_index == li]
        if not mine:
            return 0, 0
        return self.offsets[mine[0]], self.param_range(mine[-1])[1]

    def runs(self, pids):
        """The parameters `pids` as contiguous ranges of the flat buffers, in flat order:
        ([(start, stop), ...], [pids outside the layout])."""
        ranges = []
        outside = [pid for pid in pids if not self.has_range(pid)]
        for pid in sorted((pid for pid in pids if self.has_range(pid)),
                          key=self.offsets.__getitem__):
            if not self.in_layout(pid):
                outside.append(pid)
                continue
            a, b = self.param_range(pid)
            if ranges and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], b)
            else:
                ranges.append((a, b))
        return ranges, outside

    def mults(self, start, stop):
        """SliceMults of the range [start, stop) (made once per range and layout)."""
        cached = self._mults.get((start, stop))
        if cached is None:
            specs = self.net.learnable_param_specs
            offsets, lr, dm = [0], [], []
            for pid in self.order:
                a, b = self.param_range(pid)
                if a >= start and b <= stop and b > a:
                    offsets.append(b - start)
                    lr.append(specs[pid].lr_mult)
                    dm.append(specs[pid].decay_mult)
            if offsets[-1] != stop - start:
                raise ValueError(f"[{start}, {stop}) does not cover whole parameters")
            cached = self._mults[(start, stop)] = SliceMults(offsets, lr, dm)
        return cached

    def clear_diffs(self, blobs=None):
        """Zero the gradients of `blobs` (default: all): one fill per contiguous range."""
        params = self.net.learnable_params
        if blobs is None:
            pids = range(len(params))
        else:
            index = {id(b): pid for pid, b in enumerate(params)}
            pids = [index[id(b)] for b in blobs if id(b) in index]
            for b in blobs:
                if id(b) not in index:
                    b.diff[...] = 0
        ranges, outside = self.runs(pids)
        for a, b in ranges:
            self.diff[a:b].fill(0)
        for pid in outside:
            params[pid].diff[...] = 0

    def __repr__(self):
        xp = get_array_module(self.data)
        return (f"FlatParams({len(self.order)} parameters, {self.size} elements, "
                f"{xp.__name__}, {self.num_state} history buffers)")
