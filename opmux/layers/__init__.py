"""Layers built on opmux ops: :class:`~opmux.layers.moe.FusedMoE`, the norms of
:mod:`opmux.layers.norm` and :class:`~opmux.layers.quant.QuantFP8`."""

from opmux.layers.moe import FusedMoE, SharedExpertsMLP
from opmux.layers.norm import GemmaRMSNorm, RMSNorm, RMSNormGated
from opmux.layers.quant import GroupShape, QuantFP8

__all__ = ["FusedMoE", "GemmaRMSNorm", "GroupShape", "QuantFP8", "RMSNorm", "RMSNormGated",
           "SharedExpertsMLP"]
