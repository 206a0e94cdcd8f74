"""type: "Python" layers (pycaffe-style classes) and layers registered with @engine.register."""
import importlib
import sys

import numpy
import pytest

from poseidon import engine
from poseidon.engine.blob import Blob
from poseidon.engine.layer import TEST, TRAIN
from tests.engine.harness import check_gradient, make_layer, run_forward

LayerError = engine.errors.LayerError
MODULE = "poseidon_test_pylayers"

SOURCE = '''
from poseidon import engine

CALLS = []


class ScaleByParam(engine.Layer):
    """pycaffe style: setup is the one-time set-up; a learnable per-column weight."""
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        CALLS.append(("setup", self.param_str, self.phase, len(self.blobs)))
        self.factor = float(self.param_str)
        self.blobs.add_blob(bottom[0].shape[1])
        self.blobs[0].data[...] = self.xp.arange(1, bottom[0].shape[1] + 1)

    def reshape(self, bottom, top):
        CALLS.append(("reshape",))
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.factor * bottom[0].data * self.blobs[0].data

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[...] += self.factor * (top[0].diff * bottom[0].data).sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff[...] = self.factor * top[0].diff * self.blobs[0].data


class SquaredSum(engine.Layer):
    """A loss in pycaffe style (no blob-count declarations, not a LossLayer)."""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("Need two inputs to compute distance.")

    def reshape(self, bottom, top):
        self.diff = self.xp.zeros_like(bottom[0].data)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = (self.diff ** 2).sum() / bottom[0].num / 2.0

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if propagate_down[i]:
                sign = 1 if i == 0 else -1
                bottom[i].diff[...] = sign * self.diff * top[0].diff[0] / bottom[i].num


class EngineStyle(engine.Layer):
    """The engine's own contract (layer_setup), reached through type: "Python"."""
    exact_bottoms = 1

    def layer_setup(self, bottom, top):
        self.offset = float(self.param_str or 0)
        self.add_param((1,), fill_value=2.0)

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.blobs[0].data * bottom[0].data + self.offset

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff += (top[0].diff * bottom[0].data).sum()
        if propagate_down[0]:
            bottom[0].diff[...] = self.blobs[0].data * top[0].diff


class NotALayer:
    def setup(self, bottom, top):
        pass


def not_a_class():
    pass
'''


@pytest.fixture(scope="module", autouse=True)
def layer_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pylayers")
    (folder / f"{MODULE}.py").write_text(SOURCE)
    (folder / "poseidon_test_broken.py").write_text("import nonexistent_dependency_xyz\n")
    (folder / "poseidon_test_raises.py").write_text("raise RuntimeError('boom at import')\n")
    sys.path.insert(0, str(folder))
    yield
    sys.path.remove(str(folder))
    for name in (MODULE, "poseidon_test_broken", "poseidon_test_raises"):
        sys.modules.pop(name, None)


def python_layer(cls, param_str="", extra="", phase=TRAIN):
    return make_layer(f'type: "Python" {extra} python_param {{ module: "{MODULE}" layer: "{cls}" '
                      f'param_str: "{param_str}" }}', phase=phase)


def calls():
    return importlib.import_module(MODULE).CALLS


def test_pycaffe_style_layer_forward_and_setup_order():
    calls().clear()
    layer = python_layer("ScaleByParam", "2.5", phase=TEST)
    assert type(layer).__name__ == "ScaleByParam" and isinstance(layer, engine.Layer)
    assert layer.type == "Python" and layer.param_str == "2.5" and layer.phase == TEST
    x = numpy.random.RandomState(0).standard_normal((4, 3))
    _, top = run_forward(layer, [x])
    # param_str and phase were set before setup; setup ran once, then reshape (set-up and the run)
    assert calls() == [("setup", "2.5", TEST, 0), ("reshape",), ("reshape",)]
    numpy.testing.assert_allclose(top[0].data, 2.5 * x * numpy.arange(1, 4), rtol=1e-12)
    assert len(layer.blobs) == 1 and layer.param_propagate_down == [True]
    assert layer.loss_weights == [0.0]


def test_pycaffe_style_layer_gradient_including_params():
    layer = python_layer("ScaleByParam", "-1.5")
    check_gradient(layer, [numpy.random.RandomState(1).standard_normal((3, 4))])


