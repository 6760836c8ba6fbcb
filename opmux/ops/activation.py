"""Activations (native references): the gated ``silu_and_mul`` / ``gelu_and_mul`` family
and vLLM's other activation rows.

The ops added for vLLM's table (``fatrelu_and_mul``, ``mul_and_silu``, ``gelu_and_mul_sparse``,
``swigluoai_and_mul``, ``gelu_new``, ``gelu_fast``, ``quick_gelu``, ``relu2``, ``xielu``)
compute exactly what vLLM 0.32's ``forward_native`` computes, in the same dtype: vLLM does
not upcast these, so neither do the references (every PyTorch op rounds to ``x.dtype``).
Providers compute in fp32 and round once, which stays within the conformance tolerances.
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks import activation as checks

__all__ = [
    "fatrelu_and_mul",
    "gelu_and_mul",
    "gelu_and_mul_sparse",
    "gelu_fast",
    "gelu_new",
    "mul_and_silu",
    "quick_gelu",
    "relu2",
    "silu_and_mul",
    "sparsity_std_multiplier",
    "swigluoai_and_mul",
    "xielu",
]


@register_op
def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x[..., 2*d]``; fp32 math, returns ``x.dtype``.

    :param x: floating tensor whose last dimension is even.
    :returns: a new tensor ``[..., d]``.
    :raises opmux.OpInputError: for a non-floating ``x`` or an odd last dimension.
    """
    checks.check_silu_and_mul(x)
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
    checks.check_gelu_and_mul(x, approximate)
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.gelu(xf[..., :d], approximate=approximate) * xf[..., d:]).to(x.dtype)



@register_op
def fatrelu_and_mul(x: Tensor, threshold: float = 0.0) -> Tensor:
    """``threshold(x[..., :d], threshold, 0) * x[..., d:]`` in ``x.dtype`` (vLLM FatreluAndMul).

    A gate value passes when it is strictly greater than ``threshold``, else it becomes 0.

    :raises opmux.OpInputError: a bad ``x`` or a non-finite ``threshold``.
    """
    checks.check_fatrelu_and_mul(x, threshold)
    d = x.shape[-1] // 2
    return F.threshold(x[..., :d], threshold, 0.0) * x[..., d:]


@register_op
def mul_and_silu(x: Tensor) -> Tensor:
    """``x[..., :d] * silu(x[..., d:])`` in ``x.dtype`` (vLLM MulAndSilu)."""
    checks.check_gated("mul_and_silu", x)
    d = x.shape[-1] // 2
    return x[..., :d] * F.silu(x[..., d:])


def sparsity_std_multiplier(activation_sparsity: float) -> float:
    """The standard-normal quantile ``Phi^-1(p)`` of ``activation_sparsity``, as vLLM's
    ``Normal(0, 1).icdf(p)`` takes it in float32: ``p`` and the result are rounded to float32
    (vLLM's float32 ``erfinv`` may differ from the correctly rounded value by a few ulp).

    Plain float arithmetic (Halley's iteration on ``erfc``, converged to float64): no tensor,
    so it runs under fake tensors and ``torch.compile`` traces it as a constant.
    """
    p = _round_f32(float(activation_sparsity))
    x = 0.0
    for _ in range(64):
        err = 0.5 * math.erfc(-x * _SQRT1_2) - p
        step = err / (math.exp(-0.5 * x * x) * _RSQRT_2PI)
        x -= step / (1.0 + 0.5 * x * step)
        if abs(step) <= 1e-15 * max(1.0, abs(x)):
            break
    return _round_f32(x)


def _round_f32(x: float) -> float:
    """``x`` rounded to float32's 24-bit significand, half to even (normal range)."""
    mantissa, exponent = math.frexp(x)
    return math.ldexp(round(mantissa * 16777216.0) / 16777216.0, exponent)


