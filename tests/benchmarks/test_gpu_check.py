"""The device check (``benchmarks/gpu_kernels.py --check``, ``make gpu-check``) without a GPU:
its one-line exit, and its report written from a CPU conformance run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from opmux.cli import matrix

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # the scripts import each other by name
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path of a machine without a GPU")
def test_without_a_gpu_one_line_and_exit_0(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    gpu_kernels = _load("gpu_kernels")
    assert gpu_kernels.main(["--check", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == ["gpu_kernels: no CUDA/ROCm GPU is available "
                                "(torch.cuda.is_available() is False); nothing to check"]
    assert list(tmp_path.iterdir()) == []


def test_report_from_a_cpu_conformance_run(tmp_path: Path) -> None:
    gpu_check = _load("gpu_check")
    payload = gpu_check.conformance(device="cpu", providers=("cpp",), label="cpu-check",
                                    ops=("rms_norm",))
    assert payload["ok"] and payload["label"] == "cpu-check"
    payload["benchmark"] = {
        "device": "Test GPU", "peak_gbps": 3350.0, "peak_source": "datasheet (H100)",
        "torch": torch.__version__, "rows": [
            {"op": "rms_norm", "shape": "8192x8192 bf16", "contender": "triton",
             "kind": "opmux", "ms": 0.25, "gbps": 1073.7, "peak_share": 0.321,
             "speedup": None, "note": ""},
            {"op": "rms_norm", "shape": "8192x8192 bf16", "contender": "cuda_c",
             "kind": "opmux", "ms": None, "gbps": None, "peak_share": None, "speedup": None,
             "note": "n/a: nvcc | not found"},
            {"op": "rms_norm", "shape": "8192x8192 bf16", "contender": "eager",
             "kind": "baseline", "ms": 1.0, "gbps": 268.4, "peak_share": 0.08,
             "speedup": 4.0, "note": ""}]}
    payload["phases"] = {"conformance": "3 s", "benchmark": "1 s"}
    json_path, md_path = gpu_check.write_report(tmp_path / "out", payload)
    # the JSON is an `opmux check` report that `opmux matrix` merges with the lanes' ones
    report = matrix.load_report(json_path)
    assert report.label == "cpu-check" and report.providers == ["cpp"]
    assert json.loads(json_path.read_text())["benchmark"]["rows"][0]["ms"] == 0.25
    text = md_path.read_text()
    assert text.startswith(f"# GPU check: {payload['device_name']}\n")
    assert "conformance passed" in text
    assert "| op | cpu-check/cpp |" in text and "| opmux::rms_norm | pass" in text
    assert "| rms_norm | 8192x8192 bf16 | triton | 0.2500 | 1073.7 | 32.1% | - |  |" in text
    assert "| rms_norm | 8192x8192 bf16 | cuda_c | - | - | - | - | n/a: nvcc / not found |" in text
    assert "| rms_norm | 8192x8192 bf16 | eager | 1.0000 | 268.4 | 8.0% | 4.00 |  |" in text
    assert "- benchmark: 1 s" in text


def test_conformance_reports_a_broken_check() -> None:
    gpu_check = _load("gpu_check")
    with pytest.raises(RuntimeError, match=r"opmux check exited 2: .*unknown provider"):
        gpu_check.conformance(device="cpu", providers=("no_such_provider",))


@pytest.mark.parametrize("where", ["file", "under-file", "read-only"])
def test_a_bad_out_is_refused_before_the_run(tmp_path: Path, where: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import os

    gpu_kernels = _load("gpu_kernels")
    (tmp_path / "f").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    out = {"file": tmp_path / "f", "under-file": tmp_path / "f" / "report",
           "read-only": locked / "report"}[where]
    if where == "read-only" and os.access(locked, os.W_OK):
        pytest.skip("this user writes into read-only folders (root)")
    ran: list[int] = []
    gpu_kernels.run = lambda *a, **k: ran.append(1)  # the run must not start
    assert gpu_kernels.main(["--check", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpu_kernels: error: --out {out}: ") and err.count("\n") == 1
    assert ran == []


def test_check_out_takes_a_new_folder_under_a_writable_one(tmp_path: Path) -> None:
    gpu_check = _load("gpu_check")
    assert gpu_check.check_out(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()  # made when the report is written
