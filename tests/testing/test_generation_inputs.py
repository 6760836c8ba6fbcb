"""The inputs the generation benchmarks share: token-id prompts and sized tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opmux.testing.vllm_generate import token_prompts


def test_token_prompts_are_seeded_and_in_range() -> None:
    rows = token_prompts(16, 32, 512)
    assert len(rows) == 16 and all(len(r) == 32 for r in rows)
    assert all(0 < t < 512 for r in rows for t in r)  # 0 is the tiny checkpoints' EOS
    assert token_prompts(16, 32, 512) == rows
    assert token_prompts(16, 32, 512, seed=1) != rows
    assert len({tuple(r) for r in rows}) == 16


def test_write_tiny_model_takes_shape_overrides(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from opmux.testing.tiny_models import write_tiny_model

    out = write_tiny_model(tmp_path / "m", "llama", hidden_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=96)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"],
            config["num_attention_heads"], config["num_key_value_heads"]) == (64, 1, 96, 2, 1)


def test_write_tiny_model_refuses_unknown_shape_keys(tmp_path: Path) -> None:
    from opmux.testing.tiny_models import write_tiny_model

    with pytest.raises(ValueError, match=r"unknown shape keys.*hidden"):
        write_tiny_model(tmp_path / "m", "llama", hidden=64)
    assert not (tmp_path / "m").exists()
