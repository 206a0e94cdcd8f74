"""A BatchNorm and the Scale run in place on its output, run as one (ResNet's and Inception's pairs).

The two layers stay what they are in Caffe, each independent of the other. When the net is built,
Net._pair_batchnorm_scale finds the pairs (can_pair) and puts, at the two layer indices, the two
members of a BatchNormScalePair: thin layer objects that show their own layer (name, type,
parameters, statistics) and run their step through the pair, which alone holds the state the
two steps share.

Folded (a learned scale, and bias, per channel, after a BatchNorm run in place):
  forward   the BatchNorm's pass over the channels writes the pair's output
              y = scale * (x - mean) / sqrt(var + eps) + bias
            and keeps x - mean (here), not x-hat; the Scale's step then has nothing to do.
  backward  the Scale's step sums dy and dy * x-hat per channel for its own gradients and hands
            the sums on; the BatchNorm's step makes the pair's input gradient from them,
              dx = k * (dy - mean(dy) - mean(dy * x-hat) * x-hat),  k = scale / sqrt(var + eps)
            (Caffe's two formulas, factored), and the Scale writes no input gradient.
Together: four passes over the activations fewer than the two layers apart. A pair that cannot
fold (a scale over other axes, a bias over other axes than the scale, a BatchNorm not in place)
still saves the Scale its copy of the input: its backward reads the BatchNorm's x-hat.

A caller that stops between the two (Net.ForwardLayer(li, alone=True), Net.Forward(end=li))
gets the BatchNorm's own output: unfold writes x-hat into the blob, and the Scale's next forward
scales it as usual.
"""
from ..parallel import split_range
from .normalization import BatchNormLayer, dot_per_dim, reuse_buffer, sum_per_dim
from .scale_bias import ScaleLayer


def can_pair(norm, scale, norm_top, scale_bottom, scale_top):
    """Whether layer `norm`, then layer `scale` (with their blob lists) make a pair: a BatchNorm,
    then a Scale of one bottom that is the BatchNorm's top and that it overwrites (in place)."""
    return (isinstance(norm, BatchNormLayer) and isinstance(scale, ScaleLayer)
            and len(scale_bottom) == 1 and scale_bottom[0] is norm_top[0]
            and scale_top[0] is scale_bottom[0])


