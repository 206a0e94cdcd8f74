import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
SHARED_MODELS = ROOT.parent / "shared" / "caffe-models"

# The suite never times convolution routes (POSEIDON_CONV=auto would, at each new layer shape, and
# write the user's cache folder): with measuring off, 'auto' takes the fallback order, here and in
# every process a test starts. Tests about measuring are marked `measures_conv_routes`, turn it on
# themselves and point POSEIDON_CACHE_DIR at a temporary folder.
os.environ["POSEIDON_CONV_MEASURE"] = "0"


def pytest_configure(config):
    config.addinivalue_line("markers", "measures_conv_routes: the test times convolution routes "
                                       "(on tiny shapes, with a temporary route cache)")


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
