"""Input checks of the activation ops (:mod:`opmux.ops.activation`).

Same contract as every module of :mod:`opmux.ops.checks`: each ``check_<op>`` takes the op's
arguments plus ``provider`` and ``read_data`` and raises :class:`opmux.OpInputError` (built
by :func:`~opmux.ops.checks.input_errors.input_error`) naming op, provider, argument, expected
and got, before anything is written.
"""

from __future__ import annotations

import math
from typing import Final

from torch import Tensor

from opmux.ops.checks.input_errors import input_error, shape_text
from opmux.ops.checks.single_arguments import check_float_tensor, check_floating, check_tensor
from opmux.ops.checks.symbolic import require

__all__ = [
    "GELU_APPROXIMATIONS",
    "check_elementwise",
    "check_fatrelu_and_mul",
    "check_gated",
    "check_gelu_and_mul",
    "check_gelu_and_mul_sparse",
    "check_silu_and_mul",
    "check_swigluoai_and_mul",
    "check_xielu",
]

GELU_APPROXIMATIONS: Final = ("none", "tanh")
"""Valid values of ``gelu_and_mul``'s ``approximate``."""


def check_silu_and_mul(x: Tensor, *, provider: str = "native", read_data: bool = True) -> None:
    """Validate ``silu_and_mul(x)``: a floating ``x[..., 2*d]`` (at least 1-d)."""
    check_gated("silu_and_mul", x, provider=provider)


def check_gelu_and_mul(x: Tensor, approximate: str = "none", *, provider: str = "native",
                       read_data: bool = True) -> None:
    """Validate ``gelu_and_mul(x, approximate)``; ``approximate`` is ``"none"``/``"tanh"``."""
    check_gated("gelu_and_mul", x, provider=provider)
    if not isinstance(approximate, str) or approximate not in GELU_APPROXIMATIONS:
        raise input_error("gelu_and_mul", provider, "approximate",
                          f"one of {sorted(GELU_APPROXIMATIONS)}", repr(approximate))


def _finite(op: str, provider: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value):
        raise input_error(op, provider, name, "a finite float", repr(value))
    return float(value)


def check_elementwise(op: str, x: Tensor, *, provider: str = "native") -> None:
    """Validate the one-tensor activations (``gelu_new``, ``gelu_fast``, ``quick_gelu``,
    ``relu2``): any shape, floating."""
    check_float_tensor(op, provider, "x", x)


def check_gated(op: str, x: Tensor, *, provider: str = "native") -> None:
    """Validate a gated activation's floating ``x[..., 2*d]`` (at least 1-d)."""
    x = check_tensor(op, provider, "x", x)
    check_floating(op, provider, "x", x)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., 2*d] with at least one dimension",
                          shape_text(x))
    require(x.shape[-1] % 2 == 0, op, provider, "x",
            "a tensor [..., 2*d] with an even last dimension", lambda: shape_text(x))


def check_fatrelu_and_mul(x: Tensor, threshold: float = 0.0, *, provider: str = "native",
                          read_data: bool = True) -> None:
    """Validate ``fatrelu_and_mul(x, threshold)``."""
    check_gated("fatrelu_and_mul", x, provider=provider)
    _finite("fatrelu_and_mul", provider, "threshold", threshold)


def check_gelu_and_mul_sparse(x: Tensor, activation_sparsity: float,
                              approximate: str = "none", *, provider: str = "native",
                              read_data: bool = True) -> None:
    """Validate ``gelu_and_mul_sparse``: ``0 < activation_sparsity < 1``."""
    op = "gelu_and_mul_sparse"
    check_gated(op, x, provider=provider)
    sparsity = _finite(op, provider, "activation_sparsity", activation_sparsity)
    if not 0.0 < sparsity < 1.0:
        raise input_error(op, provider, "activation_sparsity",
                          "a float in (0, 1) (0 means no sparsity: use gelu_and_mul)", sparsity)
    if approximate not in GELU_APPROXIMATIONS:
        raise input_error(op, provider, "approximate", f"one of {sorted(GELU_APPROXIMATIONS)}",
                          repr(approximate))


def check_swigluoai_and_mul(x: Tensor, alpha: float = 1.702, limit: float = 7.0, *,
                            provider: str = "native", read_data: bool = True) -> None:
    """Validate ``swigluoai_and_mul`` (gate and up interleaved in the last dimension)."""
    op = "swigluoai_and_mul"
    check_gated(op, x, provider=provider)
    _finite(op, provider, "alpha", alpha)
    if not _finite(op, provider, "limit", limit) >= 0.0:
        raise input_error(op, provider, "limit", "a non-negative float", limit)


def check_xielu(x: Tensor, alpha_p: Tensor, alpha_n: Tensor, beta: float, eps: float, *,
                provider: str = "native", read_data: bool = True) -> None:
    """Validate ``xielu``: ``alpha_p``/``alpha_n`` hold one value each (shape [1] or [])."""
    op = "xielu"
    x = check_float_tensor(op, provider, "x", x)
    for name, t in (("alpha_p", alpha_p), ("alpha_n", alpha_n)):
        t = check_float_tensor(op, provider, name, t)
        if t.dim() > 1 or t.numel() != 1:
            raise input_error(op, provider, name, "one value (shape [1] or [])",
                              f"shape {list(t.shape)}")
        if t.device != x.device:
            raise input_error(op, provider, name, f"device {x.device}", t.device)
    _finite(op, provider, "beta", beta)
    _finite(op, provider, "eps", eps)
