"""The cost model, BestScheme (Algorithm 1) on the mission's worked figures, KV placement, options.

Run: python -m pytest tests/dist/test_cost_book.py -q
"""
from pathlib import Path

import pytest

from poseidon.dist.coord.book import InformationBook, first_difference
from poseidon.dist.coord.records import description_from_wire, description_to_wire
from poseidon.dist.schemes import best_scheme
from poseidon.dist.cost.formulas import adam_cost, ps_cost, sfb_cost
from poseidon.dist.errors import DistError
from poseidon.dist.coord.placement import (MAX_BUNDLE_ARRAYS, bundle_pairs, cut_pairs, parse_bytes, place_pairs,
                            server_loads)
from poseidon.engine import prototxt

ROOT = Path(__file__).resolve().parents[2]


# ----- the cost model and Algorithm 1 ---------------------------------------------------------------
def test_worked_figure_4096_fc_goes_sfb():
    M = N = 4096
    ps, sfb = ps_cost(M, N, 8, 8), sfb_cost(M, N, 32, 8)
    assert ps == pytest.approx(58.72e6, rel=1e-3)          # "PS 58.7 M floats"
    assert sfb == pytest.approx(3.67e6, rel=1e-3)          # "SFB 3.67 M floats"
    assert ps / sfb == pytest.approx(16, rel=0.01)         # "SFB wins by ~16x"
    assert best_scheme(True, M, N, K=32, P1=8, P2=8) == "sfb"


def test_worked_figure_googlenet_classifier_goes_ps():
    M, N = 1000, 1024
    assert sfb_cost(M, N, 128, 16) > ps_cost(M, N, 16, 16)
    assert best_scheme(True, M, N, K=128, P1=16, P2=16) == "ps"


def test_convolutions_never_go_by_sfb_whatever_sync_says():
    """--sync ps and sfb send a convolution by PS; hybrid by the cheapest of PS and the ring: PS
    with as many servers as workers (the ring moves the bias too), the ring without servers."""
    for sync in ("ps", "sfb"):
        assert best_scheme(False, 64, 576, K=32, P1=8, P2=8, sync=sync) == "ps"
        assert best_scheme(False, 64, 576, K=1, P1=2, P2=0, sync=sync) == "ps"
    assert best_scheme(False, 64, 576, K=32, P1=8, P2=8) == "ps"
    assert best_scheme(False, 64, 576, K=1, P1=2, P2=0) == "allreduce"


def test_sync_override_and_no_servers():
    assert best_scheme(True, 1000, 1024, K=128, P1=16, P2=16, sync="sfb") == "sfb"
    assert best_scheme(True, 4096, 4096, K=32, P1=8, P2=8, sync="ps") == "ps"
    # no server: the cheaper of SFB and the ring (K = 128 makes the factors the larger)
    assert best_scheme(True, 1000, 1024, K=128, P1=16, P2=0) == "allreduce"
    assert best_scheme(True, 1000, 1024, K=8, P1=16, P2=0) == "sfb"


def test_adam_comparator():
    assert adam_cost(4096, 4096, 32, 8) == 8 * 32 * 8192 + 8 * 4096 * 4096


def _description(layers):
    """A net's description as its records (description_to_wire: as a worker sends it)."""
    params, recs = [], []
    for li, (kind, M, N, K, sfb) in enumerate(layers):
        pids = []
        for bi, shape in enumerate([(M, N), (M,)]):
            pid = len(params)
            params.append({"id": pid, "name": f"l{li}[{bi}]", "layer": li, "owner": [li, bi],
                           "shape": list(shape), "count": M * N if bi == 0 else M,
                           "lr_mult": 1.0, "decay_mult": 1.0, "shared": False, "synced": True})
            pids.append(pid)
        recs.append({"index": li, "name": f"l{li}", "type": kind, "M": M, "N": N, "K": K,
                     "sfb": sfb, "params": pids, "shapes": [[M, N], [M]]})
    return description_from_wire({"net": "t", "dtype": "float32", "iter_size": 1, "layers": recs,
                                  "params": params})


