"""The layer contract (Caffe's): setup once, then reshape, forward and backward every iteration.

A layer owns its learnable parameter blobs (`self.blobs`); backward *adds* parameter gradients into
their diffs (the solver clears them each iteration) and *overwrites* bottom diffs. Subclasses declare
their blob counts as class attributes, which `setup` checks in one place, and register themselves
with `@register("TypeName")` beside their class.
"""
import numpy

from .blob import Blob
from .errors import LayerError
from . import fillers

TRAIN, TEST = 0, 1

class Layer:
    """Base class. Override `layer_setup`, `reshape`, `forward`, `backward` (Caffe's four methods)."""

    type = None
    exact_bottoms = None   # an int, or None for "any"
    min_bottoms = None
    max_bottoms = None
    exact_tops = None
    min_tops = None
    max_tops = None
    equal_bottoms_tops = False
    is_loss = False        # LossLayer: top[0] gets loss_weight 1 unless told otherwise
    # InnerProduct-like layers set this and implement sufficient_factors() and
    # weight_grad_from_factors(), for a caller that makes the weight gradient from the factors
    # (the solver's factored update, or a sufficient-factor scheme); see inner_product.py.
    has_sufficient_factors = False
    # BatchNorm-like layers set this: their blobs are running statistics, not learned parameters
    stores_statistics = False
    # data layers set this: the samples of a batch they make
    batch_size = None
    # user-written layers set this: their code may hold the parameter arrays it was given, so
    # whoever places parameters elsewhere (a server's shared memory) must leave them where they are
    holds_param_arrays = False

    def __init__(self, param, phase=TRAIN, dtype=numpy.float32, xp=numpy):
        self.param = param
        self.name = param.name
        self.phase = phase
        self.dtype = numpy.dtype(dtype)
        self.xp = xp
        self.blobs = []                  # learnable (or stored) parameter blobs
        self.param_propagate_down = []   # per blob: compute its gradient?
        self.loss_weights = []

    def gemm_dims(self, bottom):
        """(M, N, K) of the layer's product with its first blob, for a cost model: M outputs and
        N inputs per sample (the first blob's rows and the rest), K samples (the first bottom's
        first axis). Layers with another layout (InnerProduct's axis) say so themselves."""
        first = self.blobs[0]
        M = int(first.shape[0]) if first.shape else 1
        K = int(bottom[0].shape[0]) if bottom and bottom[0].shape else 1
        return M, int(first.count // max(M, 1)), K

    # ----- the contract -------------------------------------------------------------------------
    def setup(self, bottom, top):
        """Check blob counts, set up, shape the tops and record loss weights. Not for overriding."""
        self._check_counts(bottom, top)
        self.layer_setup(bottom, top)
        self.reshape(bottom, top)
        self._set_loss_weights(top)
        while len(self.param_propagate_down) < len(self.blobs):
            self.param_propagate_down.append(True)

    def layer_setup(self, bottom, top):
        """One-time set-up: read parameters, create learnable blobs."""

    def reshape(self, bottom, top):
        raise NotImplementedError

    def forward(self, bottom, top):
        raise NotImplementedError

    def backward(self, top, propagate_down, bottom):
        """Gradients: bottom diffs overwritten where propagate_down[i]; parameter diffs accumulated."""

    def plan_backward(self, weight_grad, input_grad):
        """Told by the net once it is built: whether backward will be asked for parameter
        gradients and for input gradients. Most layers need not know; one that picks its
        algorithm by timing it (Convolution) times what will run."""

    def allow_force_backward(self, bottom_index):
        return True

    # ----- helpers for subclasses ---------------------------------------------------------------
    def error(self, message):
        return LayerError(self, message)

    def new_blob(self, shape=()):
        return Blob(shape, self.dtype, self.xp)

    def add_param(self, shape, filler_param=None, fill_value=None):
        """Create a learnable blob, filled by a FillerParameter (or a constant)."""
        blob = self.new_blob(shape)
        if filler_param is not None:
            blob.data[...] = fillers.fill(filler_param, blob.shape, self.xp, self.dtype)
        elif fill_value is not None:
            blob.data[...] = fill_value
        self.blobs.append(blob)
        return blob

    def _check_counts(self, bottom, top):
        def check(what, n, exact, lo, hi):
            if exact is not None and n != exact:
                raise self.error(f"takes {exact} {what} blob(s), got {n}")
            if lo is not None and n < lo:
                raise self.error(f"takes at least {lo} {what} blob(s), got {n}")
            if hi is not None and n > hi:
                raise self.error(f"takes at most {hi} {what} blob(s), got {n}")

        check("bottom", len(bottom), self.exact_bottoms, self.min_bottoms, self.max_bottoms)
        check("top", len(top), self.exact_tops, self.min_tops, self.max_tops)
        if self.equal_bottoms_tops and len(bottom) != len(top):
            raise self.error(f"needs as many tops as bottoms, got {len(bottom)} bottoms "
                             f"and {len(top)} tops")

    def _set_loss_weights(self, top):
        weights = list(self.param.loss_weight)
        if weights and len(weights) != len(top):
            raise self.error(f"gives {len(weights)} loss_weight values for {len(top)} tops: "
                             f"give one per top")
        if not weights:
            weights = [1.0 if (self.is_loss and i == 0) else 0.0 for i in range(len(top))]
        self.loss_weights = weights
