"""Layers built on opmux ops: :class:`~opmux.layers.moe.FusedMoE`."""

from opmux.layers.moe import FusedMoE, SharedExpertsMLP

__all__ = ["FusedMoE", "SharedExpertsMLP"]
