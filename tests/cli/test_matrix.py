"""``opmux matrix``: merging ``opmux check --json`` reports of several machines or lanes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import opmux
from opmux import cli
from opmux.cli import check, matrix
from opmux.testing import Case
from opmux.testing.cases import register_cases, unregister_cases


def _case(name: str, status: str, ratio: float = 0.1, max_abs: float = 1e-5) -> dict[str, Any]:
    return {"name": name, "status": status, "max_abs": max_abs, "max_rel": 0.0, "ratio": ratio,
            "atol": 1e-4, "rtol": 1e-4, "message": "", "seconds": 0.0}


def _entry(op: str, provider: str, verdict: str, cases: list[dict[str, Any]],
           reason: str = "") -> dict[str, Any]:
    return {"op": op, "provider": provider, "device": "cpu", "reason": reason,
            "status": "unsupported" if verdict == "UNSUPPORTED" else "checked",
            "cases": cases, "ok": verdict != "FAIL", "verdict": verdict}


def _write(path: Path, label: str, platform: str, entries: list[dict[str, Any]],
           device_name: str = "Test Device") -> Path:
    path.write_text(json.dumps({
        "format": check.REPORT_FORMAT, "label": label, "platform": platform, "device": "cpu",
        "device_name": device_name, "host": "h", "python": "3.11",
        "created": "2026-01-01T00:00:00+00:00",
        "versions": {"opmux": "0.1.0", "torch": "2.13.0", "triton": None},
        "ok": True, "reports": entries}))
    return path


@pytest.fixture
def disagreeing(tmp_path: Path) -> list[Path]:
    """rms_norm passes on a, fails on b (max error 0.5 against atol/rtol 1e-4), is absent on
    c; silu_and_mul is declined on b."""
    a = _write(tmp_path / "a.json", "gpu", "cuda", [
        _entry("opmux::rms_norm", "triton", "PASS", [_case("fp32", "pass", 0.25)]),
        _entry("opmux::silu_and_mul", "triton", "PASS", [_case("fp32", "pass")])])
    b = _write(tmp_path / "b.json", "rocm", "rocm", [
        _entry("opmux::rms_norm", "triton", "FAIL",
               [_case("fp32", "pass"), _case("bf16", "fail", ratio=2500.0, max_abs=0.5),
                _case("raise", "error", ratio=0.0)]),
        _entry("opmux::silu_and_mul", "triton", "UNSUPPORTED", [],
               reason="torch.cuda.is_available() is False\nmore")])
    c = _write(tmp_path / "c.json", "cpu", "cpu", [
        _entry("opmux::silu_and_mul", "cpp", "PASS", [_case("fp32", "pass")])])
    return [a, b, c]


def test_merge_reports_that_disagree(disagreeing: list[Path]) -> None:
    m = matrix.merge([matrix.load_report(p) for p in disagreeing])
    assert m.columns == [("gpu", "triton"), ("rocm", "triton"), ("cpu", "cpp")]
    assert list(m.rows) == ["opmux::rms_norm", "opmux::silu_and_mul"]
    rms = m.rows["opmux::rms_norm"]
    assert [c.status for c in rms] == ["pass", "fail", "absent"]
    assert rms[0].ratio == 0.25
    assert rms[1].detail == ("2/3 cases; max err 0.5 vs atol 0.0001 rtol 0.0001 (x2.5e+03); "
                             "1 raised")
    silu = m.rows["opmux::silu_and_mul"]
    assert [c.status for c in silu] == ["pass", "declined", "pass"]
    assert silu[1].detail == "torch.cuda.is_available() is False"
    text = matrix.format_markdown(m)
    assert "| op | gpu/triton | rocm/triton | cpu/cpp |" in text
    assert ("| opmux::rms_norm | pass (err/tol 0.25) | fail (2/3 cases; max err 0.5 vs atol "
            "0.0001 rtol 0.0001 (x2.5e+03); 1 raised) | absent |") in text
    assert "| **total** | 2 pass | 1 fail, 1 declined | 1 pass, 1 absent |" in text
    assert "| gpu | cuda | cpu: Test Device | opmux 0.1.0, torch 2.13.0 |" in text


def test_cli_markdown_json_and_missing_reports(disagreeing: list[Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "xla.json")
    assert cli.main(["matrix", *map(str, disagreeing), missing, "--allow-missing"]) == 0
    out = capsys.readouterr().out
    assert f"| xla | absent | - | report {missing} not written" in out
    assert cli.main(["matrix", *map(str, disagreeing), missing, "--allow-missing",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["absent_reports"] == [missing]
    assert data["columns"] == ["gpu/triton", "rocm/triton", "cpu/cpp"]
    cells = {row["op"]: row["cells"] for row in data["rows"]}
    assert cells["opmux::rms_norm"]["cpu/cpp"]["status"] == "absent"
    assert cells["opmux::rms_norm"]["rocm/triton"]["max_abs"] == 0.5
    assert [r["platform"] for r in data["reports"]] == ["cuda", "rocm", "cpu"]
    # without --allow-missing a missing report is an error naming the way out
    assert cli.main(["matrix", str(disagreeing[0]), missing]) == 2
    assert "xla.json: no such file (pass --allow-missing" in capsys.readouterr().err


def test_same_labels_are_told_apart(tmp_path: Path) -> None:
    entry = [_entry("opmux::rms_norm", "triton", "PASS", [_case("fp32", "pass")])]
    reports = [matrix.load_report(_write(tmp_path / f"{i}.json", "cuda", "cuda", entry, name))
               for i, name in enumerate(("H100", "A100", "A100"))]
    assert [c[0] for c in matrix.merge(reports).columns] == ["cuda (H100)", "cuda (A100) #2",
                                                             "cuda (A100) #3"]


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", r"not JSON \(Expecting property name"),
    ("[1, 2]", r"not an `opmux check --json` report \(no 'reports' list\)"),
    ('{"reports": []}', r"report format None, expected 'opmux-check/1'"),
    ('{"format": "opmux-check/1", "reports": [], "label": "x"}',
     r"header lacks \['platform', 'device', 'device_name', 'versions'\]"),
])
def test_bad_report_files(tmp_path: Path, content: str, message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(matrix.ReportError, match=message) as info:
        matrix.load_report(bad)
    assert info.value.path == str(bad) and isinstance(info.value, opmux.OpmuxError)
    assert isinstance(info.value, ValueError)


def test_malformed_entry_and_cli_error(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path / "bad.json", "x", "cpu", [{"op": "opmux::rms_norm"}])
    with pytest.raises(matrix.ReportError, match=r"reports\[0\] is malformed \(KeyError"):
        matrix.load_report(bad)
    assert cli.main(["matrix", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"opmux: error: {bad}: reports[0] is malformed")


# ------------------------------------------------------------------ the check header
@pytest.fixture
def scaled(registry: opmux.OpRegistry, ns: str) -> Iterator[opmux.Op]:
    @opmux.register_op(namespace=ns, registry=registry)
    def scale_rows(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    @scale_rows.register_impl("good", dispatch_key="CPU")
    def _(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    register_cases(f"{ns}::scale_rows",
                   lambda: [Case("fp32", (torch.ones(2, 3), 3.0))])
    yield scale_rows
    unregister_cases(f"{ns}::scale_rows")


def test_check_json_header_round_trips_through_matrix(
        scaled: opmux.Op, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(opmux, "list_ops", lambda: [scaled])
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    assert check.run(parser.parse_args(["--json", "--label", "core"])) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["format"] == check.REPORT_FORMAT and payload["label"] == "core"
    assert payload["platform"] == opmux.current_platform().name
    assert payload["device"] == "cpu" and payload["device_name"]
    versions = payload["versions"]
    assert versions["opmux"] == opmux.__version__ and versions["torch"] == torch.__version__
    assert {"triton", "torch_xla", "mindspore", "vllm"} <= set(versions)
    report = tmp_path / "core.json"
    report.write_text(json.dumps(payload))
    m = matrix.merge([matrix.load_report(report)])
    assert m.columns == [("core", "good")]
    assert [c.status for c in m.rows[scaled.qualname]] == ["pass"]