_SQRT1_2 = math.sqrt(0.5)
_RSQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@register_op
def gelu_and_mul_sparse(x: Tensor, activation_sparsity: float,
                        approximate: str = "none") -> Tensor:
    """Gemma-3n's sparse GeGLU (vLLM GeluAndMulSparse), in ``x.dtype``.

    Per row of the gate ``g = x[..., :d]``: ``cutoff = mean(g) + std(g) * m`` (population
    std; ``m`` = :func:`sparsity_std_multiplier` of ``activation_sparsity``), then
    ``gelu(relu(g - cutoff), approximate) * x[..., d:]``.

    :param activation_sparsity: target fraction of zeroed gate values, in (0, 1).
    :raises opmux.OpInputError: a bad ``x``, sparsity outside (0, 1) or unknown
        ``approximate``.
    """
    checks.check_gelu_and_mul_sparse(x, activation_sparsity, approximate)
    multiplier = sparsity_std_multiplier(float(activation_sparsity))
    d = x.shape[-1] // 2
    if x.numel() == 0:  # nothing to compute (torch.std would warn about 0 degrees of freedom)
        return x.new_empty((*x.shape[:-1], d))
    gate = x[..., :d]
    mean = torch.mean(gate, dim=-1, keepdim=True)
    std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
    sparse = F.relu(gate - (mean + std * multiplier))
    return F.gelu(sparse, approximate=approximate) * x[..., d:]


@register_op
def swigluoai_and_mul(x: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """gpt-oss's clamped SwiGLU (vLLM SwigluOAIAndMul), in ``x.dtype``.

    Gate and up are *interleaved*: ``gate = x[..., 0::2]``, ``up = x[..., 1::2]``;
    ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, result
    ``(up + 1) * gate * sigmoid(alpha * gate)``.
    """
    checks.check_swigluoai_and_mul(x, alpha, limit)
    gate = x[..., ::2].clamp(min=None, max=limit)
    up = x[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@register_op
def gelu_new(x: Tensor) -> Tensor:
    """GPT-2's tanh GELU (vLLM NewGELU), in ``x.dtype``:
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    checks.check_elementwise("gelu_new", x)
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


@register_op
def gelu_fast(x: Tensor) -> Tensor:
    """The fast tanh GELU (vLLM FastGELU), in ``x.dtype``:
    ``0.5 x (1 + tanh(0.7978845608 x (1 + 0.044715 x^2)))``."""
    checks.check_elementwise("gelu_fast", x)
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


@register_op
def quick_gelu(x: Tensor) -> Tensor:
    """``x * sigmoid(1.702 x)`` in ``x.dtype`` (vLLM QuickGELU)."""
    checks.check_elementwise("quick_gelu", x)
    return x * torch.sigmoid(1.702 * x)


@register_op
def relu2(x: Tensor) -> Tensor:
    """``relu(x)^2`` in ``x.dtype`` (vLLM ReLUSquaredActivation)."""
    checks.check_elementwise("relu2", x)
    return torch.square(F.relu(x))


@register_op
def xielu(x: Tensor, alpha_p: Tensor, alpha_n: Tensor, beta: float, eps: float) -> Tensor:
    """xIELU (vLLM XIELU's Python path) with the layer's raw parameters.

    ``a_p = softplus(alpha_p)``, ``a_n = beta + softplus(alpha_n)`` (in the parameters'
    dtype), then ``a_p x^2 + beta x`` where ``x > 0`` and
    ``(expm1(min(x, eps)) - x) a_n + beta x`` elsewhere. PyTorch type promotion applies as
    in vLLM: with shape-[1] parameters the result has ``promote_types(x, alpha)``'s dtype.

    :param alpha_p: raw (pre-softplus) positive-branch parameter, one value.
    :param alpha_n: raw negative-branch parameter, one value.
    :param beta: the linear coefficient (the layer passes its buffer's value).
    :param eps: the clamp of the negative branch (likewise).
    """
    checks.check_xielu(x, alpha_p, alpha_n, beta, eps)
    a_p = F.softplus(alpha_p)
    a_n = beta + F.softplus(alpha_n)
    return torch.where(x > 0, a_p * x * x + beta * x,
                       (torch.expm1(torch.clamp(x, max=eps)) - x) * a_n + beta * x)
