"""Input validation of the Gemma / gated RMS norms and of ``quant_fp8``.

Same contract as :mod:`opmux.ops._checks`: each ``check_<op>`` takes the op's arguments (same
names and order) plus ``provider`` (named in the error) and ``read_data`` (unused here: these
ops have no index arguments), and raises :class:`opmux.OpInputError` before anything is
written. Providers call them too, so a provider never accepts what native rejects.
"""

from __future__ import annotations

from typing import Final

import torch
from torch import Tensor

from opmux.ops._checks import FLOAT_DTYPES, input_error

__all__ = [
    "GATE_ACTIVATIONS",
    "check_gemma_fused_add_rms_norm",
    "check_gemma_rms_norm",
    "check_quant_fp8",
    "check_rms_norm_gated",
]

GATE_ACTIVATIONS: Final = ("sigmoid", "silu", "swish")
"""Valid values of ``rms_norm_gated``'s ``activation`` (``silu`` and ``swish`` are the same)."""


def _tensor(op: str, provider: str, name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise input_error(op, provider, name, "a torch.Tensor", type(t).__name__)
    return t


def _floating(op: str, provider: str, name: str, t: object) -> Tensor:
    t = _tensor(op, provider, name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise input_error(op, provider, name, "a floating tensor (float32/float16/bfloat16)",
                          t.dtype)
    return t


def _on_device_of(op: str, provider: str, ref: Tensor, name: str, t: Tensor) -> None:
    if t.device != ref.device:
        raise input_error(op, provider, name, f"device {ref.device} (x's)", t.device)


def _norm_args(op: str, provider: str, x: Tensor, weight: Tensor, eps: float) -> int:
    x = _floating(op, provider, "x", x)
    weight = _floating(op, provider, "weight", weight)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., d] with at least one dimension",
                          f"shape {list(x.shape)}")
    d = int(x.shape[-1])
    if weight.dim() != 1 or weight.shape[0] != d:
        raise input_error(op, provider, "weight", f"shape [{d}] (x's last dimension)",
                          f"shape {list(weight.shape)}")
    _on_device_of(op, provider, x, "weight", weight)
    if not eps >= 0.0:
        raise input_error(op, provider, "eps", "a non-negative float", eps)
    return d


# ---------------------------------------------------------------------------------- norms
def check_gemma_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *,
                         provider: str = "native", read_data: bool = True) -> None:
    """Validate ``gemma_rms_norm(x, weight, eps)``."""
    _norm_args("gemma_rms_norm", provider, x, weight, eps)


def check_gemma_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                                   eps: float = 1e-6, *, provider: str = "native",
                                   read_data: bool = True) -> None:
    """Validate ``gemma_fused_add_rms_norm(x, residual, weight, eps)``."""
    op = "gemma_fused_add_rms_norm"
    _norm_args(op, provider, x, weight, eps)
    residual = _tensor(op, provider, "residual", residual)
    if residual.shape != x.shape:
        raise input_error(op, provider, "residual", f"x's shape {list(x.shape)}",
                          f"shape {list(residual.shape)}")
    if residual.dtype != x.dtype:
        raise input_error(op, provider, "residual", f"x's dtype {x.dtype}", residual.dtype)
    _on_device_of(op, provider, x, "residual", residual)


def check_rms_norm_gated(x: Tensor, weight: Tensor, z: Tensor | None = None, eps: float = 1e-5,
                         group_size: int | None = None, norm_before_gate: bool = False,
                         activation: str = "swish", *, provider: str = "native",
                         read_data: bool = True) -> None:
    """Validate ``rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate, activation)``."""
    op = "rms_norm_gated"
    d = _norm_args(op, provider, x, weight, eps)
    if z is not None:
        z = _floating(op, provider, "z", z)
        if z.shape != x.shape:
            raise input_error(op, provider, "z", f"None or x's shape {list(x.shape)}",
                              f"shape {list(z.shape)}")
        _on_device_of(op, provider, x, "z", z)
    if group_size is not None and (group_size <= 0 or d % group_size != 0):
        raise input_error(op, provider, "group_size",
                          f"None or a positive divisor of x's last dimension {d}", group_size)
    if activation not in GATE_ACTIVATIONS:
        raise input_error(op, provider, "activation", f"one of {sorted(GATE_ACTIVATIONS)}",
                          repr(activation))