def test_book_decides_per_layer_and_places_only_ps_parameters():
    desc = _description([("Convolution", 64, 576, 32, False), ("InnerProduct", 4096, 4096, 32, True),
                         ("InnerProduct", 1000, 1024, 128, True)])
    book = InformationBook.build(desc, 8, 8, {"sync": "hybrid", "kv_pair_bytes": 2 << 20})
    assert [book.best_scheme(li) for li in (0, 1, 2)] == ["ps", "sfb", "ps"]
    placed = {p.param for p in book.pairs}
    assert placed == {0, 1, 4, 5}                         # conv and the 1000x1024 layer
    assert all(p.length * 4 <= 2 << 20 for p in book.pairs)
    assert book.query("best_scheme", index=1) == "sfb"
    assert book.query("costs", index=1)["sfb"] == sfb_cost(4096, 4096, 32, 8)


def test_servers_zero_needs_every_layer_serverless():
    """--servers 0: every layer by a scheme without servers. Under --sync sfb a convolution would
    go by PS (refused, naming it); under hybrid it goes by the ring."""
    desc = _description([("Convolution", 64, 576, 32, False), ("InnerProduct", 512, 512, 8, True)])
    with pytest.raises(DistError, match=r"--servers 0 .*'l0' \(Convolution\)"):
        InformationBook.build(desc, 4, 0, {"sync": "sfb", "kv_pair_bytes": 2 << 20})
    book = InformationBook.build(desc, 4, 0, {"sync": "hybrid", "kv_pair_bytes": 2 << 20})
    assert [book.best_scheme(li) for li in (0, 1)] == ["allreduce", "sfb"] and book.pairs == []
    fc_only = _description([("InnerProduct", 512, 512, 8, True)])
    book = InformationBook.build(fc_only, 4, 0, {"sync": "hybrid", "kv_pair_bytes": 2 << 20})
    assert book.best_scheme(0) == "sfb" and book.pairs == []
    with pytest.raises(DistError, match="--sync ps"):
        InformationBook.build(fc_only, 4, 0, {"sync": "ps", "kv_pair_bytes": 2 << 20})


def test_first_difference_names_the_layer():
    a = _description([("InnerProduct", 10, 20, 4, True)])
    b = _description([("InnerProduct", 10, 30, 4, True)])
    assert "['l0'].N: 20 vs 30" in first_difference(description_to_wire(a), description_to_wire(b))


