"""The vendor's journey, from the vendor's side, as docs/vendor-tutorial.md walks it.

The example plugin and opmux are built as wheels, installed (not editable) into a fresh
virtual environment, and a model run on the plugin's platform must show the plugin's
kernels in its trace; after the plugin is uninstalled opmux runs clean.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "vendor-tutorial.md"

#: the commands of the tutorial this test runs, in its order (the page must show each)
STEPS = (
    "pip wheel --no-deps -w dist .",
    "pip install dist/opmux_example_vendor-0.1.0-py3-none-any.whl",
    "opmux info",
    "OPMUX_EXAMPLE_PLATFORM=1 opmux check --provider example_vendor",
    "OPMUX_EXAMPLE_PLATFORM=1 OPMUX_TRACE=trace.json opmux demo",
    "pip uninstall -y opmux-example-vendor",
)


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          **kw)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_the_tutorial_shows_every_step_this_test_takes() -> None:
    text, at = TUTORIAL.read_text(), 0
    for step in STEPS:  # each one after the one before
        found = text.find(step, at)
        assert found >= 0, f"docs/vendor-tutorial.md shows no {step!r} after the steps before"
        at = found + len(step)


@pytest.mark.slow
def test_a_wheel_installed_vendor_plugin_serves_a_model_run(tmp_path: Path) -> None:
    env = dict(os.environ, PIP_CONSTRAINT="/dev/null")
    env.pop("PYTHONPATH", None)
    for var in [v for v in env if v.startswith("OPMUX_") and v != "OPMUX_CACHE_DIR"]:
        del env[var]
    dist = tmp_path / "dist"
    # the builds run from copies, so the checkout is left as it was
    for name, src in (("opmux", ROOT), ("vendor", ROOT / "examples" / "vendor_plugin")):
        copy = tmp_path / name
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns(
            ".git", "build", "*.egg-info", "__pycache__", ".*_cache", "examples", "tests",
            "benchmarks") if name == "opmux" else shutil.ignore_patterns("build", "*.egg-info"))
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
              "-w", str(dist), str(copy)], env=env)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py, opmux_cli = venv / "bin" / "python", venv / "bin" / "opmux"
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"  # the CPU build of this lane
    wheels = sorted(str(w) for w in dist.glob("*.whl"))
    _run([str(py), "-m", "pip", "install", "-q", torch_pin, "ninja", *wheels], env=env)

    info = _run([str(opmux_cli), "info", "--json"], env=env, cwd=tmp_path)
    plugins = {p["name"]: p["status"] for p in json.loads(info.stdout)["plugins"]}
    assert plugins["example_vendor"] == "loaded" and info.stderr == ""

    on = dict(env, OPMUX_EXAMPLE_PLATFORM="1")
    _run([str(opmux_cli), "check", "--provider", "example_vendor"], env=on, cwd=tmp_path)
    trace = tmp_path / "trace.json"
    demo = _run([str(opmux_cli), "demo", "--layers", "2", "--steps", "4"],
                env=dict(on, OPMUX_TRACE=str(trace)), cwd=tmp_path)
    assert "platform example_accel" in demo.stdout
    counts = json.loads(trace.read_text())
    for op in ("rms_norm", "silu_and_mul"):
        assert counts[op].get("example_vendor", 0) > 0, counts[op]

    _run([str(py), "-m", "pip", "uninstall", "-q", "-y", "opmux-example-vendor"], env=env)
    after = _run([str(opmux_cli), "demo", "--layers", "2", "--steps", "2"], env=on,
                 cwd=tmp_path)
    assert "platform cpu" in after.stdout and after.stderr == ""
    info = _run([str(opmux_cli), "info", "--json"], env=env, cwd=tmp_path)
    assert "example_vendor" not in {p["name"] for p in json.loads(info.stdout)["plugins"]}
