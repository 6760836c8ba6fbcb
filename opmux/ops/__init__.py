"""The op catalog: native reference implementations, one module per family.

Importing this package registers every catalog op in the global registry (namespace
``opmux``); each op is re-exported here, e.g. ``opmux.ops.rms_norm``. The validation
helpers that the references use live in :mod:`opmux.ops._checks`, for providers to call.
"""

from __future__ import annotations

from opmux.ops import moe
from opmux.ops.activation import gelu_and_mul, silu_and_mul
from opmux.ops.attention import paged_attention
from opmux.ops.cache import advance_step_flashattn, reshape_and_cache
from opmux.ops.layernorm import (
    fused_add_rms_norm,
    gemma_fused_add_rms_norm,
    gemma_rms_norm,
    rms_norm,
    rms_norm_gated,
)
from opmux.ops.moe import fused_moe, grouped_topk, topk_softmax
from opmux.ops.quant import quant_fp8
from opmux.ops.rotary import rotary_embedding

__all__ = [
    "advance_step_flashattn",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_and_mul",
    "gemma_fused_add_rms_norm",
    "gemma_rms_norm",
    "grouped_topk",
    "moe",
    "paged_attention",
    "quant_fp8",
    "reshape_and_cache",
    "rms_norm",
    "rms_norm_gated",
    "rotary_embedding",
    "silu_and_mul",
    "topk_softmax",
]
