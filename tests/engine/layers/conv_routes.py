"""What the tests of the convolution routes share: one layer run forward and backward through
each POSEIDON_CONV route on the same input and top gradient."""
import numpy

from poseidon.engine import rng
from tests.engine.harness import make_layer, run_forward


def conv_layer(extra, num_output, dtype=numpy.float64):
    rng.seed(5)
    return make_layer(f'type: "Convolution" convolution_param {{ num_output: {num_output} {extra} '
                      f'weight_filler {{ type: "gaussian" std: 1 }} '
                      f'bias_filler {{ type: "gaussian" std: 1 }} }}', dtype=dtype)


def assert_routes_agree(extra, shape, num_output, routes, monkeypatch, tol):
    """Top, input gradient and parameter gradients through each route (the first is the
    reference) agree within tol; each layer must have taken the route it was asked for."""
    x = numpy.random.RandomState(2).standard_normal(shape)
    results = {}
    for route in routes:
        monkeypatch.setenv("POSEIDON_CONV", route)
        layer = conv_layer(extra, num_output)
        bottom, top = run_forward(layer, [x])
        assert layer.core.algorithm == route
        top[0].diff[...] = numpy.random.RandomState(3).standard_normal(top[0].shape)
        for p in layer.blobs:
            p.diff[...] = 0
        layer.backward(top, [True], bottom)
        results[route] = [top[0].data.copy(), bottom[0].diff.copy()] + \
            [p.diff.copy() for p in layer.blobs]
    for route in routes[1:]:
        for a, b in zip(results[routes[0]], results[route]):
            numpy.testing.assert_allclose(b, a, rtol=tol, atol=tol)
