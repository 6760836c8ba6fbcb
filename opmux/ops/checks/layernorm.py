"""Input checks of the normalisation ops (:mod:`opmux.ops.layernorm`): ``rms_norm``,
``fused_add_rms_norm``, the Gemma norms and ``rms_norm_gated``.

Same contract as every module of :mod:`opmux.ops.checks`: each ``check_<op>`` takes the op's
arguments (same names and order) plus ``provider`` (named in the error) and ``read_data``
(unused here: these ops have no index arguments), and raises :class:`opmux.OpInputError`
before anything is written.
"""

from __future__ import annotations

from typing import Final

from torch import Tensor

from opmux.ops.checks.input_errors import input_error, shape_text
from opmux.ops.checks.single_arguments import (
    check_devices,
    check_float_tensor,
    check_floating,
    check_real,
    check_same_device,
    check_tensor,
)
from opmux.ops.checks.symbolic import require

__all__ = [
    "GATE_ACTIVATIONS",
    "check_fused_add_rms_norm",
    "check_gemma_fused_add_rms_norm",
    "check_gemma_rms_norm",
    "check_rms_norm",
    "check_rms_norm_gated",
]

GATE_ACTIVATIONS: Final = ("sigmoid", "silu", "swish")
"""Valid values of ``rms_norm_gated``'s ``activation`` (``silu`` and ``swish`` are the same)."""


def _check_norm(op: str, provider: str, x: Tensor, weight: Tensor, eps: float) -> None:
    x = check_tensor(op, provider, "x", x)
    weight = check_tensor(op, provider, "weight", weight)
    check_floating(op, provider, "x", x)
    check_floating(op, provider, "weight", weight)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., d] with at least one dimension",
                          shape_text(x))
    d = x.shape[-1]
    if weight.dim() != 1:
        raise input_error(op, provider, "weight", "a 1-d tensor [d] (x's last dimension)",
                          shape_text(weight))
    require(weight.shape[0] == d, op, provider, "weight",
            lambda: f"shape [{d}] (x's last dimension)", lambda: shape_text(weight))
    check_real(op, provider, "eps", eps, minimum=0.0)


def check_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, provider: str = "native",
                   read_data: bool = True) -> None:
    """Validate ``rms_norm(x, weight, eps)``: floating ``x[..., d]``, ``weight[d]`` on x's
    device, ``eps`` a non-negative, non-NaN float."""
    _check_norm("rms_norm", provider, x, weight, eps)
    check_devices("rms_norm", provider, {"x": x, "weight": weight})


def check_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                             *, provider: str = "native", read_data: bool = True) -> None:
    """Validate ``fused_add_rms_norm``: as :func:`check_rms_norm`, plus ``residual`` with
    x's shape, dtype and device."""
    _static_fused_add_rms_norm(x, residual, weight, eps, provider)


def _static_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                               provider: str) -> None:
    op = "fused_add_rms_norm"
    _check_norm(op, provider, x, weight, eps)
    residual = check_tensor(op, provider, "residual", residual)
    if residual.dim() != x.dim():
        raise input_error(op, provider, "residual", f"x's shape {list(x.shape)}",
                          shape_text(residual))
    for a, b in zip(residual.shape, x.shape, strict=True):
        require(a == b, op, provider, "residual", lambda: f"x's shape {list(x.shape)}",
                lambda: shape_text(residual))
    if residual.dtype != x.dtype:
        raise input_error(op, provider, "residual", f"x's dtype {x.dtype}", residual.dtype)
    check_devices(op, provider, {"x": x, "residual": residual, "weight": weight})


def _norm_args(op: str, provider: str, x: Tensor, weight: Tensor, eps: float) -> int:
    x = check_float_tensor(op, provider, "x", x)
    weight = check_float_tensor(op, provider, "weight", weight)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., d] with at least one dimension",
                          f"shape {list(x.shape)}")
    d = int(x.shape[-1])
    if weight.dim() != 1 or weight.shape[0] != d:
        raise input_error(op, provider, "weight", f"shape [{d}] (x's last dimension)",
                          f"shape {list(weight.shape)}")
    check_same_device(op, provider, x, weight=weight)
    if not eps >= 0.0:
        raise input_error(op, provider, "eps", "a non-negative float", eps)
    return d


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
    residual = check_tensor(op, provider, "residual", residual)
    if residual.shape != x.shape:
        raise input_error(op, provider, "residual", f"x's shape {list(x.shape)}",
                          f"shape {list(residual.shape)}")
    if residual.dtype != x.dtype:
        raise input_error(op, provider, "residual", f"x's dtype {x.dtype}", residual.dtype)
    check_same_device(op, provider, x, residual=residual)


def check_rms_norm_gated(x: Tensor, weight: Tensor, z: Tensor | None = None, eps: float = 1e-5,
                         group_size: int | None = None, norm_before_gate: bool = False,
                         activation: str = "swish", *, provider: str = "native",
                         read_data: bool = True) -> None:
    """Validate ``rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate, activation)``."""
    op = "rms_norm_gated"
    d = _norm_args(op, provider, x, weight, eps)
    if z is not None:
        z = check_float_tensor(op, provider, "z", z)
        if z.shape != x.shape:
            raise input_error(op, provider, "z", f"None or x's shape {list(x.shape)}",
                              f"shape {list(z.shape)}")
        check_same_device(op, provider, x, z=z)
    if group_size is not None and (group_size <= 0 or d % group_size != 0):
        raise input_error(op, provider, "group_size",
                          f"None or a positive divisor of x's last dimension {d}", group_size)
    if activation not in GATE_ACTIVATIONS:
        raise input_error(op, provider, "activation", f"one of {sorted(GATE_ACTIVATIONS)}",
                          repr(activation))