# ----- KV pairs and placement -------------------------------------------------------------------------
def vgg19_param_counts():
    """Parameter tensor sizes of prototxt/vgg19/deploy.prototxt, by shape inference on the file."""
    net = prototxt.read_net(str(ROOT / "prototxt" / "vgg19" / "deploy.prototxt"))
    channels, size = 3, 224
    counts = []
    for layer in net.layer:
        if layer.type == "Input":
            dims = list(layer.input_param.shape[0].dim)
            channels, size = dims[1], dims[2]
        elif layer.type == "Convolution":
            p = layer.convolution_param
            k = p.kernel_size[0]
            pad = p.pad[0] if len(p.pad) else 0
            stride = p.stride[0] if len(p.stride) else 1
            counts += [p.num_output * channels * k * k, p.num_output]
            channels, size = p.num_output, (size + 2 * pad - k) // stride + 1
        elif layer.type == "Pooling":
            p = layer.pooling_param
            size = -(-(size - p.kernel_size) // p.stride) + 1
        elif layer.type == "InnerProduct":
            n_in = channels * size * size
            m = layer.inner_product_param.num_output
            counts += [m * n_in, m]
            channels, size = m, 1
    return counts


def test_vgg19_pairs_balanced_over_four_servers():
    counts = vgg19_param_counts()
    assert sum(counts) == 143_667_240                     # VGG19's parameter count
    pairs = cut_pairs(list(enumerate(counts)), 4, 2 * 1024 * 1024)
    sizes = [length * 4 for (_, _, _, length) in pairs]
    assert max(sizes) <= 2 * 1024 * 1024
    loads = server_loads(sizes, place_pairs(sizes, 4), 4)
    assert sum(loads) == sum(counts) * 4
    assert max(loads) <= 1.1 * min(loads), loads
    # fc6 alone (411 MB) is spread over every server
    fc6 = max(range(len(counts)), key=counts.__getitem__)
    where = place_pairs(sizes, 4)
    assert {where[i] for i, p in enumerate(pairs) if p[1] == fc6} == {0, 1, 2, 3}


def test_cut_pairs_covers_each_tensor_exactly():
    pairs = cut_pairs([(0, 10), (1, 1), (2, 1000)], 4, 64)
    for pid, count in ((0, 10), (1, 1), (2, 1000)):
        mine = [p for p in pairs if p[1] == pid]
        assert mine[0][2] == 0 and sum(p[3] for p in mine) == count
        assert all(a[2] + a[3] == b[2] for a, b in zip(mine, mine[1:]))
        assert all(p[3] * 4 <= 64 for p in mine)


def test_bundle_pairs_packs_consecutive_pairs_within_the_fusion_size():
    pairs = [(0, 10), (1, 20), (2, 5), (3, 40), (4, 1)]            # (pair id, length)
    assert bundle_pairs(pairs, 4 * 35, 4) == [[0, 1, 2], [3], [4]]   # 35 floats: 10+20+5 fit
    assert bundle_pairs(pairs, 0, 4) == [[0], [1], [2], [3], [4]]    # 0: one message per pair
    assert bundle_pairs(pairs, 4, 4) == [[0], [1], [2], [3], [4]]    # pairs over the size: alone
    many = [(i, 1) for i in range(MAX_BUNDLE_ARRAYS + 3)]
    assert [len(b) for b in bundle_pairs(many, 1 << 20, 4)] == [MAX_BUNDLE_ARRAYS, 3]


def _check_bundles(book, fusion):
    """Every PS pair in exactly one bundle of its own layer, on its own server, in pair order;
    a bundle of several pairs within the fusion size."""
    seen = []
    for b in book.bundles:
        pairs = [book.pairs[k] for k in b.pairs]
        assert b.id == b.pairs[0] and list(b.pairs) == sorted(b.pairs)
        assert {p.server for p in pairs} == {b.server}
        assert all(book.params[p.param].layer == b.layer for p in pairs)
        if len(pairs) > 1:
            assert sum(p.length for p in pairs) * book.data["itemsize"] <= fusion
        seen += b.pairs
    assert sorted(seen) == [p.id for p in book.pairs]


def test_book_bundles_a_small_layer_into_one_message_on_one_server():
    desc = _description([("Convolution", 64, 576, 32, False), ("InnerProduct", 4096, 9216, 32, True),
                         ("InnerProduct", 10, 64, 32, True)])
    opts = {"sync": "ps", "kv_pair_bytes": 2 << 20}
    book = InformationBook.build(desc, 4, 3, opts)
    _check_bundles(book, 2 << 20)
    # the conv (weight 147 kB + bias) and the classifier: one message each, although 3 servers
    assert [len(book.bundles_of_layer(li)) for li in (0, 2)] == [1, 1]
    assert [len(b.pairs) for li in (0, 2) for b in book.bundles_of_layer(li)] == [2, 2]
    # fc (151 MB): 2 MB pairs, one per message, spread over every server
    big = book.bundles_of_layer(1)
    assert len(big) == sum(len(book.pairs_of_param(p)) for p in book.layer(1).params)
    assert {b.server for b in big} == {0, 1, 2}
    loads = book.server_bytes()
    assert max(loads) - min(loads) <= 2 << 20               # within one pair of each other
    # --fusion-bytes 0 and relaxed consistency: one message per pair
    for extra in ({"fusion_bytes": 0}, {"staleness": 2}, {"straggler_timeout": 1.0}):
        flat = InformationBook.build(desc, 4, 3, dict(opts, **extra))
        assert [b.pairs for b in flat.bundles] == [(p.id,) for p in flat.pairs], extra
    # a larger fusion size packs the fc's bias with its last weight pair
    wide = InformationBook.build(desc, 4, 3, dict(opts, fusion_bytes=8 << 20))
    _check_bundles(wide, 8 << 20)
    assert len(wide.bundles) < len(book.bundles)


def test_parse_bytes():
    assert parse_bytes("2MB") == 2 << 20 and parse_bytes("512KB") == 512 << 10
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError):
        parse_bytes("lots")
    assert parse_bytes("0", allow_zero=True) == 0
    with pytest.raises(ValueError, match="must be positive"):
        parse_bytes("0")
    with pytest.raises(ValueError, match="the fusion size must be 0 or more"):
        parse_bytes("-1", allow_zero=True, what="the fusion size")


