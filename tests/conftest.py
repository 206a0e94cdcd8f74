"""Shared test set-up: the repository on sys.path, and where the real Caffe files are.

About 120 tests read Caffe's own model, solver and deploy files (BVLC's, VGG's, ResNet's, ...),
kept outside this repository. They are found through one variable, POSEIDON_CAFFE_MODELS (a
relative path is taken from the repository root; default ../shared/caffe-models). Where the
folder is absent those tests are skipped with the reason, but under CI=true they fail: a CI run
that quietly skipped them would report a green suite that never checked Caffe compatibility.

Tests use `needs_caffe_models` (a marker), `require_caffe_models(path)` inside a test, or
`caffe_model_files(pattern)` to parametrize over the files.
"""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CAFFE_MODELS = (ROOT / os.environ.get("POSEIDON_CAFFE_MODELS", "../shared/caffe-models")).resolve()
SHARED_MODELS = CAFFE_MODELS            # the name older tests import
IN_CI = os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")

needs_caffe_models = pytest.mark.caffe_models


def require_caffe_models(path=None):
    """`path` (default the folder itself) when it exists; otherwise skip the test with the
    reason, or fail it when CI=true."""
    target = CAFFE_MODELS if path is None else Path(path)
    if target.exists():
        return target
    what = "folder" if path is None else "file"
    reason = (f"the real Caffe files are not present ({what} {target} does not exist): set "
              f"POSEIDON_CAFFE_MODELS to the folder holding them")
    if IN_CI:
        pytest.fail(f"{reason}; CI=true, so the tests that read them must run", pytrace=False)
    pytest.skip(reason)


def caffe_model_files(pattern):
    """The files under the folder matching `pattern` (sorted), for parametrize; where the folder
    is absent, one placeholder case that skips (or fails under CI) like any other such test."""
    if CAFFE_MODELS.is_dir():
        return sorted(CAFFE_MODELS.rglob(pattern))
    return [pytest.param(None, marks=needs_caffe_models, id="caffe-models-missing")]


def pytest_configure(config):
    config.addinivalue_line("markers", "caffe_models: reads the real Caffe files "
                            "(POSEIDON_CAFFE_MODELS); skipped where absent, failed under CI=true")
    config.addinivalue_line("markers", "measures_conv_routes: the test times convolution routes "
                                       "(on tiny shapes, with a temporary route cache)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("caffe_models") is not None:
        require_caffe_models()


@pytest.fixture
def caffe_models():
    """The folder of the real Caffe files (skips, or fails under CI=true, where absent)."""
    return require_caffe_models()


# The suite never times convolution routes (POSEIDON_CONV=auto would, at each new layer shape, and
# write the user's cache folder): with measuring off, 'auto' takes the fallback order, here and in
# every process a test starts. Tests about measuring are marked `measures_conv_routes`, turn it on
# themselves and point POSEIDON_CACHE_DIR at a temporary folder.
os.environ["POSEIDON_CONV_MEASURE"] = "0"


@pytest.fixture(autouse=True)
def _no_route_timing(request, monkeypatch):
    """Outside tests marked measures_conv_routes, timing a route is a failure, not a slow pass."""
    if request.node.get_closest_marker("measures_conv_routes"):
        return

    def refuse(shape, *args, **kwargs):
        raise AssertionError(f"this test timed convolution routes for {shape.key()}: pin "
                             f"POSEIDON_CONV or leave POSEIDON_CONV_MEASURE at 0")

    from poseidon.engine.layers.conv import measure
    monkeypatch.setattr(measure, "time_routes", refuse)


@pytest.fixture(autouse=True)
def _engine_settings_per_test():
    """What a test gives settings.configure (itself, or through a command run in-process) ends
    with it, as the environment's changes end with monkeypatch."""
    yield
    from poseidon.engine import settings
    settings.reset()
