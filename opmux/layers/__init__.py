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
from opmux.layers.moe import FusedMoE, SharedExpertsMLP, TransformersFusedMoE
from opmux.layers.moe_methods import (
    FusedMoECatalogExperts,
    FusedMoEConfig,
    FusedMoEExpertsModular,
    FusedMoEKernel,
    FusedMoEModularMethod,
    FusedMoEPrepareAndFinalizeModular,
    MoEPrepareAndFinalizeNoDPEPModular,
    UnquantizedFusedMoEMethod,
)
from opmux.layers.moe_router import GroupedTopk
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
    "FusedMoECatalogExperts",
    "FusedMoEConfig",
    "FusedMoEExpertsModular",
    "FusedMoEKernel",
    "FusedMoEModularMethod",
    "FusedMoEPrepareAndFinalizeModular",
    "GeluAndMul",
    "GeluAndMulSparse",
    "GemmaRMSNorm",
    "GroupShape",
    "GroupedTopk",
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
    "MoEPrepareAndFinalizeNoDPEPModular",
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
    "TransformersFusedMoE",
    "UnquantizedFusedMoEMethod",
    "VocabParallelEmbedding",
    "XIELU",
    "YaRNScalingRotaryEmbedding",
    "get_rope",
    "reset_rope_cache",
]
