"""The wheel carries what an installed opmux needs: sources to compile, typing, entry points."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_ships_sources_typing_and_entry_points(tmp_path: Path) -> None:
    env = dict(os.environ, PIP_CONSTRAINT="/dev/null")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, env=env, timeout=300)
    (wheel,) = tmp_path.glob("opmux-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    for src in ("cpu/bindings.cpp", "cpu/paged_attention.cpp", "cuda/bindings.cpp",
                "ascend/ms_module/module.cpp", "ascend/ascendc/adv_step_flash.c"):
        assert f"opmux/_csrc/{src}" in names
    assert "opmux/py.typed" in names
    assert "[opmux.plugins]" in entry_points and "cpu = opmux.plugins.cpu" in entry_points
    assert "opmux_conformance = opmux.testing.pytest_plugin" in entry_points
    assert "opmux = opmux.cli:main" in entry_points
