"""Layers built on opmux ops: :class:`~opmux.layers.moe.FusedMoE`."""

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
    "ColumnParallelLinear",
    "FusedMoE",
    "LogitsProcessor",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "SharedExpertsMLP",
    "VocabParallelEmbedding",
]
