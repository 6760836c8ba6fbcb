"""Activations (native references): the gated ``silu_and_mul`` / ``gelu_and_mul`` family
and vLLM's other activation rows.

The ops added for vLLM's table (``fatrelu_and_mul``, ``mul_and_silu``, ``gelu_and_mul_sparse``,
``swigluoai_and_mul``, ``gelu_new``, ``gelu_fast``, ``quick_gelu``, ``relu2``, ``xielu``)
compute the formulas of vLLM 0.32's ``forward_native``. Every reference follows the catalog's
numerics rule: bf16/fp16 inputs are computed in float32 and rounded once to the output dtype
(float32 and float64 inputs compute in their own dtype), and the providers do the same.
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks import activation as checks


def _wide(x: Tensor) -> Tensor:
    """``x`` in float32 when it is a half dtype (bf16, fp16), else ``x``."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x

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
    xf = _wide(x)
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
    xf = _wide(x)
    return (F.gelu(xf[..., :d], approximate=approximate) * xf[..., d:]).to(x.dtype)



@register_op
def fatrelu_and_mul(x: Tensor, threshold: float = 0.0) -> Tensor:
    """``threshold(x[..., :d], threshold, 0) * x[..., d:]`` (vLLM FatreluAndMul).

    A gate value passes when it is strictly greater than ``threshold``, else it becomes 0.

    :raises opmux.OpInputError: a bad ``x`` or a non-finite ``threshold``.
    """
    checks.check_fatrelu_and_mul(x, threshold)
    d = x.shape[-1] // 2
    xw = _wide(x)
    return (F.threshold(xw[..., :d], threshold, 0.0) * xw[..., d:]).to(x.dtype)


@register_op
def mul_and_silu(x: Tensor) -> Tensor:
    """``x[..., :d] * silu(x[..., d:])`` (vLLM MulAndSilu)."""
    checks.check_gated("mul_and_silu", x)
    d = x.shape[-1] // 2
    xw = _wide(x)
    return (xw[..., :d] * F.silu(xw[..., d:])).to(x.dtype)


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
    """Gemma-3n's sparse GeGLU (vLLM GeluAndMulSparse).

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
    xw = _wide(x)
    gate = xw[..., :d]
    mean = torch.mean(gate, dim=-1, keepdim=True)
    std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
    sparse = F.relu(gate - (mean + std * multiplier))
    return (F.gelu(sparse, approximate=approximate) * xw[..., d:]).to(x.dtype)


@register_op
def swigluoai_and_mul(x: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """gpt-oss's clamped SwiGLU (vLLM SwigluOAIAndMul).

    Gate and up are *interleaved*: ``gate = x[..., 0::2]``, ``up = x[..., 1::2]``;
    ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, result
    ``(up + 1) * gate * sigmoid(alpha * gate)``.
    """
    checks.check_swigluoai_and_mul(x, alpha, limit)
    xw = _wide(x)
    gate = xw[..., ::2].clamp(min=None, max=limit)
    up = xw[..., 1::2].clamp(min=-limit, max=limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).to(x.dtype)


@register_op
def gelu_new(x: Tensor) -> Tensor:
    """GPT-2's tanh GELU (vLLM NewGELU):
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    checks.check_elementwise("gelu_new", x)
    c = math.sqrt(2.0 / math.pi)
    xw = _wide(x)
    return (0.5 * xw * (1.0 + torch.tanh(c * (xw + 0.044715 * torch.pow(xw, 3.0))))
            ).to(x.dtype)


@register_op
def gelu_fast(x: Tensor) -> Tensor:
    """The fast tanh GELU (vLLM FastGELU):
    ``0.5 x (1 + tanh(0.7978845608 x (1 + 0.044715 x^2)))``."""
    checks.check_elementwise("gelu_fast", x)
    xw = _wide(x)
    return (0.5 * xw * (1.0 + torch.tanh(xw * 0.7978845608 * (1.0 + 0.044715 * xw * xw)))
            ).to(x.dtype)


@register_op
def quick_gelu(x: Tensor) -> Tensor:
    """``x * sigmoid(1.702 x)`` (vLLM QuickGELU)."""
    checks.check_elementwise("quick_gelu", x)
    xw = _wide(x)
    return (xw * torch.sigmoid(1.702 * xw)).to(x.dtype)


@register_op
def relu2(x: Tensor) -> Tensor:
    """``relu(x)^2`` (vLLM ReLUSquaredActivation)."""
    checks.check_elementwise("relu2", x)
    return torch.square(F.relu(_wide(x))).to(x.dtype)


@register_op
def xielu(x: Tensor, alpha_p: Tensor, alpha_n: Tensor, beta: float, eps: float) -> Tensor:
    """xIELU (vLLM XIELU's Python path) with the layer's raw parameters.

    ``a_p = softplus(alpha_p)``, ``a_n = beta + softplus(alpha_n)`` (in the parameters'
    dtype, as vLLM's layer derives them), then ``a_p x^2 + beta x`` where ``x > 0`` and
    ``(expm1(min(x, eps)) - x) a_n + beta x`` elsewhere. The result has the dtype PyTorch's
    type promotion gives vLLM's expression (with shape-[1] parameters,
    ``promote_types(x, alpha)``); a bf16/fp16 result is computed in float32 and rounded once,
    a wider one (fp16 ``x`` with bf16 parameters, say) follows vLLM's expression as it is.

    :param alpha_p: raw (pre-softplus) positive-branch parameter, one value.
    :param alpha_n: raw negative-branch parameter, one value.
    :param beta: the linear coefficient (the layer passes its buffer's value).
    :param eps: the clamp of the negative branch (likewise).
    """
    checks.check_xielu(x, alpha_p, alpha_n, beta, eps)
    dtype = torch.promote_types(torch.promote_types(x.dtype, alpha_p.dtype), alpha_n.dtype)
    a_p = F.softplus(alpha_p)
    a_n = beta + F.softplus(alpha_n)
    if dtype in (torch.bfloat16, torch.float16):  # a half result: float32 math, one rounding
        x, a_p, a_n = x.float(), a_p.float(), a_n.float()
    # a wider result (mixed dtypes promote to float32) is vLLM's expression as it stands
    return torch.where(x > 0, a_p * x * x + beta * x,
                       (torch.expm1(torch.clamp(x, max=eps)) - x) * a_n + beta * x).to(dtype)
