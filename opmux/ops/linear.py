"""The dense linear op ``linear`` (native reference): ``y = x Wᵀ + b``, the projection every
decoder layer runs a handful of times per token.

The op is ``F.linear`` restricted to the layouts linear layers use (``weight [out, in]``,
``bias [out]``), so that a platform can serve it with its own kernel: the ``cpp`` provider
streams the weight for the one- and two-row calls of a decode step
(``csrc/cpu/linear.cpp``). :func:`opmux.layers.dense_linear` routes the float32 calls of
that shape here. The op has a backward (``F.linear``'s gradients, in plain torch ops), so
it can also be called on tensors that require grad.
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks import check_linear

__all__ = ["linear"]


@register_op
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias``; bf16/fp16 inputs compute in float32 and round once.

    >>> import torch, opmux
    >>> x, w, b = torch.ones(2, 3), torch.full((4, 3), 0.5), torch.arange(4.0)
    >>> opmux.ops.linear(x, w, b).tolist()
    [[1.5, 2.5, 3.5, 4.5], [1.5, 2.5, 3.5, 4.5]]

    :param x: floating tensor ``[..., in]``.
    :param weight: ``[out, in]`` of x's dtype.
    :param bias: ``[out]`` of x's dtype, or ``None``.
    :returns: a new tensor ``[..., out]`` of x's dtype.
    :raises opmux.OpInputError: for mismatched shapes, dtypes or devices.
    """
    check_linear(x, weight, bias)
    if x.dtype in (torch.bfloat16, torch.float16):
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)
    return F.linear(x, weight, bias)


def _save_inputs(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.with_bias = bias is not None


def _backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], Optional[Tensor],
                                                Optional[Tensor]]:
    x, weight = ctx.saved_tensors
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_bias = rows.sum(0) if ctx.with_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_weight, grad_bias


linear.register_autograd(_backward, setup_context=_save_inputs)
