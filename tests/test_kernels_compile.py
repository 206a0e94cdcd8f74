"""Every CUDA source of engine/kernels compiles with nvcc (to PTX, no GPU needed) and defines
exactly the kernels the loader names: a kernel lost to a typo in its `extern "C"`, or one the
loader does not know, fails here. Skipped with the reason where nvcc is not installed."""
import re
import shutil
import subprocess

import pytest

from poseidon.engine import kernels

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (the CUDA toolkit "
                                                      "compiles the kernels to PTX)")
ENTRY = re.compile(r"^(?:\.visible\s+)?\.entry\s+(\w+)\(", re.MULTILINE)


@pytest.fixture(scope="module")
def ptx_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("ptx")


@pytest.mark.parametrize("dtype", ["float", "double"])
@pytest.mark.parametrize("source", sorted(kernels.KERNELS))
def test_source_compiles_to_the_kernels_the_loader_names(source, dtype, ptx_folder):
    ptx = ptx_folder / f"{source}.{dtype}.ptx"
    done = subprocess.run([NVCC, "--ptx", f"-Dreal_t={dtype}", "-I", str(kernels.HERE), "-o",
                           str(ptx), str(kernels.HERE / source)], capture_output=True, text=True)
    assert done.returncode == 0, f"nvcc failed on {source}:\n{done.stderr}"
    entries = ENTRY.findall(ptx.read_text())
    assert len(entries) == len(kernels.KERNELS[source])
    assert sorted(entries) == sorted(kernels.KERNELS[source])


def test_the_loader_names_every_source_in_the_folder():
    on_disk = sorted(p.name for p in kernels.HERE.glob("*.cu"))
    assert on_disk == sorted(kernels.KERNELS)
    assert len(set(kernels.kernel_names())) == len(kernels.kernel_names())


def test_the_module_text_is_self_contained(ptx_folder):
    """What the loader gives NVRTC, all sources as one unit, has no #include left (NVRTC has no
    include path) and compiles to every kernel once."""
    text = kernels.module_text()
    assert not re.search(r"^\s*#\s*include", text, re.MULTILINE)
    unit = ptx_folder / "module.cu"
    unit.write_text(text)
    ptx = ptx_folder / "module.ptx"
    done = subprocess.run([NVCC, "--ptx", "-o", str(ptx), str(unit)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(ENTRY.findall(ptx.read_text())) == sorted(kernels.kernel_names())
