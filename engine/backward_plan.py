"""Which layers of a net, and which of their bottoms, need a gradient (Caffe's Net::Init
bookkeeping): a layer needs backward when a bottom carries a gradient or it learns a parameter,
and it contributes to some loss; force_backward and a layer's propagate_down override that."""


def plan_backward(layers, layer_params, bottom_names, top_names, loss_weights, force_backward):
    """(layer_need_backward, bottom_need_backward): one flag per layer, and per layer one flag
    per bottom. layer_params: the LayerParameters (for propagate_down); loss_weights: {top
    name: weight} of the tops that are losses."""
    n = len(layers)
    blob_needs = {}
    layer_needs = [False] * n
    for li, layer in enumerate(layers):
        needs = any(blob_needs.get(b, False) for b in bottom_names[li])
        needs = needs or any(layer.param_propagate_down[bi] for bi in range(len(layer.blobs)))
        layer_needs[li] = needs
        for t in top_names[li]:
            blob_needs[t] = needs
    # prune layers that contribute to no loss
    under_loss = set()
    for li in reversed(range(n)):
        contributes = any(t in under_loss or loss_weights.get(t) for t in top_names[li])
        if not contributes:
            layer_needs[li] = False if not force_backward else layer_needs[li]
        else:
            under_loss.update(bottom_names[li])
    bottom_needs = []
    for li, layer in enumerate(layers):
        flags = []
        for bi, b in enumerate(bottom_names[li]):
            need = blob_needs.get(b, False) and layer_needs[li] and (
                b in under_loss or force_backward)
            if force_backward and layer.allow_force_backward(bi):
                need = True
            if bi < len(layer_params[li].propagate_down):
                need = bool(layer_params[li].propagate_down[bi])
            flags.append(need)
        bottom_needs.append(flags)
        if force_backward:
            layer_needs[li] = True
    return layer_needs, bottom_needs
