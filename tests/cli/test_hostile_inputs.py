"""The hostile-input suite: every case of ``hostile_table`` is answered
by an opmux error (one stderr line, no traceback, exit status 2, nothing written) or, for
cache and trace files, by one warning naming the file while op calls go on, in a process
under a memory limit (``RLIMIT_AS``) that leaves no process behind.

The cases run in two driver processes (``_hostile_driver.py``: checkpoints and command
lines; cache and trace files), many cases per process; a few real ``opmux`` processes
check the same from the outside.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import hostile_table
import pytest
import torch

from opmux.testing.hostile_surfaces import HOSTILE_SURFACE_CASES

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[1]
_HEADROOM = 3 << 30  # address space the driver may map beyond what torch mapped at import
_CLI = {c["id"]: c for c in hostile_table.CHECKPOINT_AND_CLI_CASES}
_CACHE = {c["id"]: c for c in hostile_table.CACHE_AND_TRACE_CASES}
_SURFACES = {c["id"]: c for c in HOSTILE_SURFACE_CASES
             if not (c.get("cuda_ok") and torch.cuda.is_available())}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OPMUX_") and k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR",
                                                         "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    env["OPMUX_PLUGINS"] = "example_vendor"  # no C++ build in the driver
    return env


def _drive(tmp: Path, ids: list[str]) -> dict[str, dict[str, Any]]:
    proc = subprocess.run([sys.executable, str(_HERE / "_hostile_driver.py"), str(tmp),
                           str(_HEADROOM), *ids], env=_env(), capture_output=True,
                          text=True, timeout=1200)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            data = json.loads(line)
            results[data["id"]] = data
    results["__driver__"] = {"returncode": proc.returncode, "stderr": proc.stderr[-3000:]}
    return results


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _drive(tmp_path_factory.mktemp("hostile-cli"), list(_CLI))


@pytest.fixture(scope="module")
def cache_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _drive(tmp_path_factory.mktemp("hostile-cache"), list(_CACHE))


@pytest.fixture(scope="module")
def surface_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _drive(tmp_path_factory.mktemp("hostile-surfaces"), list(_SURFACES))


def test_the_suite_is_as_large_as_promised() -> None:
    assert len(_CLI) >= 100 and len(_CACHE) >= 50
    assert len(HOSTILE_SURFACE_CASES) >= 100
    assert len({c["id"] for c in HOSTILE_SURFACE_CASES}) == len(HOSTILE_SURFACE_CASES)


def _get(results: dict[str, dict[str, Any]], case_id: str) -> dict[str, Any]:
    driver = results["__driver__"]
    assert case_id in results, f"the driver stopped before this case: {driver}"
    result = results[case_id]
    assert "escaped" not in result, result.get("traceback")
    return result


@pytest.mark.parametrize("case_id", list(_CLI))
def test_hostile_checkpoint_or_command_line(cli_results: dict[str, dict[str, Any]],
                                            case_id: str) -> None:
    case, result = _CLI[case_id], _get(cli_results, case_id)
    err = result["stderr"]
    assert result["code"] == case.get("code", 2), (result["stdout"], err)
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line
    assert case["expect"] in err and "Traceback" not in err, err
    if result["json"] and result["code"] == 0:
        json.loads(result["stdout"])
    assert result["written"] == []  # nothing written where it failed


def _refuse_constant(token: str) -> None:
    raise AssertionError(f"not strict JSON: {token}")


@pytest.mark.parametrize("case_id", list(_SURFACES))
def test_hostile_report_option_or_declaration(surface_results: dict[str, dict[str, Any]],
                                              case_id: str) -> None:
    case, result = _SURFACES[case_id], _get(surface_results, case_id)
    if case["kind"] == "declare":
        assert result["raised"] is not None and case["expect"] in result["raised"]
        assert result["formats_after"] == ["canonical"]  # nothing was declared
        return
    err = result["stderr"]
    assert result["code"] == case.get("code", 2), (result["stdout"], err)
    if result["code"] == 0:
        assert err == "" and "Traceback" not in result["stdout"]
        if result["json"]:
            json.loads(result["stdout"], parse_constant=_refuse_constant)
    else:
        assert err.endswith("\n") and err.count("\n") == 1, err  # one line
        assert case["expect"] in err and "Traceback" not in err, err
    assert result["written"] == []  # nothing written where it failed


@pytest.mark.parametrize("case_id", list(_CACHE))
def test_hostile_cache_or_trace_file(cache_results: dict[str, dict[str, Any]],
                                     case_id: str) -> None:
    case, result = _CACHE[case_id], _get(cache_results, case_id)
    assert len(result["warnings"]) == 1, result["warnings"]
    assert case["expect"] in result["warnings"][0] and result["path"] in result["warnings"][0]
    if case["kind"] == "tuned":
        assert result["state"] == "damaged"  # ignored; the op call after it ran
    elif case["kind"] == "trace":
        assert result["state"] == {"mylib::my_op": {"fast": 1}}  # replaced by good counts
    else:
        assert result["state"] is None and result["builds"] == 2  # rebuilt, usable again


def test_no_process_is_left_behind(cli_results: dict[str, dict[str, Any]],
                                   cache_results: dict[str, dict[str, Any]],
                                   surface_results: dict[str, dict[str, Any]]) -> None:
    for results in (cli_results, cache_results, surface_results):
        assert results["__children__"]["children"] == []
        assert results["__driver__"]["returncode"] == 0, results["__driver__"]["stderr"]


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


@pytest.mark.parametrize(("argv", "setup", "expect"), [
    (["generate", "--model", "{ckpt}", "--max-tokens", "1", "--prompt-ids", "1",
      "--block-size", "100000000", "--json"], None, "argument --block-size"),
    (["generate", "--model", "{ckpt}", "--max-tokens", "1", "--prompt-ids", "1", "--json"],
     {"max_position_embeddings": 2**31 - 1}, "cos/sin cache of"),
    (["generate", "--model", "{ckpt}", "--max-tokens", "1", "--prompt-ids", "1", "--json"],
     {"vocab_size": 2**31 - 1}, "weights of"),
    (["tune", "--repeat", "0", "--json"], None, "argument --repeat"),
    (["demo", "--device", "nope", "--json"], None, "--device 'nope'"),
])
def test_real_processes_under_a_memory_limit(tmp_path: Path, argv: list[str],
                                             setup: dict[str, Any] | None,
                                             expect: str) -> None:
    from opmux.models.synthetic import LlamaShape, write_random_llama

    ckpt = write_random_llama(tmp_path / "ckpt", LlamaShape(
        layers=1, hidden=32, heads=4, kv_heads=2, intermediate=32, vocab=64))
    if setup:
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg.update(setup)
        (ckpt / "config.json").write_text(json.dumps(cfg))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = subprocess.run(
        [sys.executable, "-m", "opmux.cli", *(a.replace("{ckpt}", str(ckpt)) for a in argv)],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300,
        preexec_fn=_limited)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and expect in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