# ------------------------------------------------------------------------------- quant_fp8
def _static_scale(op: str, provider: str, x: Tensor, scale: Tensor) -> None:
    scale = _floating(op, provider, "scale", scale)
    _on_device_of(op, provider, x, "scale", scale)
    if scale.numel() == 1 and scale.dim() <= (2 if x.dim() >= 2 else 1):
        return
    rows, cols = (int(x.shape[-2]), int(x.shape[-1])) if x.dim() >= 2 else (0, 0)
    if (x.dim() < 2 or scale.dim() != 2 or scale.shape[0] == 0 or scale.shape[1] == 0
            or rows % scale.shape[0] != 0 or cols % scale.shape[1] != 0):
        raise input_error(op, provider, "scale",
                          "a one-element tensor (per-tensor) or a 2-d tensor [a, b] with a "
                          f"dividing x's rows ({rows}) and b dividing x's columns ({cols})",
                          f"shape {list(scale.shape)} for x of shape {list(x.shape)}")


def check_quant_fp8(x: Tensor, scale: Tensor | None = None, per_token: bool = False,
                    scale_ub: Tensor | None = None, group_size: int | None = None,
                    use_ue8m0: bool = False, *, provider: str = "native",
                    read_data: bool = True) -> None:
    """Validate ``quant_fp8(x, scale, per_token, scale_ub, group_size, use_ue8m0)``.

    Exactly one mode: static (``scale`` given), dynamic per-tensor (default), dynamic
    per-token (``per_token``, optionally ``scale_ub``) or dynamic per-group (``group_size``,
    optionally ``use_ue8m0``).
    """
    op = "quant_fp8"
    x = _floating(op, provider, "x", x)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., N] with at least one dimension",
                          f"shape {list(x.shape)}")
    if scale is not None:
        for name, bad in (("per_token", per_token), ("scale_ub", scale_ub is not None),
                          ("group_size", group_size is not None), ("use_ue8m0", use_ue8m0)):
            if bad:
                raise input_error(op, provider, name, "its default with a static scale "
                                  "(it selects a dynamic mode)", "a non-default value")
        _static_scale(op, provider, x, scale)
        return
    if x.shape[-1] == 0 or (not per_token and group_size is None and x.numel() == 0):
        raise input_error(op, provider, "x", "a non-empty last dimension (and a non-empty "
                          "tensor for a per-tensor scale): a dynamic scale reads its maximum",
                          f"shape {list(x.shape)}")
    if group_size is not None:
        if group_size <= 0:
            raise input_error(op, provider, "group_size", "None or a positive int", group_size)
        if per_token:
            raise input_error(op, provider, "per_token", "False with group_size (groups are "
                              "per token already)", per_token)
        if scale_ub is not None:
            raise input_error(op, provider, "scale_ub", "None with group_size (it bounds "
                              "per-token scales)", "a tensor")
        return
    if use_ue8m0:
        raise input_error(op, provider, "use_ue8m0", "False without group_size (power-of-two "
                          "scales are a per-group option)", use_ue8m0)
    if scale_ub is not None:
        if not per_token:
            raise input_error(op, provider, "scale_ub", "None unless per_token (it bounds "
                              "per-token scales)", "a tensor")
        scale_ub = _tensor(op, provider, "scale_ub", scale_ub)
        if scale_ub.dtype != torch.float32 or scale_ub.numel() != 1 or scale_ub.dim() > 1:
            raise input_error(op, provider, "scale_ub", "a one-element float32 tensor of shape "
                              "[] or [1]", f"{scale_ub.dtype} tensor of shape "
                              f"{list(scale_ub.shape)}")
        _on_device_of(op, provider, x, "scale_ub", scale_ub)
