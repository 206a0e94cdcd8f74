"""The real Caffe files are found through POSEIDON_CAFFE_MODELS (tests/conftest.py): where the
folder is absent their tests skip with the reason, and under CI=true they fail instead.

Each case runs pytest on tests/engine/test_proto.py's two tests of the real files in a subprocess, with
the variable set as the case needs.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_real_file_tests(folder, ci):
    env = dict(os.environ, POSEIDON_CAFFE_MODELS=str(folder))
    env.pop("CI", None)
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider",
                           "tests/engine/test_proto.py", "-k", "real_prototxt or legacy_v1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_absent_folder_skips_with_the_reason(tmp_path):
    result = run_real_file_tests(tmp_path / "nowhere", ci=False)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 skipped" in result.stdout
    assert f"folder {tmp_path / 'nowhere'} does not exist" in result.stdout
    assert "POSEIDON_CAFFE_MODELS" in result.stdout


def test_absent_folder_fails_under_ci(tmp_path):
    result = run_real_file_tests(tmp_path / "nowhere", ci=True)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "skipped" not in result.stdout
    assert "CI=true, so the tests that read them must run" in result.stdout


def test_the_variable_names_the_folder(tmp_path):
    """The files of the folder it names are the ones tested (a relative one from the root)."""
    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / "tiny.prototxt").write_text(
        'name: "tiny"\nlayer { name: "data" type: "Input" top: "data" }\n')
    result = run_real_file_tests(os.path.relpath(tmp_path, ROOT), ci=True)
    assert "1 passed" in result.stdout, result.stdout[-3000:]   # the parse of tiny.prototxt
    assert "VGG_ILSVRC_19_layers_deploy.prototxt" in result.stdout  # the legacy file: not there
