"""``y = x Wᵀ + b`` for the linear layers: the catalog op ``linear`` for a decode step's
rows, else ``F.linear``, or oneDNN where it is much faster.

A float32 call of one or two rows (a decode step at batch 1 or 2) outside autograd, autocast
and compilation runs the catalog op :func:`opmux.ops.linear`, so a platform's provider serves
it: on the CPU the ``cpp`` kernel streams the weight (``benchmarks/linear_cpu.py --op``), and
where no provider takes the call the op's native is ``F.linear``. Half dtypes stay here: the
op's native widens them to float32, which a call no provider takes should not pay.

For the other calls on CPU, ``F.linear`` in float32 goes to MKL's sgemm, which at a few rows
barely uses a second thread; oneDNN's matmul (what vLLM's CPU backend calls for its linears)
spreads those rows' work over every thread, but has a larger fixed cost per call, and at
hundreds of rows (a prefill) the two tie. ``benchmarks/linear_cpu.py`` measures both in one
run on the projections of a 100M-parameter Llama; its figures are in
``benchmarks/RESULTS.md``. So oneDNN runs only where it wins: eager
float32 CPU calls without autograd or CPU autocast, up to 64 rows (one or two take the op
above), a weight of at least 2**20 elements, more than one thread.

torch reaches oneDNN's matmul only through ``torch.ops.mkldnn._linear_pointwise`` (the op
Inductor's CPU lowering emits), so this reads a private torch op: it is looked up once, and
when a torch build lacks it everything runs ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.ops import linear

__all__ = ["dense_linear", "takes_linear_op", "takes_onednn"]

_MIN_WEIGHT = 1 << 20
_MAX_ROWS = 64
_OP_ROWS = 2  # the rows of a decode step at batch 1 or 2


def _find_onednn() -> Callable[..., Tensor] | None:
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


_ONEDNN = _find_onednn()


def _needs_grad(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether autograd records this call (it then stays on ``F.linear``)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))


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
            and not _needs_grad(x, weight, bias) and torch.get_num_threads() > 1)


def takes_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :func:`dense_linear` sends this call to the catalog op ``linear`` (see the
    module): a float32 ``x`` of one or two rows, a 2-d weight and a 1-d bias or none (the
    layouts the op defines; any other call keeps ``F.linear``'s behaviour), outside autograd,
    autocast and compilation."""
    return (x.dtype == torch.float32 and x.dim() >= 1 and 0 < x.numel() <= _OP_ROWS * x.shape[-1]
            and weight.dim() == 2 and (bias is None or bias.dim() == 1)
            and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled()
            and not _needs_grad(x, weight, bias))


def dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)``: a decode step's rows through the catalog op ``linear``,
    other calls through oneDNN where it wins (see the module)."""
    if takes_linear_op(x, weight, bias):
        out: Tensor = linear(x, weight, bias)
        return out
    if _ONEDNN is not None and takes_onednn(x, weight, bias):
        return _ONEDNN(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
