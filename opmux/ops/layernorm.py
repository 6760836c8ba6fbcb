"""RMS normalisation: ``rms_norm``, ``fused_add_rms_norm``, the Gemma variants and the gated
norm (native references)."""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks import (
    check_fused_add_rms_norm,
    check_gemma_fused_add_rms_norm,
    check_gemma_rms_norm,
    check_rms_norm,
    check_rms_norm_gated,
)

__all__ = ["fused_add_rms_norm", "gemma_fused_add_rms_norm", "gemma_rms_norm", "rms_norm",
           "rms_norm_gated"]


def _normalized(xf: Tensor, eps: float) -> Tensor:
    """``xf * rsqrt(mean(xf**2, -1) + eps)``: the RMS normalisation every op here shares (fp32)."""
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)


@register_op
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight``, computed in fp32, returned in ``x.dtype``.

    :param x: floating tensor ``[..., d]``.
    :param weight: floating tensor ``[d]``.
    :param eps: added to the mean square.
    :raises opmux.OpInputError: for mismatched shapes, devices or non-floating dtypes.
    """
    check_rms_norm(x, weight, eps)
    return (_normalized(x.float(), eps) * weight.float()).to(x.dtype)


@register_op
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
                       ) -> tuple[Tensor, Tensor]:
    """``new_residual = x + residual; out = rms_norm(new_residual, weight, eps)``.

    The sum is taken in fp32 and rounded to ``x.dtype``; ``out`` normalises that rounded
    residual. Both results are new tensors; the inputs are not modified.

    :returns: ``(out, new_residual)``.
    :raises opmux.OpInputError: for mismatched shapes, dtypes or devices.
    """
    check_fused_add_rms_norm(x, residual, weight, eps)
    new_residual = (x.float() + residual.float()).to(x.dtype)
    out = (_normalized(new_residual.float(), eps) * weight.float()).to(x.dtype)
    return out, new_residual


def _gemma_fp32(xf: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _normalized(xf, eps) * (weight.float() + 1.0)


@register_op
def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Gemma's RMS norm: ``x * rsqrt(mean(x**2, -1) + eps) * (1 + weight)``.

    As vLLM 0.32's ``GemmaRMSNorm``: ``1 + weight`` is formed in fp32, the whole product is
    computed in fp32 and rounded once to ``x.dtype`` (not ``x`` rounded first, then scaled).

    Arguments and errors as :func:`rms_norm`'s; ``weight`` may be of any floating dtype (zeros
    give a plain RMS norm).
    """
    check_gemma_rms_norm(x, weight, eps)
    return _gemma_fp32(x.float(), weight, eps).to(x.dtype)


@register_op
def gemma_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
                             ) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` (fp32); ``(gemma_rms_norm(s, weight, eps), s)``.

    As vLLM 0.32: the sum is taken in fp32; the new residual is that sum rounded to
    ``x.dtype``, while the output normalises the unrounded fp32 sum. Both results are new
    tensors; the inputs are not modified.

    :param residual: same shape and dtype as ``x``.
    :returns: ``(out, new_residual)``, both in ``x.dtype``.
    :raises opmux.OpInputError: for mismatched shapes, dtypes or devices.
    """
    check_gemma_fused_add_rms_norm(x, residual, weight, eps)
    s = x.float() + residual.float()
    return _gemma_fp32(s, weight, eps).to(x.dtype), s.to(x.dtype)


@register_op
def rms_norm_gated(x: Tensor, weight: Tensor, z: Optional[Tensor] = None, eps: float = 1e-5,
                   group_size: Optional[int] = None, norm_before_gate: bool = False,
                   activation: str = "swish") -> Tensor:
    """RMS norm with an optional gate ``act(z)`` and optional groups, in fp32.

    As vLLM 0.32's ``RMSNormGated``: with ``z`` and ``norm_before_gate``,
    ``out = rms_norm(x) * weight * act(z)``; with ``z`` and not ``norm_before_gate``,
    ``out = rms_norm(x * act(z)) * weight``; without ``z``, ``rms_norm(x) * weight``. The mean
    square is taken over groups of ``group_size`` consecutive elements of the last dimension
    (``None``: the whole row). ``act`` is SiLU (``"silu"``/``"swish"``) or ``"sigmoid"``.
    Everything is computed in fp32 and rounded once to ``x.dtype``.

    :param z: the gate, ``x``'s shape (any floating dtype), or ``None``.
    :param group_size: ``None`` or a positive divisor of ``d``.
    :raises opmux.OpInputError: for mismatched shapes, devices, a bad group size or activation.
    """
    check_rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate, activation)
    xf = x.float()
    gate = None
    if z is not None:
        zf = z.float()
        gate = torch.sigmoid(zf) if activation == "sigmoid" else F.silu(zf)
        if not norm_before_gate:
            xf = xf * gate
    if group_size is None:
        out = _normalized(xf, eps) * weight.float()
    else:
        out = _normalized(xf.unflatten(-1, (-1, group_size)), eps).flatten(-2) * weight.float()
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)