def test_buckets_join_consecutive_small_ps_layers_in_backward_order():
    """--bucket-bytes: PS layers taken from the top down share one sync while their parameters
    fit, started after the lowest of them; an SFB layer or one too large for a bucket stands
    alone and closes the bucket above it; bucket 0 and relaxed consistency: every layer alone.
    As many servers as workers, so that BestScheme sends the layers with a bias by PS (the ring
    would move the bias too); with fewer servers the ring takes them, and a ring layer stands
    alone as an SFB layer does."""
    desc = _description([("Convolution", 32, 75, 8, False),          # 9.7 kB
                         ("Convolution", 32, 800, 8, False),         # 102 kB
                         ("InnerProduct", 4096, 4096, 8, True),      # 67 MB, SFB under hybrid
                         ("Convolution", 64, 800, 8, False),         # 205 kB
                         ("InnerProduct", 64, 1024, 8, False),       # 262 kB (not SFB-capable)
                         ("InnerProduct", 10, 64, 8, False)])        # 2.6 kB
    opts = {"sync": "hybrid", "kv_pair_bytes": 2 << 20, "bucket_bytes": 300 << 10}
    book = InformationBook.build(desc, 4, 4, opts)
    assert book.best_scheme(2) == "sfb"
    assert {rec.scheme for rec in book.layers if rec.index != 2} == {"ps"}
    groups = {rec.index: rec.group for rec in book.layers}
    # backward order 5, 4, 3: 2.6 + 262 kB fit, 205 more do not; then the SFB layer alone
    assert groups == {5: 4, 4: 4, 3: 3, 2: 2, 1: 0, 0: 0}
    assert book.synced_layers() == [0, 2, 3, 4]
    assert book.group_members(4) == [5, 4] and book.group_members(0) == [1, 0]
    assert len(book.bundles_of_layer(4)) == 1 and not book.bundles_of_layer(5)
    (bundle,) = book.bundles_of_layer(4)
    params = {book.pairs[k].param for k in bundle.pairs}
    assert params == set(book.layer(4).params) | set(book.layer(5).params)
    assert len({book.pairs[k].server for k in bundle.pairs}) == 1
    for extra in ({"bucket_bytes": 0}, {"staleness": 2}, {}):
        alone = InformationBook.build(desc, 4, 4, dict(opts, **extra) if extra else
                                      {k: v for k, v in opts.items() if k != "bucket_bytes"})
        assert all(rec.group == rec.index for rec in alone.layers), extra
        assert alone.synced_layers() == [0, 1, 2, 3, 4, 5]
    ring = InformationBook.build(desc, 4, 2, opts)
    assert [rec.scheme for rec in ring.layers] == ["allreduce"] * 2 + ["sfb"] + ["allreduce"] * 3
    assert ring.synced_layers() == [0, 1, 2, 3, 4, 5] and ring.pairs == []


