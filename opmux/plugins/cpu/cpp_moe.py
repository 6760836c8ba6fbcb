"""The ``cpp`` provider's ``fused_moe`` (``csrc/cpu/moe.cpp``).

Same contract as :mod:`opmux.plugins.cpu.cpp_ops`: ``supports_args`` runs native's static
check of the shapes and dtypes (:func:`opmux.plugins.cpu.moe_ops.fused_moe_args_ok`); the
impl reads the expert ids once for their range check (data: the kernel does not check
them), then calls the out-variant kernel on contiguous inputs (routing weights in fp32, ids
in int64, as the reference computes with them).

``supports_args`` takes CPU tensors of fp32/bf16/fp16 and leaves two cases to the next
provider (``grouped``):

* float32 batches with more than :data:`FP32_MAX_ROWS_PER_EXPERT` (token, slot) rows per
  expert on average. There the expert matmuls are compute-bound, and BLAS (which ``grouped``
  calls) runs them faster than this kernel's tiles (``benchmarks/moe_cpu.py``); with fewer rows
  the call streams the expert weights, which this kernel reads once and ``grouped``'s matmuls
  do not read as fast;
* bfloat16 batches on CPUs with AMX tiles (:data:`BF16_ON_TILES`) whose hidden or
  intermediate width is not a multiple of 32. Widths in whole tile steps run on the kernel's
  AMX tile path (``moe_amx`` in the C++ file); the others go to ``grouped``.

Numerics: the vector path computes in fp32 from the widened weights and rounds once, as the
native does. The AMX tile path rounds the activations to bf16 once more, for the down
projection's tile products.

Numbers in ``benchmarks/moe_cpu.py``'s README section.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
import torch
from torch import Tensor

from opmux.ops.checks import check_expert_ids
from opmux.plugins.cpu._kernels import PROVIDER, K, call, cpu_float
from opmux.plugins.cpu.moe_ops import fused_moe_args_ok
from opmux.plugins.registration import OpTable, op_table, predicate

__all__ = ["BF16_ON_TILES", "FP32_MAX_ROWS_PER_EXPERT", "OPS", "fused_moe"]

FP32_MAX_ROWS_PER_EXPERT = 64 if torch.cpu._is_avx512_supported() else 256
"""Mean (token, slot) rows per expert up to which float32 calls are served here (AVX-512 BLAS
overtakes this kernel at fewer rows than AVX2's)."""

BF16_ON_TILES = bool(torch.cpu._is_amx_tile_supported())
"""Whether this CPU has AMX tiles: then bfloat16 calls with widths that are not multiples of 32
go to ``grouped``."""


def fused_moe(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
              topk_ids: Tensor) -> Tensor:
    ids = topk_ids.to(torch.int64).contiguous()
    if ids.numel():  # the ids are data: the kernel does not range-check them
        lo, hi = torch.aminmax(ids)
        check_expert_ids(PROVIDER, int(lo), int(hi), w1.shape[0])
    out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype)
    call("fused_moe", K.fused_moe_out, out, hidden_states.contiguous(), w1.contiguous(),
         w2.contiguous(), topk_weights.to(torch.float32).contiguous(), ids)
    return out


def _fused_moe_args_ok(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                       topk_ids: Tensor) -> bool:
    # the kernel's dtypes, native's static check, then the sizes this kernel serves faster
    # than ``grouped``
    if not (cpu_float(hidden_states)
            and fused_moe_args_ok(hidden_states, w1, w2, topk_weights, topk_ids)):
        return False
    if hidden_states.dtype == torch.bfloat16:
        return not BF16_ON_TILES or (w1.shape[1] % 64 == 0 and w1.shape[2] % 32 == 0)
    return (hidden_states.dtype != torch.float32
            or topk_ids.numel() <= FP32_MAX_ROWS_PER_EXPERT * w1.shape[0])


fused_moe_supports = predicate(fused_moe, _fused_moe_args_ok)

OPS: OpTable = op_table((fused_moe, fused_moe_supports))
"""Op name -> (impl, supports_args) of the MoE op this provider serves."""
