"""A ReLU run by the layer before it: the Net hands an in-place ReLU that directly follows a
Convolution or InnerProduct to that layer, which applies it in its own output pass.

Why: on a GPU a ReLU is a launch and a read and write of the whole blob each way; in the
convolution's and inner product's fused epilogue (engine/kernels/bias_relu.cu) it costs nothing,
and in their backward the mask joins the pass that reorders the top gradient. On numpy the layer
runs the ReLU's own functions (engine/layers/activation.py) right after its forward and before
its backward, so the CPU does what it did, in the same order.

Only an in-place ReLU (bottom and top the one blob the layer writes alone) with a slope >= 0 is
taken: its output's sign then tells the input's, so backward needs no mask kept from forward.
The ReLU layer stays in the net (its name, its timings row) and does nothing: `absorbed`.
A forward that stops at the absorbing layer (`Forward(end=...)`) returns its top already
rectified.
"""


def absorb_relus(net):
    """Hand every ReLU that can be fused to the layer before it (see the module docstring);
    returns the (layer index, ReLU index) pairs."""
    pairs = []
    for li in range(len(net.layers) - 1):
        layer, relu = net.layers[li], net.layers[li + 1]
        take = getattr(layer, "take_relu", None)
        if relu.type != "ReLU" or take is None or relu.slope < 0.0:
            continue
        tops = net.top_names[li]
        if len(tops) != 1 or net.bottom_names[li + 1] != tops or net.top_names[li + 1] != tops:
            continue
        if take(relu.slope):
            relu.absorbed = True
            pairs.append((li, li + 1))
    return pairs
