"""Random Llama checkpoints written locally (``config.json`` + ``model.safetensors``).

The demo and the benchmarks need a model without a download and without ``transformers``:
:func:`write_random_llama` writes a seeded random checkpoint in the Hugging Face layout
(the tensor names and config fields of ``LlamaForCausalLM``), readable by
:func:`opmux.models.load_model` and by ``transformers`` alike.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["LLAMA_100M", "LlamaShape", "write_random_llama"]


@dataclass(frozen=True)
class LlamaShape:
    """Sizes of a random Llama checkpoint."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1000
    max_position: int = 2048
    tie_embeddings: bool = False

    def num_parameters(self) -> int:
        """Parameters of the model (embeddings counted once when tied)."""
        d = self.hidden // self.heads
        attn = self.hidden * (self.heads * d + 2 * self.kv_heads * d) + self.heads * d * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        emb = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * (attn + mlp + 2 * self.hidden) + emb + self.hidden


LLAMA_100M: LlamaShape = LlamaShape(layers=8, hidden=768, heads=12, kv_heads=4,
                                     intermediate=2048, vocab=32000)
"""The ~100M-parameter Llama the benchmarks use as their model-scale case."""


def write_random_llama(directory: str | Path, shape: LlamaShape, seed: int = 0,
                       dtype: torch.dtype = torch.float32) -> Path:
    """Write a seeded random ``LlamaForCausalLM`` checkpoint into ``directory``.

    Weights are normal with standard deviation ``1.5 / sqrt(fan_in)`` (large enough that
    greedy decoding does not settle on one token); norm weights near 1.

    :returns: the directory.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    s = shape
    d = s.hidden // s.heads
    g = torch.Generator().manual_seed(seed)

    def w(*dims: int) -> torch.Tensor:
        t: torch.Tensor = (torch.randn(*dims, generator=g) * 1.5 / dims[-1] ** 0.5).to(dtype)
        return t

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(s.hidden, generator=g)).to(dtype)

    tensors = {"model.embed_tokens.weight": w(s.vocab, s.hidden), "model.norm.weight": norm()}
    if not s.tie_embeddings:
        tensors["lm_head.weight"] = w(s.vocab, s.hidden)
    for i in range(s.layers):
        p = f"model.layers.{i}."
        tensors.update({
            f"{p}input_layernorm.weight": norm(),
            f"{p}post_attention_layernorm.weight": norm(),
            f"{p}self_attn.q_proj.weight": w(s.heads * d, s.hidden),
            f"{p}self_attn.k_proj.weight": w(s.kv_heads * d, s.hidden),
            f"{p}self_attn.v_proj.weight": w(s.kv_heads * d, s.hidden),
            f"{p}self_attn.o_proj.weight": w(s.hidden, s.heads * d),
            f"{p}mlp.gate_proj.weight": w(s.intermediate, s.hidden),
            f"{p}mlp.up_proj.weight": w(s.intermediate, s.hidden),
            f"{p}mlp.down_proj.weight": w(s.hidden, s.intermediate),
        })
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": s.vocab, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": d, "hidden_act": "silu",
        "max_position_embeddings": s.max_position, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": s.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": None,
        "eos_token_id": None, "torch_dtype": str(dtype).removeprefix("torch."),
        "opmux_random_shape": asdict(s), "opmux_random_seed": seed,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
