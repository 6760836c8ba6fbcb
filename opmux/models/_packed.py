"""Linear weights packed once for oneDNN's matmul (CPU, float32).

oneDNN multiplies a few rows by a weight fastest when the weight already lies in the blocked
layout its kernel reads; ``torch.ops.mkldnn._reorder_linear_weight`` makes that copy (the
packing Inductor's CPU freezing does) and ``torch.ops.mkldnn._linear_pointwise`` multiplies by
it. :class:`PackedWeight` keeps such a copy beside a layer's weight, which stays as it is for
loading and every other path, and the engine's decoder calls it instead of the layer (no
module call, no dispatch): two rows or more (a batched decode step, a prefill) go through the
packed copy; a single row (batch-1 decode), where the packed layout does not win, goes through
oneDNN on the plain weight when the weight has at least 2**20 elements (below that oneDNN's
fixed cost per call loses) and ``F.linear`` otherwise, whatever the thread count
(``benchmarks/decode_profile.py`` times the engine with and without these paths,
``benchmarks/llamacpp_cpu.py`` against llama.cpp). A weight changed in place after packing is
packed again at its next call.

The two ops are private torch ops, looked up once; where a torch build lacks them nothing is
packed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PackedWeight", "can_pack"]

_ROWS_HINT = 16  # the rows oneDNN lays the weight out for: a batched decode step
_MIN_ONEDNN_ROW = 1 << 20  # weight elements from which a single row goes to oneDNN


def _find(name: str) -> Callable[..., Tensor] | None:
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, name, None)


_REORDER = _find("_reorder_linear_weight")
_LINEAR = _find("_linear_pointwise")


def can_pack(weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :class:`PackedWeight` takes this float32 CPU weight (and bias)."""
    return (_REORDER is not None and _LINEAR is not None and weight.dim() == 2
            and weight.dtype == torch.float32 and weight.is_cpu
            and not weight.is_inference()  # its in-place changes must be seen (_version)
            and (bias is None or (bias.dtype == torch.float32 and bias.is_cpu)))


class PackedWeight:
    """``x Wᵀ + b`` through a oneDNN-packed copy of ``weight`` (see the module).

    :param weight: ``[out, in]`` float32 on the CPU (:func:`can_pack`).
    :param bias: ``[out]`` or ``None``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self._version = -1
        self._packed = weight
        self._row_onednn = weight.numel() >= _MIN_ONEDNN_ROW

    def takes(self, x: Tensor) -> bool:
        """Whether :meth:`__call__` serves ``x``: rows of float32 CPU input, outside
        autograd and compilation."""
        return (x.dim() == 2 and x.shape[0] > 0 and x.dtype == torch.float32 and x.is_cpu
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling())

    def __call__(self, x: Tensor) -> Tensor:
        assert _REORDER is not None and _LINEAR is not None
        if x.shape[0] == 1:
            if self._row_onednn:
                return _LINEAR(x, self.weight, self.bias, "none", [], "")
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self._version:
            self._packed = _REORDER(self.weight.detach(), _ROWS_HINT)
            self._version = self.weight._version
        return _LINEAR(x, self._packed, self.bias, "none", [], "")
