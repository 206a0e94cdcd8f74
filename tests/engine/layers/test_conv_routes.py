"""The route choice (engine/layers/conv/routes.py): measured per layer shape on POSEIDON_CONV=auto,
kept in a per-machine cache, refreshed on request, and never measured where a route is pinned
(POSEIDON_CONV=<route>, Net.set_conv_routes) or measuring is off (the fallback order).

Tests that time routes are marked `measures_conv_routes` and use tiny shapes and a temporary
cache folder; every other test of the suite refuses to time (tests/conftest.py)."""
import json
import logging
import os

import numpy
import pytest

from poseidon.engine import LayerError, ModelError
from poseidon.engine.layers.conv import measure, route_cache, routes
from poseidon.engine.layers.im2col import Geometry
from poseidon.engine.net import Net
from poseidon.engine.prototxt import parse_net_text

NET = """
name: "routes"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 5 pad: 2
                            weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "down" type: "Convolution" bottom: "conv2" top: "down"
        convolution_param { num_output: 4 kernel_size: 3 stride: 2
                            weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "down" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def net():
    return Net(parse_net_text(NET), dtype=numpy.float32)


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """auto with measuring on, the cache in a temporary folder, this process's choices
    forgotten before and after; yields the list of shapes timed (one entry per measurement)."""
    monkeypatch.delenv("POSEIDON_CONV", raising=False)
    monkeypatch.delenv("POSEIDON_CONV_REFRESH", raising=False)
    monkeypatch.setenv("POSEIDON_CONV_MEASURE", "1")
    monkeypatch.setenv("POSEIDON_CACHE_DIR", str(tmp_path / "cache"))
    timed = []
    real = measure.time_routes

    def counting(shape, *args, **kwargs):
        timed.append(shape)
        return real(shape, *args, **kwargs)

    monkeypatch.setattr(measure, "time_routes", counting)
    routes.forget_decisions()
    yield timed
    routes.forget_decisions()


def fake_timing(monkeypatch, timed, seconds):
    """Replace the timing by fixed seconds per route, still counting measurements."""
    def fake(shape, make_core, candidates, xp):
        timed.append(shape)
        return {r: seconds[r] for r in candidates}

    monkeypatch.setattr(measure, "time_routes", fake)


def cache_file():
    return route_cache.cache_path()


@pytest.mark.measures_conv_routes
def test_measured_choice_is_cached_and_reused(measuring):
    """The two layers where several routes apply are timed at the first forward (not at
    construction, so a route pinned in between is never measured), once each; a second net in
    the same process, and one in a fresh process (choices forgotten), read them back."""
    first = net()
    assert measuring == []                       # nothing timed while building
    first.Forward()
    first.Backward()
    assert sorted(s.c for s in measuring) == [3, 4]        # conv1 and conv2; 'down' only im2col
    conv1 = next(s for s in measuring if s.c == 3)
    assert conv1.weight_grad and not conv1.input_grad      # a first layer: no image gradient
    chosen = first.conv_routes()
    assert chosen["down"] == "im2col" and set(chosen) == {"conv1", "conv2", "down"}
    with open(cache_file()) as f:
        saved = json.load(f)
    mine = saved["machines"][route_cache.machine_key()]
    assert {entry["route"] for entry in mine.values()} <= set(routes.ROUTES)
    assert sorted(e["route"] for e in mine.values()) == sorted([chosen["conv1"], chosen["conv2"]])
    assert all(set(e["ms"]) >= {"im2col", "fourier"} for e in mine.values())

    net().Forward()                              # same process: no new timing
    routes.forget_decisions()                    # as a new process would start
    again = net()
    again.Forward()
    assert len(measuring) == 2
    assert again.conv_routes() == chosen


@pytest.mark.measures_conv_routes
def test_the_fastest_route_is_kept(measuring, monkeypatch):
    fake_timing(monkeypatch, measuring, {"im2col": 3.0, "fourier": 1.0, "winograd": 2.0})
    n = net()
    assert n.conv_routes() == {"conv1": "fourier", "conv2": "fourier", "down": "im2col"}
    routes.forget_decisions()
    monkeypatch.setenv("POSEIDON_CONV_REFRESH", "1")
    fake_timing(monkeypatch, measuring, {"im2col": 3.0, "fourier": 2.0, "winograd": 1.0})
    assert net().conv_routes() == {"conv1": "fourier", "conv2": "winograd", "down": "im2col"}


@pytest.mark.measures_conv_routes
def test_refresh_measures_again_and_rewrites_the_cache(measuring, monkeypatch):
    net().Forward()
    assert len(measuring) == 2
    routes.forget_decisions()
    monkeypatch.setenv("POSEIDON_CONV_REFRESH", "1")
    fake_timing(monkeypatch, measuring, {"im2col": 1.0, "fourier": 2.0, "winograd": 3.0})
    assert net().conv_routes()["conv2"] == "im2col"
    assert len(measuring) == 4
    routes.forget_decisions()
    monkeypatch.delenv("POSEIDON_CONV_REFRESH")
    fake_timing(monkeypatch, measuring, {"im2col": 9.0, "fourier": 1.0, "winograd": 1.0})
    assert net().conv_routes() == {"conv1": "im2col", "conv2": "im2col", "down": "im2col"}
    assert len(measuring) == 4                  # read from the rewritten cache


@pytest.mark.measures_conv_routes
@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"format": 99, "machines": {}}'])
def test_a_corrupt_cache_is_ignored_with_one_warning_and_rewritten(measuring, monkeypatch, caplog,
                                                                   content):
    path = cache_file()
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(content)
    fake_timing(monkeypatch, measuring, {"im2col": 2.0, "fourier": 1.0, "winograd": 3.0})
    with caplog.at_level(logging.WARNING, logger="poseidon"):
        assert net().conv_routes()["conv1"] == "fourier"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"{path}: not a convolution route cache")
    assert "\n" not in warnings[0]
    assert len(measuring) == 2
    with open(path) as f:
        assert json.load(f)["format"] == route_cache.FORMAT   # rewritten, readable again


@pytest.mark.measures_conv_routes
def test_a_cache_from_another_machine_is_not_trusted(measuring, monkeypatch, caplog):
    """Routes another machine measured, even for these very shapes, are ignored with a warning;
    this machine measures and adds its own section beside theirs."""
    fake_timing(monkeypatch, measuring, {"im2col": 1.0, "fourier": 2.0, "winograd": 3.0})
    net().Forward()                                       # learn the keys, measured here
    path = cache_file()
    with open(path) as f:
        data = json.load(f)
    ours = data["machines"].pop(route_cache.machine_key())
    data["machines"]["Other CPU 9000, 64 cores"] = {
        key: {"route": "fourier", "ms": {}} for key in ours}
    with open(path, "w") as f:
        json.dump(data, f)
    routes.forget_decisions()
    with caplog.at_level(logging.WARNING, logger="poseidon"):
        assert net().conv_routes()["conv1"] == "im2col"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "other machines (Other CPU 9000, 64 cores)" in warnings[0]
    assert len(measuring) == 4
    with open(path) as f:
        assert set(json.load(f)["machines"]) == {"Other CPU 9000, 64 cores",
                                                 route_cache.machine_key()}


def test_pinned_routes_are_honoured_and_never_measured(monkeypatch, tmp_path):
    """With measuring on (this test is not marked, so timing would fail it): routes set on the
    net, and POSEIDON_CONV naming a route, decide without timing; a pinned route that does not
    apply runs as im2col; conv_routes hands the choice on."""
    monkeypatch.setenv("POSEIDON_CONV_MEASURE", "1")
    monkeypatch.setenv("POSEIDON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("POSEIDON_CONV", raising=False)
    routes.forget_decisions()
    n = net()
    n.set_conv_routes({"conv1": "fourier", "conv2": "winograd", "down": "winograd"})
    n.Forward()
    n.Backward()
    assert n.conv_routes() == {"conv1": "fourier", "conv2": "winograd", "down": "im2col"}
    other = net()                                 # another rank takes the first one's choice
    other.set_conv_routes(n.conv_routes())
    assert other.conv_routes() == n.conv_routes()
    monkeypatch.setenv("POSEIDON_CONV", "im2col")  # a pinned layer keeps its route
    other.Forward()
    assert other.conv_routes()["conv2"] == "winograd"
    for route in routes.ROUTES:                    # POSEIDON_CONV as before: where it applies
        monkeypatch.setenv("POSEIDON_CONV", route)
        expect = {"im2col": "im2col", "fourier": "fourier", "winograd": "im2col"}[route]
        assert net().conv_routes() == {"conv1": expect, "conv2": route, "down": "im2col"}
    assert not (tmp_path / route_cache.FILE_NAME).exists()


def test_set_conv_routes_refuses_unknown_layers_and_routes():
    n = net()
    with pytest.raises(ModelError, match="names layer 'ip', which is not one of its convolution "
                                         "layers \\(conv1, conv2, down\\)"):
        n.set_conv_routes({"ip": "im2col"})
    with pytest.raises(LayerError, match="route 'direct' is not a convolution route: use one of "
                                         "im2col, fourier, winograd"):
        n.set_conv_routes({"conv1": "direct"})


def test_measuring_off_takes_the_fallback_order(monkeypatch):
    monkeypatch.delenv("POSEIDON_CONV", raising=False)
    monkeypatch.setenv("POSEIDON_CONV_MEASURE", "0")
    n = net()
    layer = n.layer_dict["conv2"]
    shape = layer._shape
    assert n.conv_routes()["conv2"] == routes.fallback_route(
        shape.geom, 1, shape.n, shape.c, shape.o, shape.h, shape.w, 1, numpy)
    monkeypatch.setenv("POSEIDON_CONV_MEASURE", "maybe")
    with pytest.raises(LayerError, match="POSEIDON_CONV_MEASURE='maybe': use 1 or 0"):
        net()


def test_shape_keys_tell_apart_what_changes_the_timing():
    base = routes.LayerShape(2, 3, 8, 8, 4, Geometry(3, 3, 1, 1, 1, 1, 1, 1), 1, "float32",
                             "cpu, 2 threads", True, True)
    variants = [base._replace(n=4), base._replace(c=4), base._replace(h=9), base._replace(o=5),
                base._replace(geom=Geometry(3, 3, 1, 1, 0, 0, 1, 1)), base._replace(group=3),
                base._replace(dtype="float64"), base._replace(device="gpu NVIDIA H100"),
                base._replace(input_grad=False), base._replace(weight_grad=False)]
    assert len({v.key() for v in variants + [base]}) == len(variants) + 1
    assert base.candidates() == ["im2col", "fourier", "winograd"]
    assert base._replace(geom=Geometry(3, 3, 2, 2, 1, 1, 1, 1)).candidates() == ["im2col"]


def test_cache_folder_follows_poseidon_cache_dir_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("POSEIDON_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert route_cache.cache_path() == str(tmp_path / "home" / ".cache" / "poseidon" /
                                           "conv-routes.json")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert route_cache.cache_path() == str(tmp_path / "xdg" / "poseidon" / "conv-routes.json")
    monkeypatch.setenv("POSEIDON_CACHE_DIR", str(tmp_path / "mine"))
    assert route_cache.cache_path() == str(tmp_path / "mine" / "conv-routes.json")


def test_an_unwritable_cache_leaves_the_routes_for_this_process(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = str(blocker / "conv-routes.json")          # its folder is a file
    with caplog.at_level(logging.WARNING, logger="poseidon"):
        route_cache.write_route(path, "m", "k", "im2col", {"im2col": 0.001})
    assert "cannot write the convolution route cache" in caplog.text
    assert route_cache.read_routes(path, "m") == {}


@pytest.mark.measures_conv_routes
def test_timing_leaves_the_random_stream_alone(measuring):
    from poseidon.engine import rng
    rng.seed(3)
    want = rng.uniform((5,), numpy, numpy.float64)
    rng.seed(3)
    net_ = net()                                  # the fillers draw the same in both runs
    rng.seed(3)
    net_.Forward()                                # measures
    assert measuring
    numpy.testing.assert_array_equal(rng.uniform((5,), numpy, numpy.float64), want)
