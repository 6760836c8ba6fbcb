"""Layers built on opmux ops: :class:`~opmux.layers.moe.FusedMoE`."""

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
from opmux.layers.moe import FusedMoE, SharedExpertsMLP

__all__ = [
    "XIELU",
    "FastGELU",
    "FatreluAndMul",
    "FusedMoE",
    "GeluAndMul",
    "GeluAndMulSparse",
    "MulAndSilu",
    "NewGELU",
    "QuickGELU",
    "ReLUSquaredActivation",
    "SharedExpertsMLP",
    "SiluAndMul",
    "SwigluOAIAndMul",
]
