"""Layers built on opmux ops: the rows of vLLM's CustomOp table (DESIGN §7), one module per family."""

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
from opmux.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from opmux.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from opmux.layers.logits import LogitsProcessor
from opmux.layers.moe import FusedMoE, SharedExpertsMLP

__all__ = [
    "XIELU",
    "ColumnParallelLinear",
    "FastGELU",
    "FatreluAndMul",
    "FusedMoE",
    "GeluAndMul",
    "GeluAndMulSparse",
    "LogitsProcessor",
    "MergedColumnParallelLinear",
    "MulAndSilu",
    "NewGELU",
    "ParallelLMHead",
    "QKVParallelLinear",
    "QuickGELU",
    "ReLUSquaredActivation",
    "ReplicatedLinear",
    "RowParallelLinear",
    "SharedExpertsMLP",
    "SiluAndMul",
    "SwigluOAIAndMul",
    "VocabParallelEmbedding",
]
