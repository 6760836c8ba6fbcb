"""The ``cpp`` provider's impls of vLLM's other activation rows (``csrc/cpu/activation.cpp``).

Same contract as :mod:`opmux.plugins.cpu.cpp_ops`, checked once: each ``supports_args`` is
the whole acceptance test on metadata (CPU fp32/bf16/fp16 contiguous input, native's static
conditions on shapes and scalars), so ``cpp`` never accepts what native refuses and anything
else runs native, whose check gives the error; each impl allocates its output and calls the
out-variant kernel, whose own checks are the last guard.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
import math
from collections.abc import Callable

import torch
from torch import Tensor

from opmux.ops.activation import sparsity_std_multiplier
from opmux.plugins.cpu._kernels import FLOATS, K, call
from opmux.plugins.registration import OpTable, op_table, predicate


def _ok(x: Tensor) -> bool:
    return isinstance(x, Tensor) and x.is_cpu and x.dtype in FLOATS and x.is_contiguous()


def _gated_ok(x: Tensor) -> bool:
    """A contiguous CPU ``x[..., 2*d]`` of a kernel dtype."""
    return _ok(x) and x.dim() >= 1 and x.shape[-1] % 2 == 0


def _finite(value: object) -> bool:
    return type(value) in (float, int) and math.isfinite(value)  # type: ignore[arg-type]


def _half(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def fatrelu_and_mul(x: Tensor, threshold: float = 0.0) -> Tensor:
    out = _half(x)
    call("fatrelu_and_mul", K.fatrelu_and_mul_out, out, x, threshold)
    return out


fatrelu_and_mul_supports = predicate(
    fatrelu_and_mul, lambda x, threshold: _gated_ok(x) and _finite(threshold))


def mul_and_silu(x: Tensor) -> Tensor:
    out = _half(x)
    call("mul_and_silu", K.mul_and_silu_out, out, x)
    return out


def gelu_and_mul_sparse(x: Tensor, activation_sparsity: float,
                        approximate: str = "none") -> Tensor:
    out = _half(x)
    call("gelu_and_mul_sparse", K.gelu_and_mul_sparse_out, out, x,
         sparsity_std_multiplier(float(activation_sparsity)), approximate)
    return out


gelu_and_mul_sparse_supports = predicate(
    gelu_and_mul_sparse,
    lambda x, activation_sparsity, approximate:
    _gated_ok(x) and _finite(activation_sparsity) and 0.0 < activation_sparsity < 1.0
    and approximate in ("none", "tanh"))


def swigluoai_and_mul(x: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    out = _half(x)
    call("swigluoai_and_mul", K.swigluoai_and_mul_out, out, x, alpha, limit)
    return out


swigluoai_and_mul_supports = predicate(
    swigluoai_and_mul,
    lambda x, alpha, limit: _gated_ok(x) and _finite(alpha) and _finite(limit) and limit >= 0)


def _unary(op: str, kernel: Callable[..., None], x: Tensor) -> Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    call(op, kernel, out, x)
    return out


def gelu_new(x: Tensor) -> Tensor:
    return _unary("gelu_new", K.gelu_new_out, x)


def gelu_fast(x: Tensor) -> Tensor:
    return _unary("gelu_fast", K.gelu_fast_out, x)


def quick_gelu(x: Tensor) -> Tensor:
    return _unary("quick_gelu", K.quick_gelu_out, x)


def relu2(x: Tensor) -> Tensor:
    return _unary("relu2", K.relu2_out, x)


def xielu(x: Tensor, alpha_p: Tensor, alpha_n: Tensor, beta: float, eps: float) -> Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    call("xielu", K.xielu_out, out, x, alpha_p, alpha_n, beta, eps)
    return out


def xielu_out_dtype(x: Tensor, alpha_p: Tensor, alpha_n: Tensor) -> torch.dtype:
    """The reference's result dtype: shape-[1] parameters take part in type promotion."""
    dtype = x.dtype
    for t in (alpha_p, alpha_n):
        if t.dim() > 0:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _xielu_params_ok(x: Tensor, alpha_p: Tensor, alpha_n: Tensor, beta: float,
                     eps: float) -> bool:
    # one value each in alpha_p and alpha_n (shape [1] or []), finite beta and eps
    return (_ok(x) and isinstance(alpha_p, Tensor) and isinstance(alpha_n, Tensor)
            and alpha_p.dtype in FLOATS and alpha_n.dtype == alpha_p.dtype
            and alpha_p.dim() <= 1 and alpha_p.numel() == 1
            and alpha_n.dim() <= 1 and alpha_n.numel() == 1
            and x.dim() >= max(alpha_p.dim(), alpha_n.dim())
            and alpha_p.is_cpu and alpha_n.is_cpu
            and xielu_out_dtype(x, alpha_p, alpha_n) == x.dtype
            and _finite(beta) and _finite(eps))


xielu_supports = predicate(xielu, _xielu_params_ok)


# the ops without parameters take what their kernels take: a contiguous CPU float tensor
# (x[..., 2*d] for the gated one)
mul_and_silu_supports = _gated_ok
gelu_new_supports = _ok
gelu_fast_supports = _ok
quick_gelu_supports = _ok
relu2_supports = _ok


OPS: OpTable = op_table(
    (fatrelu_and_mul, fatrelu_and_mul_supports),
    (mul_and_silu, mul_and_silu_supports),
    (gelu_and_mul_sparse, gelu_and_mul_sparse_supports),
    (swigluoai_and_mul, swigluoai_and_mul_supports),
    (gelu_new, gelu_new_supports),
    (gelu_fast, gelu_fast_supports),
    (quick_gelu, quick_gelu_supports),
    (relu2, relu2_supports),
    (xielu, xielu_supports),
)
"""Op name -> (impl, supports_args), merged into :data:`opmux.plugins.cpu.cpp_ops.OPS`."""

__all__ = ["OPS", *OPS]  # the impls are the ops of the table
