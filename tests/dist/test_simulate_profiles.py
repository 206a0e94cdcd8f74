"""The simulator's profiles beyond the paper's Caffe models: Inception-v3 (with its auxiliary head),
AlexNet and cifar10_quick (dist/sim/profiles/, dist/sim/profile.py), and the parameter table of
docs/simulate.md.

* each loads, and what it syncs equals an independent count of the builder's net it came from and
  of the real Caffe file (Inception-v3's file lacks the auxiliary head, which the profile adds);
* it is what shipped_profile rebuilds, its step is batch / the stated rate;
* `poseidon simulate --model NAME` runs on it;
* the CLI lists every shipped profile, and the docs' table gives each its profile's count.
"""
import re
from pathlib import Path

import pytest

from poseidon.dist.sim import profile as simprofile
from poseidon.models import MODELS
from poseidon.tools.commands.simulate import SHIPPED_MODELS
from tests.conftest import CAFFE_MODELS, needs_caffe_models
from tests.dist.test_simulate import poseidon
from tests.engine.test_models import count_params, parse_net

ROOT = Path(__file__).resolve().parents[2]
NEW = ("inception_v3", "alexnet", "cifar10_quick")
# the counts as first taken, beside the ones each test computes
EXPECTED = {"inception_v3": 27_161_264, "alexnet": 60_965_224, "cifar10_quick": 145_578}
CAFFE_FILES = {"inception_v3": "inception/deploy_inception-v3.prototxt",
               "alexnet": "bvlc_alexnet/deploy.prototxt",
               "cifar10_quick": "cifar10/cifar10_quick.prototxt"}


def synced_count(prof):
    return sum(p.count for p in prof["description"]["params"])


def builder_net(name):
    return MODELS[name].build(deploy=True, **simprofile.BUILT_VARIANTS.get(name, {}))


@pytest.mark.parametrize("name", NEW)
def test_profile_counts_what_its_builder_builds(name):
    prof = simprofile.load_profile(name)
    total, _ = count_params(builder_net(name))
    assert synced_count(prof) == total == EXPECTED[name]


@needs_caffe_models
@pytest.mark.parametrize("name", NEW)
def test_profile_counts_what_the_caffe_file_holds(name):
    prof = simprofile.load_profile(name)
    in_file, _ = count_params(parse_net(CAFFE_MODELS / CAFFE_FILES[name]))
    aux_layers = {r.index for r in prof["description"]["layers"] if r.name.startswith("aux_")}
    aux = sum(p.count for p in prof["description"]["params"] if p.layer in aux_layers)
    assert synced_count(prof) - aux == in_file
    assert bool(aux) == (name == "inception_v3")      # the Caffe file has no auxiliary head


@pytest.mark.parametrize("name", NEW)
def test_profile_is_its_rebuild_at_the_stated_rate(name):
    prof = simprofile.load_profile(name)
    batch, rate, where = simprofile.OTHER_SINGLE_GPU[name]
    assert prof["batch"] == batch and where in prof["source"]
    step = sum(r["forward_ms"] + r["backward_ms"] for r in prof["layers"])
    assert step == pytest.approx(1e3 * batch / rate, rel=1e-9)
    rebuilt = simprofile.shipped_profile(name, str(ROOT / "prototxt"))
    for key in ("forward_ms", "backward_ms"):
        assert [r[key] for r in rebuilt["layers"]] == \
            pytest.approx([r[key] for r in prof["layers"]], rel=1e-9), key
    assert rebuilt["description"] == prof["description"]


@pytest.mark.parametrize("name", NEW)
def test_cli_simulates_the_profile(tmp_path, name):
    r = poseidon("simulate", "--model", name, "--nodes", "1,4", "--bandwidth", "10GbE",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{name}: batch ")
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["4"])]
    assert [row[0] for row in rows] == ["1", "4"]
    assert all(0 < float(v) <= 4 for v in re.findall(r"([0-9.]+)x", " ".join(rows[1])))


def test_cli_lists_every_shipped_profile():
    assert sorted(SHIPPED_MODELS) == simprofile.shipped_profiles()
    assert sorted(simprofile.PAPER_SINGLE_GPU.keys() | simprofile.OTHER_SINGLE_GPU.keys()) == \
        simprofile.shipped_profiles()


def docs_parameter_table():
    """{profile: count} from the rows of docs/simulate.md's parameter table."""
    text = (ROOT / "docs" / "simulate.md").read_text()
    section = text[text.index("**Parameter counts.**"):]
    rows = {}
    for line in section.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        match = re.match(r"\| `(\w+)` \| ([\d,]+) \|", line)
        if match:
            rows[match.group(1)] = int(match.group(2).replace(",", ""))
    return rows


def test_docs_table_gives_each_profiles_count():
    table = docs_parameter_table()
    assert sorted(table) == simprofile.shipped_profiles()
    for name, count in table.items():
        assert synced_count(simprofile.load_profile(name)) == count, name
