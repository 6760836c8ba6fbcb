"""Compile check of ``csrc/cuda`` with nvcc against the installed torch headers.

Runs wherever nvcc exists, even beside a CPU build of torch: the CPU wheel ships the ATen and
c10/cuda headers but not the one header its CMake build generates for CUDA
(``c10/cuda/impl/cuda_cmake_macros.h``), which the test supplies. The three kernel files are
compiled as one translation unit (the torch headers dominate the time, ~1.5 min on 2 cores).
The binding file is plain C++ and is compiled with the host compiler.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc"),
]


def _includes(tmp_path: Path) -> list[str]:
    from torch.utils import cpp_extension

    shim = tmp_path / "shim" / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{tmp_path / 'shim'}"]


def test_cuda_sources_compile_with_nvcc(tmp_path: Path) -> None:
    from opmux.plugins.cuda import cuda_c

    kernels = [p for p in cuda_c.sources() if p.suffix == ".cu"]
    assert {p.name for p in kernels} == {"activation.cu", "cache.cu", "layernorm.cu"}
    unit = tmp_path / "all_kernels.cu"
    unit.write_text("".join(f'#include "{p}"\n' for p in kernels))
    cmd = ["nvcc", "-c", *cuda_c.CUDA_CFLAGS, "-gencode", "arch=compute_90,code=sm_90",
           *_includes(tmp_path), str(unit), "-o", str(tmp_path / "kernels.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "kernels.o").stat().st_size > 0
    assert "warning" not in proc.stderr.lower(), proc.stderr


def test_binding_file_compiles(tmp_path: Path) -> None:
    from opmux.plugins.cuda import cuda_c

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler")
    (binding,) = [p for p in cuda_c.sources() if p.suffix == ".cpp"]
    cmd = [cxx, "-c", "-std=c++20", "-fPIC", *_includes(tmp_path), str(binding), "-o",
           str(tmp_path / "bindings.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
