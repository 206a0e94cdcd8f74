"""Shared test machinery: build one layer from prototxt text, run it, and check its gradients.

The gradient check is Caffe's exhaustive one in float64: the loss is a fixed random projection of
the tops, sum(top * R); analytic gradients from backward are compared with central differences for
every bottom element and every parameter element. Keep test blobs small (tens to hundreds of
elements) so the check stays fast.
"""
import numpy

from poseidon.engine import backend
# the layer set-up the GPU probe shares (re-exported for the tests that import them from here)
from poseidon.testing.layer_cases import blobs_from, layer_param, make_layer, run_forward  # noqa: F401


def _objective(layer, bottom, top, weights):
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return sum(float((backend.to_numpy(t.data) * w).sum()) for t, w in zip(top, weights))


def check_gradient(layer, bottom_arrays, n_tops=1, check_bottoms=None, check_params=True,
                   eps=1e-6, rtol=1e-4, atol=1e-6, seed=0, top_indices=None):
    """Compare backward with central differences; raises AssertionError naming the worst element.

    check_bottoms: indices of bottoms to check (default all); top_indices: tops in the objective.
    """
    rs = numpy.random.RandomState(seed)
    bottom, top = run_forward(layer, bottom_arrays, n_tops, layer.dtype, layer.xp)
    top_indices = range(len(top)) if top_indices is None else top_indices
    weights = [rs.standard_normal(t.shape) if i in top_indices else numpy.zeros(t.shape)
               for i, t in enumerate(top)]
    check_bottoms = range(len(bottom)) if check_bottoms is None else check_bottoms

    # analytic
    for p in layer.blobs:
        p.diff[...] = 0
    for t, w in zip(top, weights):
        t.diff[...] = layer.xp.asarray(w)
    propagate = [i in check_bottoms for i in range(len(bottom))]
    layer.backward(top, propagate, bottom)
    analytic = [backend.to_numpy(bottom[i].diff).copy() for i in check_bottoms]
    param_analytic = [backend.to_numpy(p.diff).copy() for p in layer.blobs] if check_params else []

    targets = [(f"bottom[{i}]", bottom[i].data, a) for i, a in zip(check_bottoms, analytic)]
    if check_params:
        targets += [(f"param[{j}]", p.data, a) for j, (p, a) in
                    enumerate(zip(layer.blobs, param_analytic))]
    for label, data, grad in targets:
        flat = data.reshape(-1)
        gflat = grad.reshape(-1)
        for k in range(flat.size):
            keep = float(flat[k])
            flat[k] = keep + eps
            plus = _objective(layer, bottom, top, weights)
            flat[k] = keep - eps
            minus = _objective(layer, bottom, top, weights)
            flat[k] = keep
            numeric = (plus - minus) / (2 * eps)
            scale = max(abs(numeric), abs(float(gflat[k])), 1.0)
            if abs(numeric - float(gflat[k])) > atol + rtol * scale:
                raise AssertionError(f"{layer.type} {label} element {k}: analytic "
                                     f"{float(gflat[k]):.8g} vs numeric {numeric:.8g}")
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return bottom, top
