"""engine.gemm: the meter counts every matmul the layers do. Checked against the textbook FLOP
count of each Convolution / InnerProduct (tools/bench/layers.gemm_flops), or the frequency route's
own count (conv/fourier.pass_flops, conv/winograd.pass_flops) for layers on those routes, layer
by layer, so a product that bypasses the meter or is done twice shows up here."""
import numpy
import pytest

from poseidon.engine.gemm import CACHE_LINE, METER, matmul, padded_row_length, product_flops
from poseidon.engine.layers.conv import winograd
from poseidon.engine.layers.conv.fourier import pass_flops
from poseidon.engine.parallel import parallel
from poseidon.tools.bench import layers, nets


def test_product_flops_broadcasts_batch():
    assert product_flops((4, 5), (5, 6)) == 2 * 4 * 5 * 6
    assert product_flops((3, 4, 5), (5, 6)) == 3 * 2 * 4 * 5 * 6
    assert product_flops((2, 1, 4, 5), (3, 5, 6)) == 6 * 2 * 4 * 5 * 6


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64, numpy.complex64])
def test_padded_row_length_gives_an_odd_number_of_cache_lines(dtype):
    """Rows that fill whole cache lines come out an odd number of lines long (fc_heavy's 9216
    and 4096 floats grow by one line); other lengths are kept; never shorter."""
    size = numpy.dtype(dtype).itemsize
    for n in list(range(1, 300)) + [4096, 9216, 9216 * 3]:
        m = padded_row_length(n, size)
        assert m >= n and m - n <= CACHE_LINE // size
        if (n * size) % CACHE_LINE:
            assert m == n
        else:
            assert (m * size) % CACHE_LINE == 0 and (m * size // CACHE_LINE) % 2 == 1
    assert padded_row_length(9216, 4) == 9216 + 16 and padded_row_length(48, 4) == 48


def test_scratch_rows_are_padded_on_the_cpu():
    from poseidon.engine.parallel import BufferCache
    rows = BufferCache().get_rows("g", 5, 4096, numpy.float32, numpy)
    assert rows.shape == (5, 4096) and rows.strides == ((4096 + 16) * 4, 4)


def test_meter_off_by_default_and_counts_when_on():
    a = numpy.ones((8, 3), numpy.float32)
    b = numpy.ones((3, 2), numpy.float32)
    METER.reset()
    matmul(numpy, a, b)
    assert METER.snapshot()["calls"] == 0
    METER.enabled = True
    try:
        out = numpy.empty((8, 2), numpy.float32)
        matmul(numpy, a, b, out=out)
    finally:
        METER.enabled = False
    snap = METER.snapshot()
    assert snap["calls"] == 1 and snap["flops"] == 2 * 8 * 3 * 2 and snap["seconds"] >= 0
    assert numpy.all(out == 3)


def expected_flops(net, li):
    """The textbook count (a direct convolution's), or for a layer on the frequency route the
    count of its transforms and channel products, on Winograd's that of its 16 GEMMs a tile set."""
    layer = net.layers[li]
    algorithm = getattr(layer, "algorithm", None)
    if algorithm == "winograd":
        n, c = net.bottom_vecs[li][0].shape[:2]
        return winograd.pass_flops(n, c, layer.num_output, *net.top_vecs[li][0].shape[2:],
                                        weight_grad=layer.param_propagate_down[0],
                                        input_grad=net.bottom_need_backward[li][0])
    if algorithm != "fourier":
        return layers.gemm_flops(net, li)
    n, c, h, w = net.bottom_vecs[li][0].shape
    return pass_flops(layer.geom, n, c, layer.num_output, h, w,
                      weight_grad=layer.param_propagate_down[0],
                      input_grad=net.bottom_need_backward[li][0],
                      ranges=min(parallel().workers, n), group=layer.group)


@pytest.mark.parametrize("make, conv", [(nets.cifar10_quick, "auto"), (nets.vgg_block, "auto"),
                                        (nets.vgg_block, "winograd"), (nets.fc_heavy, "auto")],
                         ids=["cifar10_quick", "vgg_block", "vgg_block_winograd", "fc_heavy"])
def test_metered_flops_match_each_layers_formula(make, conv, monkeypatch):
    monkeypatch.setenv("POSEIDON_CONV", conv)
    bench_net = make(batch=4)
    solver = nets.make_solver(bench_net)
    net = solver.net
    solver.step(1)
    if conv == "winograd":
        assert {layer.algorithm for layer in net.layers if layer.type == "Convolution"} == \
            {"winograd"}
    METER.enabled = True
    try:
        net.ClearParamDiffs()
        for li in range(len(net.layers)):
            METER.reset()
            net.ForwardLayer(li)
            fwd = METER.snapshot()["flops"]
            want_fwd, _ = expected_flops(net, li)
            assert fwd == pytest.approx(want_fwd), net.layer_names[li]
        for li in range(len(net.layers) - 1, -1, -1):
            METER.reset()
            net.BackwardThrough(li)
            _, want_bwd = expected_flops(net, li)
            assert METER.snapshot()["flops"] == pytest.approx(want_bwd), net.layer_names[li]
    finally:
        METER.enabled = False
