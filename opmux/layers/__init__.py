"""Layers built on opmux ops: the rows of vLLM's CustomOp table, one module per family."""

from opmux.layers.activation import (
    XIELU,
    FastGELU,
    FatreluAndMul,
    GeluAndMul,
    GeluAndMulSparse,
    MulAndSilu,
    NewGELU,
    QuickGELU,
    ReLUSquaredActivation,
    SiluAndMul,
    SwigluOAIAndMul,
)
from opmux.layers.attention import (
    MLAAttentionMetadata,
    MLAModules,
    MMEncoderAttention,
    MultiHeadLatentAttentionWrapper,
)
from opmux.layers.conv import Conv2dLayer, Conv3dLayer
from opmux.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from opmux.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from opmux.layers.logits import LogitsProcessor
from opmux.layers.mamba import MambaMetadata, MambaMixer, ShortConv
from opmux.layers.mamba2 import MambaMixer2, Mixer2RMSNormGated, Plamo2MambaMixer
from opmux.layers.moe import FusedMoE, SharedExpertsMLP
from opmux.layers.norm import GemmaRMSNorm, RMSNorm, RMSNormGated
from opmux.layers.quant import GroupShape, QuantFP8
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
    "ColumnParallelLinear",
    "Conv2dLayer",
    "Conv3dLayer",
    "DualChunkRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "FastGELU",
    "FatreluAndMul",
    "FusedMoE",
    "GeluAndMul",
    "GeluAndMulSparse",
    "GemmaRMSNorm",
    "GroupShape",
    "LinearScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "LogitsProcessor",
    "MLAAttentionMetadata",
    "MLAModules",
    "MMEncoderAttention",
    "MambaMetadata",
    "MambaMixer",
    "MambaMixer2",
    "MergedColumnParallelLinear",
    "Mixer2RMSNormGated",
    "MulAndSilu",
    "MultiHeadLatentAttentionWrapper",
    "NewGELU",
    "ParallelLMHead",
    "Plamo2MambaMixer",
    "QKVParallelLinear",
    "QuantFP8",
    "QuickGELU",
    "RMSNorm",
    "RMSNormGated",
    "ReLUSquaredActivation",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RotaryEmbeddingBase",
    "RowParallelLinear",
    "SharedExpertsMLP",
    "ShortConv",
    "SiluAndMul",
    "SwigluOAIAndMul",
    "VocabParallelEmbedding",
    "XIELU",
    "YaRNScalingRotaryEmbedding",
    "get_rope",
    "reset_rope_cache",
]