def test_pycaffe_style_loss_layer():
    rs = numpy.random.RandomState(2)
    a, b = rs.standard_normal((4, 3)), rs.standard_normal((4, 3))
    layer = python_layer("SquaredSum", extra="loss_weight: 1")
    _, top = run_forward(layer, [a, b])
    assert layer.loss_weights == [1.0]
    numpy.testing.assert_allclose(top[0].data, [((a - b) ** 2).sum() / 4 / 2], rtol=1e-12)
    check_gradient(layer, [a, b])


def test_python_layer_is_not_a_loss_layer_by_default():
    layer = python_layer("SquaredSum")
    run_forward(layer, [numpy.ones((2, 2)), numpy.zeros((2, 2))])
    assert layer.loss_weights == [0.0]


def test_blob_count_checks_still_run_around_a_pycaffe_setup():
    calls().clear()
    layer = python_layer("ScaleByParam", "1")
    with pytest.raises(LayerError, match=r"under_test.*Python.*takes 1 bottom"):
        run_forward(layer, [numpy.ones((2, 2)), numpy.ones((2, 2))])
    assert calls() == []  # checked before the class's setup ran
    with pytest.raises(LayerError, match="takes 1 top"):
        run_forward(python_layer("ScaleByParam", "1"), [numpy.ones((2, 2))], n_tops=2)


def test_engine_style_class_through_python_type():
    layer = python_layer("EngineStyle", "0.5")
    x = numpy.random.RandomState(3).standard_normal((2, 3))
    _, top = run_forward(layer, [x])
    numpy.testing.assert_allclose(top[0].data, 2.0 * x + 0.5)
    check_gradient(layer, [x])
    with pytest.raises(LayerError, match="takes 1 bottom"):
        run_forward(python_layer("EngineStyle"), [x, x])


def test_add_blob_makes_layer_dtype_blobs():
    layer = make_layer(f'type: "Python" python_param {{ module: "{MODULE}" layer: "ScaleByParam" '
                       f'param_str: "1" }}', dtype=numpy.float32)
    run_forward(layer, [numpy.ones((2, 3), numpy.float32)], dtype=numpy.float32)
    assert isinstance(layer.blobs[0], Blob) and layer.blobs[0].data.dtype == numpy.float32
    assert layer.blobs[0].shape == (3,)


def test_error_module_not_importable():
    with pytest.raises(LayerError, match=r"'no_such_module_abc'.*sys\.path.*PYTHONPATH"):
        make_layer('type: "Python" python_param { module: "no_such_module_abc" layer: "X" }')


def test_error_module_with_missing_dependency_or_failing_import():
    with pytest.raises(LayerError, match=r"poseidon_test_broken.*nonexistent_dependency_xyz"):
        make_layer('type: "Python" python_param { module: "poseidon_test_broken" layer: "X" }')
    with pytest.raises(LayerError, match=r"poseidon_test_raises.*RuntimeError: boom at import"):
        make_layer('type: "Python" python_param { module: "poseidon_test_raises" layer: "X" }')


def test_error_class_missing():
    with pytest.raises(LayerError, match=r"no class 'Nope'.*ScaleByParam"):
        python_layer("Nope")


def test_error_class_not_a_layer_subclass():
    with pytest.raises(LayerError, match="not a subclass of engine.Layer"):
        python_layer("NotALayer")
    with pytest.raises(LayerError, match="not a subclass of engine.Layer"):
        python_layer("not_a_class")


def test_error_python_param_missing():
    with pytest.raises(LayerError, match="module"):
        make_layer('type: "Python"')
    with pytest.raises(LayerError, match="layer"):
        make_layer(f'type: "Python" python_param {{ module: "{MODULE}" }}')


# ----- the @engine.register route ----------------------------------------------------------------
@engine.register("PoseidonTestTimesTwo")
class TimesTwo(engine.Layer):
    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        top[0].data[...] = 2 * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = 2 * top[0].diff


def test_registered_python_type():
    assert "PoseidonTestTimesTwo" in engine.registered_types()
    layer = make_layer('type: "PoseidonTestTimesTwo"')
    x = numpy.arange(6.0).reshape(2, 3)
    _, top = run_forward(layer, [x])
    numpy.testing.assert_array_equal(top[0].data, 2 * x)
    check_gradient(layer, [x])
