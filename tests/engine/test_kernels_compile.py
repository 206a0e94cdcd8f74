"""Every CUDA source of engine/kernels compiles with nvcc (to PTX, no GPU needed) and defines
exactly the kernels the loader names: a kernel lost to a typo in its `extern "C"`, or one the
loader does not know, fails here. Skipped with the reason where nvcc is not installed. The PTX is
kept in the temp folder under the hash of the text compiled, so an unchanged source is not
compiled again in the next session."""
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from poseidon.engine import kernels

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (the CUDA toolkit "
                                                      "compiles the kernels to PTX)")
ENTRY = re.compile(r"^(?:\.visible\s+)?\.entry\s+(\w+)\(", re.MULTILINE)


def compile_ptx(text, real="float"):
    """The PTX nvcc makes of source text (with the shared header pasted in) for element type
    real; an error names the compiler's complaint."""
    digest = hashlib.sha256(f"{real}\n{text}".encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "poseidon-kernels-ptx"
    folder.mkdir(exist_ok=True)
    ptx = folder / f"{digest}.ptx"
    if not ptx.exists():
        unit = folder / f"{digest}.{os.getpid()}.cu"
        unit.write_text(text)
        partial = folder / f"{digest}.{os.getpid()}.ptx"
        done = subprocess.run([NVCC, "--ptx", f"-Dreal_t={real}", "-o", str(partial), str(unit)],
                              capture_output=True, text=True)
        unit.unlink()
        assert done.returncode == 0, f"nvcc failed:\n{done.stderr}"
        os.replace(partial, ptx)
    return ptx.read_text()


@pytest.mark.parametrize("source", sorted(kernels.KERNELS))
def test_source_compiles_to_the_kernels_the_loader_names(source):
    entries = ENTRY.findall(compile_ptx(kernels.source_text(source)))
    assert len(entries) == len(kernels.KERNELS[source])
    assert sorted(entries) == sorted(kernels.KERNELS[source])


def test_the_loader_names_every_source_in_the_folder():
    on_disk = sorted(p.name for p in kernels.HERE.glob("*.cu"))
    assert on_disk == sorted(kernels.KERNELS)
    assert len(set(kernels.kernel_names())) == len(kernels.kernel_names())


@pytest.mark.parametrize("real", ["float", "double"])
def test_the_module_text_is_self_contained(real):
    """What the loader gives NVRTC, all sources as one unit, has no #include left (NVRTC has no
    include path) and compiles to every kernel once, for both element types."""
    text = kernels.module_text()
    assert not re.search(r"^\s*#\s*include", text, re.MULTILINE)
    assert sorted(ENTRY.findall(compile_ptx(text, real))) == sorted(kernels.kernel_names())
