"""Tiny random Hugging Face checkpoints of each architecture, written with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "qwen2", "mixtral", "gemma2")

_COMMON: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=256,
                               eos_token_id=None, bos_token_id=None, pad_token_id=None)


def hf_model(arch: str, seed: int = 0) -> Any:
    """A random transformers model of ``arch`` (float32, eval mode)."""
    import transformers as tr

    torch.manual_seed(seed)
    if arch == "llama":  # Llama-3 rope scaling and tied embeddings
        cfg: Any = tr.LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        model = tr.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        model = tr.Qwen2ForCausalLM(tr.Qwen2Config(**_COMMON))
    elif arch == "mixtral":
        model = tr.MixtralForCausalLM(tr.MixtralConfig(**_COMMON, num_local_experts=4,
                                                       num_experts_per_tok=2))
    elif arch == "gemma2":  # small window and caps, so that all of them matter
        model = tr.Gemma2ForCausalLM(tr.Gemma2Config(
            **_COMMON, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
            attn_implementation="eager"))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # weights large enough that the tokens vary
        for name, p in model.named_parameters():
            if p.dim() == 2 and arch == "gemma2" and "embed" in name:
                p.normal_(0.0, 0.05)  # gemma scales embeddings by sqrt(hidden)
            elif p.dim() == 2:
                p.normal_(0.0, 1.5 * p.shape[1] ** -0.5)
            elif "norm" in name:
                p.normal_(0.0 if arch == "gemma2" else 1.0, 0.2)
            else:
                p.normal_(0.0, 0.5)
    return model.eval()


def write_checkpoint(arch: str, directory: Path, seed: int = 0) -> Any:
    """Write ``arch``'s tiny checkpoint to ``directory``; returns the transformers model."""
    model = hf_model(arch, seed)
    model.save_pretrained(directory)
    return model


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' ``generate(do_sample=False)``, one prompt at a time."""
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out
