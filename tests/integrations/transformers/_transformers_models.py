"""Tiny random checkpoints of the architectures opmux.integrations.transformers supports,
built with transformers' config classes (no download), and the prompts the tests use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "qwen2", "mixtral", "gemma2")

_COMMON: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                               eos_token_id=None, bos_token_id=None, pad_token_id=None)

PROMPTS = [[5, 17, 99, 3, 64, 12, 8, 120, 33], [7, 81, 2, 45, 45, 90, 11, 6, 77, 101, 19, 4,
                                                 58, 23]]
"""Two prompts longer than the sliding windows below (GQA 4/2 heads everywhere)."""


def build(arch: str, seed: int = 0) -> Any:
    """A random float32 model of ``arch`` in eval mode, with every feature switched on that
    the integration handles: Llama-3 rope scaling (llama), a sliding-window layer (qwen2),
    experts (mixtral), soft caps and alternating windows (gemma2)."""
    import transformers as tr

    torch.manual_seed(seed)
    if arch == "llama":
        cfg: Any = tr.LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        model = tr.LlamaForCausalLM(cfg)
    elif arch == "qwen2":  # layer 0 full attention, layer 1 a window of 6
        model = tr.Qwen2ForCausalLM(tr.Qwen2Config(**_COMMON, use_sliding_window=True,
                                                   sliding_window=6, max_window_layers=1))
    elif arch == "mixtral":
        model = tr.MixtralForCausalLM(tr.MixtralConfig(**_COMMON, num_local_experts=4,
                                                       num_experts_per_tok=2))
    elif arch == "gemma2":
        model = tr.Gemma2ForCausalLM(tr.Gemma2Config(
            **_COMMON, sliding_window=4, query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0, final_logit_softcapping=3.0))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # weights large enough that the greedy tokens vary
        for name, p in model.named_parameters():
            if p.dim() >= 2 and arch == "gemma2" and "embed" in name:
                p.normal_(0.0, 0.05)  # gemma scales embeddings by sqrt(hidden)
            elif p.dim() >= 2:
                p.normal_(0.0, 1.5 * p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.normal_(0.0 if arch == "gemma2" else 1.0, 0.2)
            else:
                p.normal_(0.0, 0.5)
    return model.eval()


def checkpoint(arch: str, directory: Path) -> Any:
    """Write ``arch``'s checkpoint to ``directory`` and load it back as a user would."""
    import transformers as tr

    build(arch).save_pretrained(directory)
    model = tr.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def batching_config() -> Any:
    """A small paged cache (16-token pages, so sequences span several) for generate_batch."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64,
                                    max_requests_per_batch=4)


def greedy(model: Any, new_tokens: int = 10) -> list[list[int]]:
    """Greedy continuation of each prompt by ``generate`` (one prompt per call)."""
    out = []
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                             do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


def greedy_batch(model: Any, new_tokens: int = 10) -> list[list[int]]:
    """Greedy continuations of all prompts by continuous batching (``generate_batch``)."""
    results = model.generate_batch([list(p) for p in PROMPTS], max_new_tokens=new_tokens,
                                   do_sample=False,
                                   continuous_batching_config=batching_config())
    by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}
    return [list(by_prompt[tuple(p)]) for p in PROMPTS]
