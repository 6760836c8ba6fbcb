"""The ``cpp`` provider of ``linear`` (``csrc/cpu/linear.cpp``: ``linear_out``).

Same contract as :mod:`opmux.plugins.cpu.cpp_ops`, checked once: ``linear_supports`` is the
whole acceptance test on metadata, the impl calls the kernel, whose own checks are the last
guard. The kernel streams the weight as it lies, eight rows side by side, which beats the
GEMM libraries' matrix-vector routes for the one- and two-row calls of a decode step
(``benchmarks/linear_cpu.py --op``); more rows are a GEMM's work and run the next provider.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
from typing import Final, Optional

import torch
from torch import Tensor

from opmux.plugins.cpu._kernels import K, call
from opmux.plugins.registration import OpTable, op_table

__all__ = ["MAX_ROWS", "OPS", "linear", "linear_supports"]

MAX_ROWS: Final = 2
"""The most rows of ``x`` (its elements over its last dimension) the kernel takes."""

_DTYPES = (torch.float32, torch.bfloat16)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    k = x.shape[-1]
    rows = x.reshape(-1, k)  # a view for the layouts of a decode step; else a copy of <= 2 rows
    if rows.stride(1) != 1 and k > 1:
        rows = rows.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    call("linear", K.linear_out, out.view(-1, weight.shape[0]), rows, weight, bias)
    return out


def linear_supports(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> bool:
    """CPU float32 or bfloat16 ``x`` of one or two rows, a ``weight [out, in]`` (``out > 0``)
    of x's dtype with unit inner stride, ``bias [out]`` of x's dtype or ``None``."""
    return (isinstance(x, Tensor) and x.dtype in _DTYPES and x.is_cpu and x.dim() >= 1
            and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
            and isinstance(weight, Tensor) and weight.dtype == x.dtype and weight.is_cpu
            and weight.dim() == 2 and weight.shape[0] > 0 and weight.shape[1] == x.shape[-1]
            and (weight.stride(1) == 1 or weight.shape[1] == 1)
            and (bias is None or (isinstance(bias, Tensor) and bias.dtype == x.dtype
                                  and bias.is_cpu and bias.dim() == 1
                                  and bias.shape[0] == weight.shape[0])))


OPS: OpTable = op_table((linear, linear_supports))
"""Op name -> (impl, supports_args), merged into :data:`opmux.plugins.cpu.cpp_ops.OPS`."""
