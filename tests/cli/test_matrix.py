"""``opmux matrix``: merging ``opmux check --json`` reports of several machines or lanes."""

from __future__ import annotations

import argparse
import json
import re
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
    ("[1, 2]", r"report: field \(top level\): expected an object, got an array"),
    ('{"reports": []}', r"field format: expected one of opmux-check/1, opmux-check/2, got "
                        r"nothing \(it is missing\)"),
    ('{"format": "opmux-check/2", "reports": [], "label": "x"}',
     r"field platform: expected a string, got nothing"),
    ("[" * 100_000 + "]" * 100_000, r"bad.json: nested too deep"),
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
    with pytest.raises(matrix.ReportError, match=r"field reports\[0\]\.provider: expected a "
                                                 r"string, got nothing"):
        matrix.load_report(bad)
    assert cli.main(["matrix", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opmux: error: {bad}: not an `opmux check --json` report: field "
                          f"reports[0].provider") and err.count("\n") == 1


_PASS = [_case("fp32", "pass")]


@pytest.mark.parametrize(("entries", "field", "message"), [
    ([_entry("opmux::rms_norm", "cpp", "PASS", {"a": 1})],  # type: ignore[arg-type]
     "reports[0].cases", "expected an array, got an object"),
    ([_entry("opmux::rms_norm", "cpp", "PASS", ["fp32", "bf16"])],  # type: ignore[list-item]
     "reports[0].cases[0]", "expected an object, got a string"),
    ([_entry("opmux::rms_norm", "cpp", "PASSED", _PASS)],
     "reports[0].verdict", "expected one of PASS, FAIL, SKIP, UNSUPPORTED, got 'PASSED'"),
    ([_entry("opmux::rms_norm", "cpp", "FAIL", _PASS)],
     "reports[0].verdict", "FAIL does not match its cases' statuses ['pass']"),
    ([_entry("opmux::rms_norm", "cpp", "SKIP", _PASS)],
     "reports[0].verdict", "SKIP does not match"),
    ([_entry("opmux::rms_norm", "cpp", "PASS", [{**_case("a", "pass"), "ratio": "x"}])],
     "reports[0].cases[0].ratio", "expected a number or one of \"inf\""),
    ([_entry("opmux::rms_norm", "cpp", "PASS", [{**_case("a", "pass"), "max_abs": True}])],
     "reports[0].cases[0].max_abs", "got True"),
    ([_entry("opmux::rms_norm", "cpp", "PASS", [_case("a", "passed")])],
     "reports[0].cases[0].status", "expected one of pass, fail, error, skip"),
    ([_entry("opmux::rms_norm", "Bad Name", "PASS", _PASS)],
     "reports[0].provider", "expected a provider name"),
    ([_entry("", "cpp", "PASS", _PASS)], "reports[0].op", "expected a non-empty string"),
    ([_entry("opmux::rms_norm", "cpp", "PASS", _PASS)] * 2,
     "reports[1]", "op 'opmux::rms_norm' x provider 'cpp' again (first in reports[0])"),
    ([[1]], "reports[0]", "expected an object, got an array"),
])
def test_reports_are_checked_against_the_schema(tmp_path: Path, entries: list[Any],
                                                field: str, message: str) -> None:
    bad = _write(tmp_path / "bad.json", "x", "cpu", entries)
    with pytest.raises(matrix.ReportError) as info:
        matrix.load_report(bad)
    text = str(info.value)
    assert text.startswith(f"{bad}: not an `opmux check --json` report: field {field}: ")
    assert message in text and "\n" not in text


@pytest.mark.parametrize(("patch", "field"), [
    ({"label": ""}, "label"), ({"label": 3}, "label"), ({"versions": [1]}, "versions"),
    ({"versions": {"torch": 2}}, "versions.torch"), ({"ok": "yes"}, "ok"),
    ({"reports": {"a": 1}}, "reports"), ({"format": "opmux-check/9"}, "format"),
    ({"created": 5}, "created")])
def test_report_headers_are_checked_against_the_schema(tmp_path: Path, patch: dict[str, Any],
                                                       field: str) -> None:
    path = _write(tmp_path / "bad.json", "x", "cpu", [])
    path.write_text(json.dumps({**json.loads(path.read_text()), **patch}))
    with pytest.raises(matrix.ReportError, match=rf"report: field {re.escape(field)}: "):
        matrix.load_report(path)


def test_a_report_that_is_not_utf8_names_the_file(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "latin.json"
    bad.write_bytes(b'{"label": "caf\xe9"}')
    assert cli.main(["matrix", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opmux: error: {bad}: not JSON (") and "utf-8" in err
    assert err.count("\n") == 1


def test_labels_are_unique_by_construction(tmp_path: Path) -> None:
    # the first label is written as the other two would be renamed: no two columns may
    # share a title, and each column shows its own report's cells
    good = [_entry("opmux::rms_norm", "cpp", "PASS", _PASS)]
    bad = [_entry("opmux::rms_norm", "cpp", "FAIL", [_case("bf16", "fail", ratio=3.0)])]
    paths = [_write(tmp_path / "0.json", "x (D) #2", "cpu", good, "D"),
             _write(tmp_path / "1.json", "x", "cpu", bad, "D"),
             _write(tmp_path / "2.json", "x", "cpu", good, "D")]
    m = matrix.merge([matrix.load_report(p) for p in paths])
    labels = [label for label, _ in m.columns]
    assert len(set(labels)) == 3, labels
    assert [c.status for c in m.rows["opmux::rms_norm"]] == ["pass", "fail", "pass"]
    cells = {row["op"]: row["cells"] for row in m.as_dict()["rows"]}["opmux::rms_norm"]
    assert [cells[f"{label}/cpp"]["status"] for label in labels] == ["pass", "fail", "pass"]


def test_matrix_json_is_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a format-1 report may carry bare NaN / Infinity; the matrix never passes them on
    path = _write(tmp_path / "old.json", "old", "cpu", [
        _entry("opmux::rms_norm", "cpp", "FAIL",
               [_case("inf", "fail", ratio=float("inf"), max_abs=float("inf"))]),
        _entry("opmux::silu_and_mul", "cpp", "FAIL",
               [_case("nan", "fail", ratio=float("nan"), max_abs=float("nan"))])])
    path.write_text(path.read_text().replace(check.REPORT_FORMAT, "opmux-check/1"))
    assert "Infinity" in path.read_text() and "NaN" in path.read_text()
    assert cli.main(["matrix", str(path), "--json"]) == 0
    out = capsys.readouterr().out

    def refuse(token: str) -> None:
        raise AssertionError(f"not strict JSON: {token}")

    data = json.loads(out, parse_constant=refuse)
    cells = {row["op"]: row["cells"]["old/cpp"] for row in data["rows"]}
    assert cells["opmux::rms_norm"]["ratio"] == "inf"
    assert cells["opmux::silu_and_mul"]["max_abs"] == "nan"
    assert cells["opmux::silu_and_mul"]["status"] == "fail"
    assert "max err inf" in cells["opmux::rms_norm"]["detail"]


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


def test_check_json_is_strict_for_a_provider_that_outputs_inf(
        registry: opmux.OpRegistry, ns: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    @opmux.register_op(namespace=ns, registry=registry)
    def halve(x: torch.Tensor) -> torch.Tensor:
        return x / 2

    @halve.register_impl("overflows", dispatch_key="CPU")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x / 0

    register_cases(f"{ns}::halve", lambda: [Case("fp32", (torch.ones(2, 3),))])
    try:
        monkeypatch.setattr(opmux, "list_ops", lambda: [halve])
        parser = argparse.ArgumentParser()
        check.add_arguments(parser)
        assert check.run(parser.parse_args(["--json"])) == 1
    finally:
        unregister_cases(f"{ns}::halve")
    out = capsys.readouterr().out
    assert "Infinity" not in out and "NaN" not in out
    payload = json.loads(out)
    assert payload["format"] == "opmux-check/2"
    case = payload["reports"][0]["cases"][0]
    assert case["status"] == "fail" and case["max_abs"] == "inf"
    report = tmp_path / "inf.json"
    report.write_text(out)
    cell = matrix.merge([matrix.load_report(report)]).rows[halve.qualname][0]
    assert cell.status == "fail" and cell.max_abs == float("inf")
