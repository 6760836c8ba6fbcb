"""The op catalog: native reference implementations, one module per family.

Importing this package registers every catalog op in the global registry (namespace
``opmux``); each op is re-exported here, e.g. ``opmux.ops.rms_norm``. The validation
helpers that the references use live in :mod:`opmux.ops.checks` (one module per family), for
providers to call.
"""

from __future__ import annotations

from opmux.ops import moe
from opmux.ops.activation import (
    fatrelu_and_mul,
    gelu_and_mul,
    gelu_and_mul_sparse,
    gelu_fast,
    gelu_new,
    mul_and_silu,
    quick_gelu,
    relu2,
    silu_and_mul,
    swigluoai_and_mul,
    xielu,
)
from opmux.ops.attention import (
    concat_and_cache_mla,
    encoder_attention,
    mla_attention,
    paged_attention,
)
from opmux.ops.cache import advance_step_flashattn, reshape_and_cache
from opmux.ops.communication import all_gather, all_reduce, all_reduce_, reduce_scatter
from opmux.ops.layernorm import (
    fused_add_rms_norm,
    gemma_fused_add_rms_norm,
    gemma_rms_norm,
    rms_norm,
    rms_norm_gated,
)
from opmux.ops.linear import linear
from opmux.ops.moe import fused_moe, grouped_topk, topk_softmax
from opmux.ops.quant import quant_fp8
from opmux.ops.rotary import apply_rotary_emb, dual_chunk_rotary_embedding, rotary_embedding
from opmux.ops.ssd import ssd_chunk_scan, ssd_state_update
from opmux.ops.ssm import (
    causal_conv1d,
    causal_conv1d_update,
    selective_scan,
    selective_state_update,
)

__all__ = [
    "advance_step_flashattn",
    "all_gather",
    "all_reduce",
    "all_reduce_",
    "apply_rotary_emb",
    "causal_conv1d",
    "causal_conv1d_update",
    "concat_and_cache_mla",
    "dual_chunk_rotary_embedding",
    "encoder_attention",
    "fatrelu_and_mul",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_and_mul",
    "gelu_and_mul_sparse",
    "gelu_fast",
    "gelu_new",
    "gemma_fused_add_rms_norm",
    "gemma_rms_norm",
    "grouped_topk",
    "linear",
    "mla_attention",
    "moe",
    "mul_and_silu",
    "paged_attention",
    "quant_fp8",
    "quick_gelu",
    "reduce_scatter",
    "relu2",
    "reshape_and_cache",
    "rms_norm",
    "rms_norm_gated",
    "rotary_embedding",
    "selective_scan",
    "selective_state_update",
    "silu_and_mul",
    "ssd_chunk_scan",
    "ssd_state_update",
    "swigluoai_and_mul",
    "topk_softmax",
    "xielu",
]
