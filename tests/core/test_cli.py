"""The opmux command: info and explain, human and JSON output, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from opmux import cli


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
