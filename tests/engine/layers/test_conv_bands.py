"""Convolution with fewer samples than threads (engine/layers/conv/columns.py, `_bands`): the
work is cut into bands of output rows, or for 1x1 layers into output channels and plane ranges.
Apart from test_conv.py, whose fixture runs every test through all the routes: these force
im2col."""
import numpy
import pytest

from poseidon.engine.layers.conv.columns import Im2colConvCore
from tests.engine.layers.test_conv import CONV_CONFIGS, conv, ref_conv
from tests.engine.harness import run_forward


BAND_CONFIGS = CONV_CONFIGS + [("pointwise", (2, 5, 3, 4), 7, "kernel_size: 1", dict(kh=1, kw=1))]


@pytest.mark.parametrize("gradients", ["both", "weights_only", "input_only"])
@pytest.mark.parametrize("batch,workers,block", [(1, 2, 1 << 30), (1, 3, 1), (2, 3, 1 << 30),
                                                  (2, 4, 1)])
@pytest.mark.parametrize("name,shape,num_output,extra,kw", BAND_CONFIGS,
                         ids=[c[0] for c in BAND_CONFIGS])
def test_conv_fewer_samples_than_threads_cut_rows(name, shape, num_output, extra, kw, batch,
                                                  workers, block, gradients, monkeypatch):
    """Fewer samples than threads: im2col cuts the output rows into bands instead (_bands), in
    forward, in the weight gradient and in a stride-1 input gradient (a strided one goes per
    sample); a 1x1 layer of one group cuts its output channels (forward, weight gradient) and
    its plane (input gradient). Forward matches the loops; the gradients asked for match one thread on the whole
    batch, and one not asked for is left alone."""
    from poseidon.engine import parallel
    monkeypatch.setenv("POSEIDON_CONV", "im2col")
    x = numpy.random.RandomState(3).standard_normal((batch,) + shape[1:])
    dy = None

    def run(n_workers, block_bytes):
        nonlocal dy
        monkeypatch.setattr(Im2colConvCore, "COLUMN_BLOCK_BYTES", block_bytes)
        monkeypatch.setattr(Im2colConvCore, "MIN_CHUNK_CELLS", 1)
        monkeypatch.setattr(parallel.parallel(), "workers", n_workers)
        layer = conv(extra, num_output)
        bottom, top = run_forward(layer, [x])
        if dy is None:
            dy = numpy.random.RandomState(4).standard_normal(top[0].shape)
        top[0].diff[...] = dy
        bottom[0].diff[...] = 7.0
        if gradients == "input_only":
            layer.param_propagate_down = [False] * len(layer.blobs)
        layer.backward(top, [gradients != "weights_only"], bottom)
        return top[0].data.copy(), bottom[0].diff.copy(), [b.diff.copy() for b in layer.blobs], \
            layer

    monkeypatch.setattr(parallel.parallel(), "workers", workers)
    assert Im2colConvCore._bands(batch, 5, numpy) is not None      # the band path is the one tested
    assert Im2colConvCore._bands(workers, 5, numpy) is None
    y1, dx1, dp1, layer = run(workers, block)
    w = layer.blobs[0].data
    b = layer.blobs[1].data if "bias_term: false" not in extra else None
    numpy.testing.assert_allclose(y1, ref_conv(x, w, b, **kw), rtol=1e-10, atol=1e-10)
    y0, dx0, dp0, _ = run(1, 1 << 30)
    numpy.testing.assert_allclose(dx1, dx0, rtol=1e-12, atol=1e-12)
    if gradients == "weights_only":
        assert (dx1 == 7.0).all()
    for a, c in zip(dp1, dp0):
        numpy.testing.assert_allclose(a, c, rtol=1e-10, atol=1e-10)
        assert (a == 0).all() if gradients == "input_only" else numpy.abs(a).max() > 0


@pytest.mark.parametrize("extra", ["kernel_size: 3 stride: 2 pad: 1", "kernel_size: 3 pad: 1",
                                   "kernel_size: 4 stride: 2 pad: 1 group: 2"])
def test_deconv_fewer_samples_than_threads_match_one_thread(extra, monkeypatch):
    """Deconvolution runs the convolution's input gradient as its forward (and the convolution's
    forward as its input gradient): at batch 1 on 2 and 3 threads those go through the bands too,
    and every output and gradient equals one thread's."""
    from poseidon.engine import parallel
    monkeypatch.setenv("POSEIDON_CONV", "im2col")
    x = numpy.random.RandomState(0).standard_normal((1, 4, 5, 5))
    results = []
    for workers in (1, 2, 3):
        monkeypatch.setattr(parallel.parallel(), "workers", workers)
        layer = conv(extra, 4, kind="Deconvolution")
        bottom, top = run_forward(layer, [x])
        top[0].diff[...] = numpy.random.RandomState(1).standard_normal(top[0].shape)
        layer.backward(top, [True], bottom)
        results.append([top[0].data.copy(), bottom[0].diff.copy()] +
                       [b.diff.copy() for b in layer.blobs])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            numpy.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("width,expect_least", [(64, 6), (3, 3), (1, 1)])
@pytest.mark.parametrize("shape", [(5, 2, 3), (3, 4, 5)])
def test_chunks_hold_the_least_cells_and_cover_every_row_once(width, expect_least, shape,
                                                              monkeypatch):
    """_chunks: with blocks of one row's columns, a chunk still holds min(width,
    MIN_CHUNK_CELLS) cells (but the last of a sample or range), and the chunks cover every
    output row of every sample once, whole samples together or one sample's rows in bands."""
    from poseidon.engine import parallel
    from poseidon.engine.layers.im2col import Geometry
    monkeypatch.setattr(parallel.parallel(), "workers", 2)
    n, out_h, out_w = shape
    cell_bytes = 8
    monkeypatch.setattr(Im2colConvCore, "COLUMN_BLOCK_BYTES", out_w * cell_bytes)
    monkeypatch.setattr(Im2colConvCore, "MIN_CHUNK_CELLS", 6)
    core = Im2colConvCore(Geometry(3, 3, 1, 1, 1, 1, 1, 1), 1)
    pieces = core._chunks(0, n, out_h, out_w, cell_bytes, width, numpy)
    covered = [(s, r) for s0, m, r0, r1 in pieces for s in range(s0, s0 + m)
               for r in range(r0, r1)]
    assert sorted(covered) == [(s, r) for s in range(n) for r in range(out_h)]
    cells = [m * (r1 - r0) * out_w for _, m, r0, r1 in pieces]
    ends = {i for i, (s0, m, r0, r1) in enumerate(pieces) if s0 + m == n or r1 == out_h}
    assert all(c >= expect_least for i, c in enumerate(cells) if i not in ends)
    if expect_least <= out_w:            # one row already holds them: the block size rules
        assert all((r1 - r0) * m == 1 for _, m, r0, r1 in pieces)
    else:
        assert len(pieces) < n * out_h
