"""RMS normalisation: ``rms_norm`` and ``fused_add_rms_norm`` (native references)."""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
import torch
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops._checks import check_fused_add_rms_norm, check_rms_norm

__all__ = ["fused_add_rms_norm", "rms_norm"]


def _rms_norm_fp32(xf: Tensor, weight: Tensor, eps: float) -> Tensor:
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    return xf * torch.rsqrt(variance + eps) * weight.float()


@register_op
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight``, computed in fp32, returned in ``x.dtype``.

    :param x: floating tensor ``[..., d]``.
    :param weight: floating tensor ``[d]``.
    :param eps: added to the mean square.
    :raises opmux.OpInputError: for mismatched shapes, devices or non-floating dtypes.
    """
    check_rms_norm(x, weight, eps)
    return _rms_norm_fp32(x.float(), weight, eps).to(x.dtype)


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
    out = _rms_norm_fp32(new_residual.float(), weight, eps).to(x.dtype)
    return out, new_residual
