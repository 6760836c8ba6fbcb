"""The opmux command: info, explain, check, bench, build; human and JSON output, one-line
errors; one table printer."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import opmux
from opmux import cli
from opmux.cli import check
from opmux.cli.table import format_table
from opmux.testing import Case, ProviderReport, register_cases
from opmux.testing.cases import unregister_cases


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["platform"]["name"] == "cpu"
    assert {d["name"] for d in data["detectors"]} >= {"cuda", "xla", "ascend", "rocm"}
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["cpu"]["status"] == "loaded"
    assert plugins["cuda"]["status"] == "skipped"
    ops = {o["op"]: o for o in data["ops"]}
    assert "opmux::rms_norm" in ops
    assert ops["opmux::rms_norm"]["priority"][-1] == "native"
    assert data["versions"]["torch"]


def test_info_human_is_an_aligned_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("platform: cpu")
    header = next(line for line in out.splitlines() if line.startswith("op "))
    assert "provider" in header and "key" in header and "supported" in header


def test_explain(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "rms_norm", "--shape", "4,64", "--shape", "64",
                     "--dtype", "float32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["op"] == "opmux::rms_norm" and data["chosen"]
    assert cli.main(["explain", "rms_norm", "--shape", "4,64", "--shape", "64"]) == 0
    assert "runs" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["explain", "no_such_op"], "no op named 'no_such_op'"),
    (["explain", "rms_norm", "--shape", "4,64"], "give one --shape per Tensor"),
    (["explain", "rms_norm", "--shape", "4", "--shape", "4", "--dtype", "f77"], "unknown dtype"),
])
def test_errors_are_one_line(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "opmux.cli", *argv],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--op", "rms_norm", "--repeat", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    providers = {r["provider"]: r for r in rows}
    assert {"cpp", "native"} <= set(providers)
    assert providers["native"]["speedup_vs_native"] == 1.0
    assert all(r["ms"] > 0 for r in rows)
    assert cli.main(["bench", "--op", "nope"]) == 2


def test_python_dash_m_and_console_script_target() -> None:
    proc = subprocess.run([sys.executable, "-m", "opmux.cli", "--help"], capture_output=True,
                          text=True, check=True)
    for command in ("info", "explain", "check", "bench", "demo", "build"):
        assert command in proc.stdout
    assert cli.main is opmux.cli.main  # pyproject: opmux = "opmux.cli:main"


def test_one_table_printer_aligns_and_strips() -> None:
    text = format_table([("a", 1, ""), ("long name", 22, "x")], ("col", "n", "note"))
    assert text.splitlines() == ["col        n   note", "---------  --  ----",
                                 "a          1", "long name  22  x"]


# ------------------------------------------------------------------ opmux check
@pytest.fixture
def scaled(registry: opmux.OpRegistry, ns: str) -> Iterator[opmux.Op]:
    @opmux.register_op(namespace=ns, registry=registry)
    def scale_rows(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    def gen() -> Iterator[Case]:
        g = torch.Generator().manual_seed(0)
        yield Case("fp32-basic", (torch.randn(4, 8, generator=g), 3.0))
        yield Case("fp32-empty", (torch.zeros(0, 8), 3.0))

    register_cases(f"{ns}::scale_rows", gen)
    yield scale_rows
    unregister_cases(f"{ns}::scale_rows")


def _check_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_check_table_and_json(scaled: opmux.Op, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    @scaled.register_impl("good", dispatch_key="CPU")
    def _(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    @scaled.register_impl("off", dispatch_key="CPU")
    def _off(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor + 1

    monkeypatch.setattr(opmux, "list_ops", lambda: [scaled])
    assert check.run(_check_args("--provider", "good")) == 0
    table = capsys.readouterr().out
    assert "PASS" in table and "1/1 provider checks passed" in table
    assert check.run(_check_args()) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "off" in out and "beyond tolerance" in out
    assert check.run(_check_args("--json")) == 1
    payload = json.loads(capsys.readouterr().out)
    verdicts = {r["provider"]: r["verdict"] for r in payload["reports"]}
    assert verdicts == {"good": "PASS", "off": "FAIL"} and payload["ok"] is False
    assert check.run(_check_args("--provider", "missing")) == 2
    assert "unknown provider(s) ['missing']" in capsys.readouterr().err
    assert check.run(_check_args("--op", "nope")) == 2


def test_check_on_the_real_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["check", "--op", "rms_norm", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert all(r["op"] == "opmux::rms_norm" for r in payload["reports"])
    assert code == (0 if all(r["ok"] for r in payload["reports"]) else 1)
    assert isinstance(ProviderReport("a", "b", "cpu", "checked").as_dict()["ok"], bool)


def test_build_reports_the_cached_library(capsys: pytest.CaptureFixture[str]) -> None:
    from opmux.plugins.cpu import build

    ok, message = build.build_status()
    assert cli.main(["build"]) == (0 if ok else 1)
    assert capsys.readouterr().out.strip() == ("built: " if ok else "build failed: ") + message


def test_a_mistyped_compile_mode_is_refused_with_a_suggestion(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from opmux.core import config

    monkeypatch.setenv("OPMUX_COMPILE_MODE", "indcutor")
    with pytest.raises(opmux.ConfigError, match="got 'indcutor' \\(did you mean 'inductor'\\?\\)"):
        config.compile_mode_spec()
    monkeypatch.setenv("OPMUX_COMPILE_MODE", "eager")  # a registered torch.compile backend
    assert config.compile_mode_spec() == "eager"
