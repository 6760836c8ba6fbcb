"""Which providers serve an enabled transformers model: OPMUX_TRACE shows an opmux provider
(not the native reference) behind every replaced op, and OPMUX_PRIORITY brings the example
vendor plugin's provider to transformers' activation (fresh processes: both variables are
read at start-up)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

_RUN = Path(__file__).with_name("_transformers_trace_run.py")
_ROOT = Path(__file__).parents[2]


def _run(tmp_path: Path, *archs: str, **env: str) -> dict[str, dict[str, int]]:
    trace = tmp_path / "trace.json"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OPMUX_")}
    environ.update(env, OPMUX_TRACE=str(trace), OPMUX_TUNED="0",
                   PYTHONPATH=os.pathsep.join([str(_ROOT), environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(_RUN), *archs], env=environ, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    counts: dict[str, dict[str, int]] = json.loads(trace.read_text())
    return counts


def test_every_replaced_op_runs_on_an_opmux_provider(tmp_path: Path) -> None:
    counts = _run(tmp_path, "llama", "qwen2", "mixtral", "gemma2")
    replaced = ("rms_norm", "fused_add_rms_norm", "gemma_rms_norm", "gemma_fused_add_rms_norm",
                "rotary_embedding", "silu_and_mul", "gelu_and_mul", "fused_moe",
                "paged_attention", "reshape_and_cache")
    for op in replaced:
        assert counts.get(op), f"{op} never ran: {counts}"
        assert "native" not in counts[op], f"{op} fell back to the reference: {counts[op]}"
    # on this CPU platform the built-in C++ provider wins everywhere
    assert {p for op in replaced for p in counts[op]} <= {"cpp", "grouped"}, counts


@pytest.mark.skipif(importlib.util.find_spec("opmux_example_vendor") is None,
                    reason="needs examples/vendor_plugin installed (pip install -e)")
def test_vendor_plugin_reaches_the_activation_through_priority(tmp_path: Path) -> None:
    counts = _run(tmp_path, "llama",
                  OPMUX_PRIORITY="silu_and_mul=example_vendor,cpp,native")
    assert set(counts["silu_and_mul"]) == {"example_vendor"}, counts
    assert set(counts["rms_norm"]) == {"cpp"}  # the rest keeps the platform's choice
