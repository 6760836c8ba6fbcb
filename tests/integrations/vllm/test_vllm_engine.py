"""vLLM offline generation with the opmux plugin off and on (vllm lane).

One engine per model per mode (an engine is slow to start): a tiny float32 Llama and a
tiny Qwen2 written by the test, greedy tokens compared, and the plugin-on run traced with
``OPMUX_TRACE`` while the example vendor plugin is first for ``silu_and_mul``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

_ROOT = Path(__file__).resolve().parents[2]
_REPLACED_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "reshape_and_cache",
                 "paged_attention")


def _generate(model: Path, out: Path, work: Path, env_extra: dict[str, str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPMUX_")}
    if "OPMUX_CACHE_DIR" in os.environ:  # keep the C++ build cache the caller chose
        env["OPMUX_CACHE_DIR"] = os.environ["OPMUX_CACHE_DIR"]
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
                "PYTHONPATH": os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])})
    env.update(env_extra)
    proc = subprocess.run(
        [sys.executable, "-m", "opmux.testing.vllm_generate", "--model", str(model),
         "--out", str(out), "--batch", "4", "--max-tokens", "24", "--repeat", "1"],
        env=env, cwd=work, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Any]:
    from opmux.testing.tiny_models import write_tiny_model

    work = tmp_path_factory.mktemp(request.param)
    model = write_tiny_model(work / "model", request.param)
    trace = work / "trace.json"
    off = _generate(model, work / "off.json", work, {"OPMUX_VLLM": "0"})
    on = _generate(model, work / "on.json", work, {
        "OPMUX_TRACE": str(trace), "OPMUX_PRIORITY": "silu_and_mul=example_vendor,native"})
    return {"off": off, "on": on, "trace": json.loads(trace.read_text())}


def test_tokens_identical(runs: dict[str, Any]) -> None:
    assert runs["off"]["plugin"] == []
    assert {"RMSNorm", "SiluAndMul", "RotaryEmbedding", "CPU_ATTN"} <= set(runs["on"]["plugin"])
    assert len(runs["on"]["outputs"]) == 4
    assert all(len(o) == 24 for o in runs["on"]["outputs"])
    assert runs["on"]["outputs"] == runs["off"]["outputs"]


def test_trace_shows_opmux_providers(runs: dict[str, Any]) -> None:
    trace = runs["trace"]
    for op in _REPLACED_OPS:
        assert trace.get(op, {}).get("cpp", 0) > 0, (op, trace)
        assert "native" not in trace[op], (op, trace)
    # the vendor plugin's provider is what ran vLLM's SiluAndMul
    assert set(trace["silu_and_mul"]) == {"example_vendor"}, trace
    assert trace["silu_and_mul"]["example_vendor"] > 0