def test_bucket_bytes_auto_buckets_on_one_host_only():
    """--bucket-bytes auto (the default): 1 MB buckets when every process advertised a Unix-socket
    inbox of the same boot, none when one did not (--ipc off, another host) or boots differ;
    an explicit size or 0 is kept either way, and relaxed consistency buckets nothing."""
    from poseidon.dist.coord.book import AUTO_BUCKET_BYTES
    from poseidon.dist.job.options import DistOptions
    assert DistOptions().bucket_bytes == "auto"
    assert DistOptions(bucket_bytes="AUTO").bucket_bytes == "auto"
    assert DistOptions(bucket_bytes="2MB").bucket_bytes == 2 << 20
    desc = _description([("Convolution", 32, 75, 8, False),          # 9.7 kB
                         ("Convolution", 32, 800, 8, False),         # 102 kB
                         ("InnerProduct", 10, 64, 8, False)])        # 2.6 kB
    here = {"path": "/x", "boot": "b1", "dev": 1, "ino": 2}
    one_host = {r: dict(here) for r in range(3)}                     # 2 workers + 1 server
    cases = [({"bucket_bytes": "auto"}, one_host, AUTO_BUCKET_BYTES),
             ({"bucket_bytes": "auto"}, {**one_host, 2: None}, 0),
             ({"bucket_bytes": "auto"}, {**one_host, 2: dict(here, boot="b2")}, 0),
             ({"bucket_bytes": "auto"}, None, 0),
             ({"bucket_bytes": 0}, one_host, 0),
             ({"bucket_bytes": 64 << 10}, None, 64 << 10),
             ({"bucket_bytes": "auto", "staleness": 2}, one_host, 0)]
    for extra, local, want in cases:
        book = InformationBook.build(desc, 2, 1, dict({"sync": "ps", "kv_pair_bytes": 2 << 20},
                                                      **extra), local=local)
        assert book.data["bucket_bytes"] == want, (extra, local)
        bucketed = any(rec.group != rec.index for rec in book.layers)
        assert bucketed == (want >= 120 << 10), (extra, local)      # all three fit in 115 kB
        lines = "\n".join(book.summary_lines())
        assert ("one host: consecutive PS layers" in lines) == (want == AUTO_BUCKET_BYTES)


def test_shared_memory_merges_a_syncs_bundles_per_server_after_placement():
    """On one host whose servers all offer shared KV memory (dist/transport/onehost/kvshm.py), a
    sync's bundles that placement put on the same server become one message of at most 64 pairs;
    placement itself (which server holds which pair) is what it would be without. Not when a
    server offers none, across hosts, with an explicit --fusion-bytes, or under relaxed
    consistency."""
    from poseidon.dist.coord.placement import MAX_BUNDLE_ARRAYS
    desc = _description([("InnerProduct", 1024, 1024, 8, False),    # 4 MiB: 256 pairs of 16 kB
                         ("InnerProduct", 10, 1024, 8, False)])
    here = {"path": "/x", "boot": "b1", "dev": 1, "ino": 2}
    memory = {"pid": 1, "fd": 3, "dev": 4, "ino": 5}
    P1, P2 = 2, 2
    shared = {r: dict(here, kv_memory=memory) if r >= P1 else dict(here) for r in range(P1 + P2)}
    base = {"sync": "ps", "kv_pair_bytes": 16 << 10, "bucket_bytes": 0}
    plain = InformationBook.build(desc, P1, P2, base, local=shared | {3: dict(here)})
    merged = InformationBook.build(desc, P1, P2, base, local=shared)
    assert merged.data["merged_on_servers"] and not plain.data["merged_on_servers"]
    assert [(p.id, p.server) for p in merged.pairs] == \
        [(p.id, p.server) for p in plain.pairs]                 # placement unchanged
    assert len(merged.bundles) < len(plain.bundles)
    for li in (0, 1):
        for s in range(P2):
            want = [k for b in plain.bundles_of_layer(li) if b.server == s for k in b.pairs]
            got = [b for b in merged.bundles_of_layer(li) if b.server == s]
            assert [k for b in got for k in b.pairs] == want          # same pairs, same order
            assert all(len(b.pairs) <= MAX_BUNDLE_ARRAYS and b.id == b.pairs[0]
                       for b in got)
            assert len(got) == -(-len(want) // MAX_BUNDLE_ARRAYS)
    for extra, local in (({"fusion_bytes": 16 << 10}, shared),
                         ({"staleness": 2}, shared),
                         ({}, {**shared, 3: dict(shared[3], boot="b2")})):
        book = InformationBook.build(desc, P1, P2, dict(base, **extra), local=local)
        assert not book.data["merged_on_servers"], extra
