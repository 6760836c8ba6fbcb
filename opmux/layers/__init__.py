"""Layers built on opmux ops: :class:`~opmux.layers.moe.FusedMoE`."""

from opmux.layers.moe import FusedMoE, SharedExpertsMLP
from opmux.layers.rotary import (
    ApplyRotaryEmb,
    DualChunkRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    RotaryEmbedding,
    RotaryEmbeddingBase,
    YaRNScalingRotaryEmbedding,
    get_rope,
    reset_rope_cache,
)

__all__ = [
    "ApplyRotaryEmb",
    "DualChunkRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "FusedMoE",
    "LinearScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "RotaryEmbedding",
    "RotaryEmbeddingBase",
    "SharedExpertsMLP",
    "YaRNScalingRotaryEmbedding",
    "get_rope",
    "reset_rope_cache",
]
