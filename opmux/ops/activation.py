"""Gated activations: ``silu_and_mul`` and ``gelu_and_mul`` (native references)."""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops._checks import check_gelu_and_mul, check_silu_and_mul

__all__ = ["gelu_and_mul", "silu_and_mul"]


@register_op
def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x[..., 2*d]``; fp32 math, returns ``x.dtype``.

    :param x: floating tensor whose last dimension is even.
    :returns: a new tensor ``[..., d]``.
    :raises opmux.OpInputError: for a non-floating ``x`` or an odd last dimension.
    """
    check_silu_and_mul(x)
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


@register_op
def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]``; fp32 math, returns ``x.dtype``.

    :param x: floating tensor whose last dimension is even.
    :param approximate: ``"none"`` (erf) or ``"tanh"``.
    :returns: a new tensor ``[..., d]``.
    :raises opmux.OpInputError: for a bad ``x`` or an unknown ``approximate``.
    """
    check_gelu_and_mul(x, approximate)
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.gelu(xf[..., :d], approximate=approximate) * xf[..., d:]).to(x.dtype)

