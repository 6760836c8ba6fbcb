"""``y = x Wᵀ + b`` for the linear layers: ``F.linear``, or oneDNN where it is much faster.

On CPU, ``F.linear`` in float32 goes to MKL's sgemm, which at a few rows (a decode step)
barely uses a second thread; oneDNN's matmul (what vLLM's CPU backend calls for its linears)
spreads those rows' work over every thread, but has a larger fixed cost per call, and at
hundreds of rows (a prefill) the two tie. ``benchmarks/linear_cpu.py`` measures both in one
run on the projections of a 100M-parameter Llama; its figures are in
``benchmarks/RESULTS.md``. So oneDNN runs only where it wins: eager
float32 CPU calls without autograd or CPU autocast, 1 to 64 rows, a weight of at least 2**20
elements, more than one thread.

torch reaches oneDNN's matmul only through ``torch.ops.mkldnn._linear_pointwise`` (the op
Inductor's CPU lowering emits), so this reads a private torch op: it is looked up once, and
when a torch build lacks it everything runs ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["dense_linear", "takes_onednn"]

_MIN_WEIGHT = 1 << 20
_MAX_ROWS = 64


def _find_onednn() -> Callable[..., Tensor] | None:
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


_ONEDNN = _find_onednn()


def takes_onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :func:`dense_linear` sends this call to oneDNN (see the module): only the
    layouts oneDNN's matmul reads as ``F.linear`` does -- an ``[..., in]`` input of two or
    more dims (any strides), a contiguous ``[out, in]`` weight, no bias or a contiguous
    ``[out]`` one; everything else (and every error) is ``F.linear``'s."""
    # the weight size first: most calls of a small model stop there
    return (_ONEDNN is not None and weight.numel() >= _MIN_WEIGHT
            and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled("cpu")  # F.linear follows autocast's dtype
            and x.dim() >= 2 and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and 0 < x.numel() <= _MAX_ROWS * x.shape[-1]
            and x.dtype == weight.dtype == torch.float32 and x.is_cpu and weight.is_cpu
            and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.dim() == 1
                                  and bias.shape[0] == weight.shape[0] and bias.is_cpu
                                  and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and torch.get_num_threads() > 1)


def dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN where it wins (see the module)."""
    if _ONEDNN is not None and takes_onednn(x, weight, bias):
        return _ONEDNN(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
