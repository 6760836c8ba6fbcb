"""The random Llama checkpoint the demo and benchmarks write is a real Hugging Face one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opmux.models import Engine, load_model
from opmux.models.synthetic import LlamaShape, write_random_llama

pytest.importorskip("transformers", reason="transformers is a test dependency of the core lane")


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_reads_it_and_agrees(tmp_path: Path, tied: bool) -> None:
    import transformers

    shape = LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=80,
                       tie_embeddings=tied)
    write_random_llama(tmp_path, shape, seed=5)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert sum(p.numel() for p in hf.parameters()) == shape.num_parameters()
    prompts = [[1, 2, 3], [7, 7, 8, 9, 10, 11, 2]]
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert Engine(load_model(tmp_path), 16).generate(prompts, 16).outputs == expected
