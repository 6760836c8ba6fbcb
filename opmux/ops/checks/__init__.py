"""The input checks of the catalog ops, one module per op family; providers import them.

Every ``check_<op>`` takes the op's arguments (same names and order) plus ``provider`` (named
in the error) and ``read_data`` (whether index values may be read), and raises
:class:`opmux.OpInputError` before anything is written. The native reference and every
provider of an op call the same check with their own name, so a provider never accepts what
native rejects::

    from opmux.ops.checks import check_rms_norm

    def my_rms_norm(x, weight, eps=1e-6):
        check_rms_norm(x, weight, eps, provider="my_vendor", read_data=False)
        ...

Modules: :mod:`~opmux.ops.checks.input_errors` (the one error builder),
:mod:`~opmux.ops.checks.symbolic` (conditions under ``torch.compile``, whether values can be
read), :mod:`~opmux.ops.checks.single_arguments` (the checks of one argument every family
shares, with the one integer-range check), :mod:`~opmux.ops.checks.fakes` (fakes built from
a check), then one per op family, named like the op modules of
:mod:`opmux.ops`: ``activation``, ``attention``, ``cache``, ``communication``, ``layernorm``,
``linear``, ``moe``, ``quant``, ``rotary``, ``ssd``, ``ssm``.
"""

from __future__ import annotations

from opmux.ops.checks.activation import (
    GELU_APPROXIMATIONS,
    check_elementwise,
    check_fatrelu_and_mul,
    check_gated,
    check_gelu_and_mul,
    check_gelu_and_mul_sparse,
    check_silu_and_mul,
    check_swigluoai_and_mul,
    check_xielu,
)
from opmux.ops.checks.attention import (
    check_concat_and_cache_mla,
    check_concat_and_cache_mla_values,
    check_encoder_attention,
    check_encoder_attention_values,
    check_mla_attention,
    check_mla_attention_values,
    check_paged_attention,
    check_paged_attention_values,
    check_paged_lens,
)
from opmux.ops.checks.cache import (
    check_advance_step_flashattn,
    check_advance_step_flashattn_values,
    check_cache_pair,
    check_no_overlap,
    check_reshape_and_cache,
    check_slot_values,
    checked_advance_step,
)
from opmux.ops.checks.communication import (
    check_all_gather,
    check_reduce_scatter,
    group_size,
    resolve_group_for,
)
from opmux.ops.checks.fakes import checked_fake
from opmux.ops.checks.input_errors import input_error, kernel_error, shape_text, value_text
from opmux.ops.checks.layernorm import (
    GATE_ACTIVATIONS,
    check_fused_add_rms_norm,
    check_gemma_fused_add_rms_norm,
    check_gemma_rms_norm,
    check_rms_norm,
    check_rms_norm_gated,
)
from opmux.ops.checks.linear import check_linear
from opmux.ops.checks.moe import (
    check_expert_ids,
    check_fused_moe_args,
    check_grouped_topk,
    check_topk_softmax,
)
from opmux.ops.checks.predicates import static_check_passes, with_static_check
from opmux.ops.checks.quant import (
    check_quant_fp8,
)
from opmux.ops.checks.rotary import (
    check_apply_rotary_emb,
    check_dual_chunk_rotary_embedding,
    check_dual_chunk_rotary_embedding_values,
    check_rotary_embedding,
    check_rotary_embedding_values,
    rotary_heads,
)
from opmux.ops.checks.single_arguments import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_bool,
    check_contiguous,
    check_devices,
    check_dtype,
    check_float_tensor,
    check_floating,
    check_int,
    check_int_range,
    check_rank,
    check_real,
    check_same_device,
    check_tensor,
)
from opmux.ops.checks.ssd import (
    check_ssd_chunk_scan,
    check_ssd_chunk_scan_values,
    check_ssd_state_update,
    check_ssd_state_update_values,
)
from opmux.ops.checks.ssm import (
    ACTIVATIONS,
    PAD_SLOT,
    check_causal_conv1d,
    check_causal_conv1d_update,
    check_selective_scan,
    check_selective_state_update,
    check_ssm_index_values,
)
from opmux.ops.checks.symbolic import has_data, is_concrete, require

__all__ = [
    "check_ssm_index_values",
    "check_ssd_chunk_scan_values",
    "check_ssd_state_update_values",
    "check_concat_and_cache_mla_values",
    "check_encoder_attention_values",
    "check_mla_attention_values",
    "check_paged_attention_values",
    "ACTIVATIONS",
    "FLOAT_DTYPES",
    "GATE_ACTIVATIONS",
    "GELU_APPROXIMATIONS",
    "INDEX_DTYPES",
    "PAD_SLOT",
    "check_advance_step_flashattn",
    "check_advance_step_flashattn_values",
    "check_all_gather",
    "check_apply_rotary_emb",
    "check_bool",
    "check_cache_pair",
    "check_causal_conv1d",
    "check_causal_conv1d_update",
    "check_concat_and_cache_mla",
    "check_contiguous",
    "check_devices",
    "check_dtype",
    "check_dual_chunk_rotary_embedding",
    "check_dual_chunk_rotary_embedding_values",
    "check_elementwise",
    "check_encoder_attention",
    "check_expert_ids",
    "check_fatrelu_and_mul",
    "check_float_tensor",
    "check_floating",
    "check_fused_add_rms_norm",
    "check_fused_moe_args",
    "check_gated",
    "check_gelu_and_mul",
    "check_gelu_and_mul_sparse",
    "check_gemma_fused_add_rms_norm",
    "check_gemma_rms_norm",
    "check_grouped_topk",
    "check_int",
    "check_int_range",
    "check_linear",
    "check_mla_attention",
    "check_no_overlap",
    "check_paged_attention",
    "check_paged_lens",
    "check_quant_fp8",
    "check_rank",
    "check_real",
    "check_reduce_scatter",
    "check_reshape_and_cache",
    "check_rms_norm",
    "check_rms_norm_gated",
    "check_rotary_embedding",
    "check_rotary_embedding_values",
    "check_same_device",
    "check_selective_scan",
    "check_selective_state_update",
    "check_silu_and_mul",
    "check_slot_values",
    "check_ssd_chunk_scan",
    "check_ssd_state_update",
    "check_swigluoai_and_mul",
    "check_tensor",
    "check_topk_softmax",
    "check_xielu",
    "checked_advance_step",
    "checked_fake",
    "group_size",
    "has_data",
    "input_error",
    "is_concrete",
    "kernel_error",
    "require",
    "resolve_group_for",
    "rotary_heads",
    "shape_text",
    "static_check_passes",
    "value_text",
    "with_static_check",
]
