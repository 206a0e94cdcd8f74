"""The update rule over a net's flat parameter buffers: a whole net, a layer, or any parameters.

The single-process solver calls this for all the parameters it updates from their own gradients;
`update_layer` is the entry for a scheme that sums layer l's range among workers (the distributed
schemes still call the rule per parameter, `UpdateRule.update`, the same arithmetic). Contiguous parameters are one call of the rule
(`UpdateRule.apply`: one fused kernel on a GPU, the in-place ufuncs per run of equal multipliers
on numpy); a parameter moved out of the buffers (into a KV server's shared memory) is updated on
its own, with the same rule.
"""


def update_params(rule, flat, pids, it, grad_scale=1.0, rate=None, grad=None, base=0,
                  keep_grad=False):
    """Update the parameters `pids` of FlatParams `flat` and their history. `grad`: None for the
    net's own gradients (flat.diff, used as scratch unless keep_grad), or a 1-D array laid out
    like flat.diff from element `base` on (e.g. a layer's summed gradient)."""
    if rate is None:
        rate = rule.rate(it)
    ranges, outside = flat.runs(pids)
    for a, b in ranges:
        g = flat.diff[a:b] if grad is None else grad[a - base:b - base]
        rule.apply(flat.data[a:b], g, [h[a:b] for h in flat.history], it, flat.mults(a, b),
                   grad_scale, rate, keep_grad=keep_grad)
    params, specs = flat.net.learnable_params, flat.net.learnable_param_specs
    for pid in outside:
        blob, spec = params[pid], specs[pid]
        if grad is None:
            g = blob.diff
        elif flat.has_range(pid):
            a, b = flat.param_range(pid)
            g = grad[a - base:b - base].reshape(blob.shape)
        else:
            raise ValueError(f"parameter '{spec.name}' (a Python layer's) is not in the flat "
                             f"buffers, so a gradient laid out like them has no place for it")
        rule.update(blob.data, g, flat.param_history[pid], it, spec.lr_mult, spec.decay_mult,
                    grad_scale, rate=rate, keep_grad=keep_grad)


def layer_params(flat, li):
    """The parameter ids layer li owns, in flat order."""
    specs = flat.net.learnable_param_specs
    return [pid for pid in flat.order + flat.apart if specs[pid].layer_index == li]


def update_layer(rule, flat, li, it, grad=None, grad_scale=1.0, rate=None, keep_grad=False):
    """Apply the rule to layer li's range of the flat buffers, flat.layer_range(li).

    `grad`: the layer's summed gradient, a 1-D array laid out as flat.diff[start:stop] (what an
    all-reduce of that range gives); None to use the net's own diff there. `grad_scale`: the
    factor applied to it first (1/workers for a mean, clip_gradients' factor, 1/iter_size).
    Replicas that call this with the same arguments stay bitwise identical: the rule is
    elementwise and the same code runs everywhere."""
    start, stop = flat.layer_range(li)
    if grad is not None and grad.size != stop - start:
        raise ValueError(f"layer {li}'s gradient has {grad.size} elements, its parameters "
                         f"{stop - start}")
    update_params(rule, flat, layer_params(flat, li), it, grad_scale, rate,
                  None if grad is None else grad.reshape(-1), start, keep_grad)
