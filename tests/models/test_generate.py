"""``opmux generate`` against ``transformers`` on tiny random checkpoints of each architecture.

Greedy float32 output must equal ``generate(do_sample=False)`` token for token (16 new
tokens, four prompts of different lengths in one opmux batch), and ``--tp 2`` (two gloo
processes started by the command) must equal ``--tp 1``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _hf_checkpoints import ARCHS, hf_greedy, write_checkpoint

from opmux.cli import main

pytest.importorskip("transformers", reason="transformers is a test dependency of the core lane")

PROMPTS = [[3, 7, 9], [5, 1, 2, 8, 4, 7, 11, 30, 2], [100],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for arch in ARCHS:
        directory = tmp_path_factory.mktemp(arch)
        out[arch] = (directory, write_checkpoint(arch, directory))
    return out


def generate(capsys: pytest.CaptureFixture[str], model: Path, *extra: str) -> dict[str, Any]:
    argv = ["generate", "--model", str(model), "--max-tokens", str(NEW_TOKENS), "--json",
            "--block-size", "4"]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    code = main([*argv, *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report: dict[str, Any] = json.loads(captured.out)
    return report


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_float32_equals_transformers(arch: str, checkpoints: dict[str, Any],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    directory, hf = checkpoints[arch]
    expected = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    assert sum(len(set(e)) for e in expected) > 3 * len(PROMPTS)  # not a constant stream
    report = generate(capsys, directory)
    assert report["outputs"] == expected
    assert report["tokens_per_s"] > 0 and "text" not in report
    norm = "gemma_fused_add_rms_norm" if arch == "gemma2" else "fused_add_rms_norm"
    act = {"gemma2": "gelu_and_mul", "mixtral": "fused_moe"}.get(arch, "silu_and_mul")
    for op in ("paged_attention", "reshape_and_cache", "advance_step_flashattn",
               "rotary_embedding", norm, act):
        assert op in report["providers"] and sum(report["calls"][op].values()) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_equals_tp1(arch: str, checkpoints: dict[str, Any],
                        capsys: pytest.CaptureFixture[str]) -> None:
    directory, _ = checkpoints[arch]
    one = generate(capsys, directory)
    two = generate(capsys, directory, "--tp", "2")
    assert two["tp"] == 2 and two["outputs"] == one["outputs"]
    assert "all_reduce_" in two["providers"] and "all_gather" in two["providers"]


def test_checkpoint_in_bfloat16_runs(checkpoints: dict[str, Any],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    directory, _ = checkpoints["llama"]
    report = generate(capsys, directory, "--dtype", "bfloat16")
    assert [len(o) for o in report["outputs"]] == [NEW_TOKENS] * len(PROMPTS)