class BatchNormScalePair:
    """The state the two steps of a pair share; `members` are the two layer objects a Net runs
    in place of `norm` and `scale`."""

    def __init__(self, norm, scale):
        self.norm, self.scale = norm, scale
        self.folds = False          # decided at each reshape of the Scale's step (_decide_fold)
        self.centred = None         # x - mean of the last folded forward, (N, C, spatial)
        self.holds_centred = False  # the last forward folded: centred, not norm's x-hat, is kept
        self.prescaled = False      # the last forward wrote the pair's output: the Scale's is done
        self.sums = None            # (scale, sum dy, sum dy * x-hat) from the Scale's backward
        self.members = (PairedBatchNorm(self, norm), PairedScale(self, scale))

    # ----- forward --------------------------------------------------------------------------------
    def norm_forward(self, bottom, top):
        """The BatchNorm's step: its own forward, or (folded) the pair's output in its pass."""
        self.sums = None                     # any left belong to an earlier forward
        if not self.folds:
            self.holds_centred = self.prescaled = False
            self.norm.forward(bottom, top)
            return
        norm, scale = self.norm, self.scale
        self.centred = reuse_buffer(self, "centred", norm.shape3, bottom[0].dtype, norm.xp)
        gamma = scale.blobs[0].data.reshape(-1)
        beta = scale.blobs[-1].data.reshape(-1) if scale.bias_term else None
        multiply = norm.xp.multiply

        def write_output(lo, hi, centred, inv_std, top):   # centred stays x - mean
            multiply(centred, (gamma[lo:hi] * inv_std)[:, None], out=top)
            if beta is not None:
                top += beta[lo:hi, None]

        norm.normalize(bottom, top, self.centred, write_output)
        self.holds_centred = self.prescaled = True

    def scale_forward(self, bottom, top):
        """The Scale's step: nothing when the BatchNorm's step wrote the output."""
        if self.prescaled:                   # the BatchNorm's step made the output
            self.prescaled = False
            return
        self.scale.apply(bottom, top)        # no copy of the input: backward reads x-hat

    def unfold(self, top):
        """After a folded forward whose Scale step has not run: the top gets the BatchNorm's
        own output, x-hat, and the Scale's next forward computes its part from it."""
        if self.holds_centred and self.prescaled:
            self._x_hat_into(top[0].data.reshape(self.norm.shape3))
            self.prescaled = False

    def _x_hat_into(self, out):
        """out (N, C, spatial) = x-hat from the folded forward's x - mean, over the cores."""
        xp, inv, centred = self.norm.xp, self.norm.inv_std, self.centred
        split_range(lambda lo, hi: xp.multiply(centred[:, lo:hi], inv[lo:hi, None],
                                               out=out[:, lo:hi]),
                    out.shape[1], out.size, xp)

    def normalized(self):
        """The BatchNorm's x-hat of the last forward, (N, C, spatial); made here from x - mean
        after a folded forward (x_hat_parts avoids that)."""
        if self.holds_centred:
            out = self.norm.xp.empty_like(self.centred)
            self._x_hat_into(out)
            return out
        return self.norm.normalized()

    def x_hat_parts(self):
        """(a, f): the last forward's x-hat is a * f[channel], f None when a is x-hat itself
        (after a folded forward a = x - mean, f = 1 / sqrt(var + eps))."""
        if self.holds_centred:
            return self.centred, self.norm.inv_std
        return self.norm.normalized(), None

    # ----- reshape --------------------------------------------------------------------------------
    def _decide_fold(self, bottom):
        """Folding needs a learned scale (and bias) per channel, and a BatchNorm in place too:
        the blob whose diff the Scale leaves unscaled is then the BatchNorm's bottom as well,
        which the BatchNorm's backward overwrites."""
        norm, scale = self.norm, self.scale
        self.folds = (len(bottom) == 1 and scale.same_axes and scale.layout == norm.shape3
                      and norm.in_place)

    # ----- backward -------------------------------------------------------------------------------
    def scale_backward(self, top, propagate_down, bottom):
        """The Scale's step: its parameter gradients, and (folded) the per-channel sums the
        BatchNorm's step makes the input gradient from, in place of writing one; unfolded, the
        Scale's own backward on the BatchNorm's x-hat."""
        if not (self.folds and propagate_down[0]):
            x = self.normalized().reshape(bottom[0].shape)
            self.scale.gradients(top, propagate_down, bottom, x)
            return
        scale = self.scale
        xp = scale.xp
        d3 = top[0].diff.reshape(scale.layout)
        dim = scale.layout[1]
        a3, f = self.x_hat_parts()
        sum_dy = xp.empty(dim, d3.dtype)
        sum_dy_x = xp.empty(dim, d3.dtype)

        def part(lo, hi):
            sum_dy[lo:hi] = sum_per_dim(d3[:, lo:hi])
            sum_dy_x[lo:hi] = dot_per_dim(xp, d3[:, lo:hi], a3[:, lo:hi])

        split_range(part, dim, d3.size, xp)
        if f is not None:
            sum_dy_x *= f
        if scale.bias_term and scale.param_propagate_down[-1]:
            scale.blobs[-1].diff.reshape(-1)[...] += sum_dy
        if scale.param_propagate_down[0]:
            scale.blobs[0].diff.reshape(-1)[...] += sum_dy_x
        # k = scale / sqrt(var + eps) is taken now, not at the BatchNorm's step: between the two, a
        # caller acting after this layer's backward (a synchronisation) may update the scale in place
        k = scale.blobs[0].data.reshape(-1) * self.norm.inv_std
        self.sums = (k, sum_dy, sum_dy_x)

    def norm_backward(self, top, propagate_down, bottom):
        """The BatchNorm's step: the pair's input gradient from the Scale's sums, or the
        BatchNorm's own when the Scale's step left none."""
        sums, self.sums = self.sums, None
        if not propagate_down[0]:
            return
        if sums is None:                     # no gradient through the Scale's step: norm's own
            a, f = self.x_hat_parts()
            self.norm.input_gradient(top[0].diff, bottom[0].diff, a, f)
            return
        self._pair_input_gradient(top[0].diff, bottom[0].diff, *sums)

    def _pair_input_gradient(self, dy, out, k, sum_dy, sum_dy_xn):
        """The pair's input gradient from the Scale's top gradient dy: with k = scale /
        sqrt(var + eps) per channel, the Scale's dx = scale * dy makes Caffe's BatchNorm formula
        dx = k * (dy - mean(dy) - mean(dy * xn) * xn), whose two means are the Scale's sums: two
        reductions and one pass over the activations fewer than the two layers apart."""
        norm = self.norm
        xp = norm.xp
        n, c, s = norm.shape3
        dy = dy.reshape(norm.shape3)
        out = out.reshape(norm.shape3)             # may be dy itself (in place)
        if norm.use_global_stats:            # dx = scale * dy / sqrt(var + eps)
            split_range(lambda lo, hi: xp.multiply(dy[:, lo:hi], k[lo:hi, None],
                                                   out=out[:, lo:hi]), c, dy.size, xp)
            return
        m = n * s
        c1 = k * (sum_dy / m)
        c2 = k * (sum_dy_xn / m)
        xn, f = self.x_hat_parts()
        if f is not None:                    # x-hat = xn * f
            c2 = c2 * f

        def part(lo, hi):
            o = out[:, lo:hi]
            xp.multiply(dy[:, lo:hi], k[lo:hi, None], out=o)
            o -= c1[lo:hi, None]
            o -= xn[:, lo:hi] * c2[lo:hi, None]

        split_range(part, c, dy.size, xp, run=norm.channel_run())


class _Member:
    """One layer of a pair as the Net runs it: every attribute not defined here, read or
    written, is its layer's (name, type, blobs, param_propagate_down, use_global_stats, ...),
    so that parameters, weights by layer name, per-layer timing and the solver see the layer
    itself; its reshape, forward and backward go through the pair."""

    __slots__ = ("pair", "layer")

    def __init__(self, pair, layer):
        object.__setattr__(self, "pair", pair)
        object.__setattr__(self, "layer", layer)

    def __getattr__(self, name):
        if name in _Member.__slots__:        # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.layer, name)

    def __setattr__(self, name, value):
        if name in _Member.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.layer, name, value)

    def __repr__(self):
        return f"<{type(self).__name__} of {self.layer.type} '{self.layer.name}'>"


class PairedBatchNorm(_Member):
    """The BatchNorm of a pair: its forward may write the Scale's output too (the fold)."""

    __slots__ = ()

    def reshape(self, bottom, top):
        self.layer.reshape(bottom, top)

    def forward(self, bottom, top):
        self.pair.norm_forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        self.pair.norm_backward(top, propagate_down, bottom)


class PairedScale(_Member):
    """The Scale of a pair: it reads its input from the BatchNorm's kept copy, and may leave its
    input gradient to the BatchNorm's step (the fold)."""

    __slots__ = ()

    def reshape(self, bottom, top):
        self.layer.reshape(bottom, top)
        self.pair._decide_fold(bottom)

    def forward(self, bottom, top):
        self.pair.scale_forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        self.pair.scale_backward(top, propagate_down, bottom)
