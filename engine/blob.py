"""Blob: the data and the gradient (diff) of one N-d array, as in Caffe and pycaffe."""
import numpy


class Blob:
    """Holds `data` and `diff` arrays of one shape on one array module.

    Reshaping keeps the storage when the element count does not grow, as Caffe's Blob does, so a net
    allocates its buffers once and reuses them across iterations.

    `diff_fresh`: True while the diff holds the zeros the net's ClearParamDiffs wrote and no layer
    has written it since (set only for parameters one layer owns alone; see Net). A layer may then
    write its gradient over the diff instead of adding it into a scratch copy first: one pass over
    the weight instead of three (InnerProduct's 151 MB weights in fc_heavy and AlexNet).
    """

    diff_fresh = False
    _flat = None          # the FlatParams whose buffers this blob is a view of (engine/flat_params.py)
    _left_flat = None     # the FlatParams this blob left when `place` moved it

    def __init__(self, shape=(), dtype=numpy.float32, xp=numpy):
        self.xp = xp
        self.dtype = numpy.dtype(dtype)
        self._data = None
        self._diff = None
        self.reshape(*shape)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"blob shape {shape} has a negative dimension")
        if self._data is not None and self._data.shape == shape:
            return
        count = int(numpy.prod(shape)) if shape else 1
        if self._flat is not None and count != self._data.size:
            self._flat.resize(self, shape, count)   # lays the flat buffers out again
            return
        if self._data is None or self._data.size < count:
            try:
                self._flat_data = self.xp.zeros(count, self.dtype)
                self._flat_diff = self.xp.zeros(count, self.dtype)
            except (MemoryError, ValueError) as e:
                from .errors import ModelError
                raise ModelError(f"cannot allocate a blob of shape {shape} "
                                 f"({count * self.dtype.itemsize * 2 / 2**30:.1f} GiB with its "
                                 f"gradient): {e}; check the sizes in the model") from None
        self._data = self._flat_data[:count].reshape(shape)
        self._diff = self._flat_diff[:count].reshape(shape)

    def reshape_like(self, other):
        self.reshape(other.shape)

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data[...] = value

    @property
    def diff(self):
        return self._diff

    @diff.setter
    def diff(self, value):
        self._diff[...] = value

    def share_data(self, other):
        """Point this blob's data at other's storage (Split and in-place views)."""
        self._data = other._data

    def share_diff(self, other):
        self._diff = other._diff

    def place(self, data, diff):
        """Keep data and diff in the given flat arrays from now on (e.g. memory shared with
        another process that reads or writes them), without copying: the caller makes sure they
        hold what they should. Blobs that shared this one's storage must then `follow` it."""
        count = self._data.size
        if data.size != count or diff.size != count:
            raise ValueError(f"cannot place a blob of {count} elements in arrays of "
                             f"{data.size} and {diff.size}")
        if self._flat is not None:
            self._left_flat = self._flat
        self._use(data, diff)

    def shares_storage_with(self, other):
        return self._flat_data is other._flat_data

    @property
    def storage(self):
        """The flat array this blob's data is a view of (blobs sharing storage give the same)."""
        return self._flat_data

    def take_flat(self, flat, data, diff):
        """Become a view of `data` and `diff`, slices of the flat buffers of `flat` (a
        FlatParams), keeping this blob's shape."""
        self._use(data, diff)
        self._flat = flat

    def forget_flat(self, shape, count):
        """Before `flat.resize` re-lays the buffers out: take this new shape, on storage of its
        own until the new layout gives it a view."""
        self._flat = None
        self._flat_data = self.xp.zeros(count, self.dtype)
        self._flat_diff = self.xp.zeros(count, self.dtype)
        self._data = self._flat_data.reshape(shape)
        self._diff = self._flat_diff.reshape(shape)

    def in_flat_params(self, flat):
        """True while this blob is a view of `flat`'s buffers, False once `place` moved it out
        of them, None if it never was."""
        if self._flat is flat:
            return True
        return False if self._left_flat is flat else None

    def follow(self, other):
        """Use other's storage again, keeping this blob's own shape (a weight-sharing blob,
        after `place` moved the owner's storage)."""
        self._use(other._flat_data, other._flat_diff)

    def _use(self, flat_data, flat_diff):
        """Take flat storage, keeping this blob's shape (its first elements)."""
        count, shape = self._data.size, self._data.shape
        self._flat = None           # whoever hands it storage says whether it is a flat view
        self._flat_data, self._flat_diff = flat_data, flat_diff
        self._data = flat_data[:count].reshape(shape)
        self._diff = flat_diff[:count].reshape(shape)

    def share(self, other):
        """Share data and diff storage with another blob (weight sharing by `param { name }`)."""
        self._flat_data, self._flat_diff = other._flat_data, other._flat_diff
        self._data, self._diff = other._data, other._diff
        self._flat = None

    @property
    def shape(self):
        return self._data.shape

    @property
    def count(self):
        return int(self._data.size)

    @property
    def ndim(self):
        return self._data.ndim

    def _legacy(self, i):
        shape = self.shape
        if len(shape) > 4:
            raise ValueError("num/channels/height/width are defined only for blobs of at most 4 axes")
        padded = (1,) * 0 + tuple(shape) + (1,) * (4 - len(shape))
        return padded[i]

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    def canonical_axis(self, axis):
        """Caffe's CanonicalAxisIndex: negative axes count from the end."""
        n = self.ndim
        if not -n <= axis < max(n, 1):
            raise ValueError(f"axis {axis} out of range for a blob of {n} axes {self.shape}")
        return axis + n if axis < 0 else axis

    def count_range(self, start, end=None):
        shape = self.shape[start:end]
        return int(numpy.prod(shape)) if shape else 1

    def __repr__(self):
        return f"Blob(shape={self.shape}, dtype={self.dtype.name})"
