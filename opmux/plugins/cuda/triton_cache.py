"""Triton kernels for the KV-cache bookkeeping ops ``reshape_and_cache`` and
``advance_step_flashattn``.

Both mutate their arguments in place. Checked once: each ``supports_args`` runs native's static
check (metadata only) before its own conditions, so the provider never accepts what native
refuses and a call it declines runs native, whose check gives the error. The kernels do not
check indices: the impls check their values (slot and block ranges, native's value checks)
before the launch, so a bad call writes nothing, but only for CPU tensors (the interpreter):
on a GPU that read would cost a device sync per call. Every tensor is addressed through its
strides (strided caches and slot mappings, 1-d or strided sampled ids, strided block tables).
"""

import torch
import triton
import triton.language as tl

from opmux.ops.checks import (
    check_advance_step_flashattn,
    check_advance_step_flashattn_values,
    check_reshape_and_cache,
    check_slot_values,
    static_check_passes,
)
from opmux.plugins.cuda.triton_runtime import DTYPES, next_pow2

__all__ = [
    "advance_step_flashattn",
    "advance_step_flashattn_supports",
    "reshape_and_cache",
    "reshape_and_cache_supports",
]


@triton.jit  # type: ignore[untyped-decorator]
def _reshape_and_cache_kernel(  # type: ignore[no-untyped-def]
    key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    kc_sb, kc_so, kc_sh, kc_sd, vc_sb, vc_so, vc_sh, vc_sd,
    num_kv_heads, head_size, block_size,
    BLOCK_H: tl.constexpr, D_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, D_PAD)
        mask = (heads < num_kv_heads)[:, None] & (cols < head_size)[None, :]
        h2 = heads[:, None]
        c2 = cols[None, :]
        k = tl.load(key_ptr + tok * k_st + h2 * k_sh + c2 * k_sd, mask=mask)
        v = tl.load(value_ptr + tok * v_st + h2 * v_sh + c2 * v_sd, mask=mask)
        tl.store(kc_ptr + blk * kc_sb + off * kc_so + h2 * kc_sh + c2 * kc_sd,
                 k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + blk * vc_sb + off * vc_so + h2 * vc_sh + c2 * vc_sd,
                 v.to(vc_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_cache_format: str = "canonical") -> None:
    """Write ``key[t]``/``value[t]`` to cache slot ``slot_mapping[t]``; slot -1 skips (Triton)."""
    if key.is_cpu:  # slot values: the kernel does not check them
        check_slot_values("reshape_and_cache", "triton", slot_mapping,
                          key_cache.shape[0] * key_cache.shape[1])
    tokens, hkv, d = key.shape
    if tokens == 0 or hkv == 0 or d == 0:
        return
    d_pad = next_pow2(d)
    block_h = max(1, min(next_pow2(hkv), 4096 // d_pad))
    _reshape_and_cache_kernel[(tokens, triton.cdiv(hkv, block_h))](
        key, value, key_cache, value_cache, slot_mapping.contiguous(),
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        hkv, d, key_cache.shape[1],
        BLOCK_H=block_h, D_PAD=d_pad, num_warps=4 if block_h * d_pad >= 1024 else 1,
    )


def reshape_and_cache_supports(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               kv_cache_format: str = "canonical") -> bool:
    """The canonical format, native's static check, float tensors (any strides)."""
    return (kv_cache_format == "canonical"
            and static_check_passes(check_reshape_and_cache, key, value, key_cache, value_cache,
                                    slot_mapping, provider="triton")
            and key.dtype in DTYPES and value.dtype in DTYPES and key_cache.dtype in DTYPES
            and value_cache.dtype in DTYPES)


@triton.jit  # type: ignore[untyped-decorator]
def _advance_step_kernel(  # type: ignore[no-untyped-def]
    tokens_ptr, tok_st, sampled_ptr, sampled_stride, positions_ptr, pos_st, seq_lens_ptr,
    len_st, slots_ptr, slot_st, block_tables_ptr, bt_stride, bt_col_stride, num_seqs,
    num_queries, block_size,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < num_seqs
    is_query = i < num_queries
    pad = live & (i >= num_queries)
    i64 = i.to(tl.int64)
    sampled = tl.load(sampled_ptr + i64 * sampled_stride, mask=is_query, other=0)
    pos = tl.load(seq_lens_ptr + i64 * len_st, mask=is_query, other=0)
    blk = tl.load(block_tables_ptr + i64 * bt_stride
                  + (pos // block_size).to(tl.int64) * bt_col_stride,
                  mask=is_query, other=0)
    slot = blk.to(tl.int64) * block_size + (pos % block_size)
    tl.store(tokens_ptr + i64 * tok_st, sampled, mask=is_query)
    tl.store(positions_ptr + i64 * pos_st, pos.to(tl.int64), mask=is_query)
    tl.store(seq_lens_ptr + i64 * len_st, pos + 1, mask=is_query)
    tl.store(slots_ptr + i64 * slot_st, slot, mask=is_query)
    tl.store(tokens_ptr + i64 * tok_st, tl.zeros_like(sampled), mask=pad)
    tl.store(positions_ptr + i64 * pos_st, tl.zeros_like(sampled), mask=pad)
    tl.store(slots_ptr + i64 * slot_st, tl.full([BLOCK], -1, tl.int64), mask=pad)


def advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                           input_tokens: torch.Tensor, sampled_token_ids: torch.Tensor,
                           input_positions: torch.Tensor, seq_lens: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> None:
    """Advance decode state by one token in place (Triton); padding rows get slot -1.

    Every tensor is read and written through its strides (strided state vectors, 1-d or
    strided sampled ids, strided block tables).
    """
    if input_tokens.is_cpu:  # index values: the kernel does not check them
        check_advance_step_flashattn_values(num_queries, block_size, seq_lens, block_tables,
                                            provider="triton")
    if num_seqs == 0:
        return
    block = min(next_pow2(num_seqs), 1024)
    _advance_step_kernel[(triton.cdiv(num_seqs, block),)](
        input_tokens, input_tokens.stride(0), sampled_token_ids, sampled_token_ids.stride(0),
        input_positions, input_positions.stride(0), seq_lens, seq_lens.stride(0),
        slot_mapping, slot_mapping.stride(0), block_tables, block_tables.stride(0),
        block_tables.stride(1), num_seqs, num_queries, block_size,
        BLOCK=block, num_warps=4,
    )


def advance_step_flashattn_supports(num_seqs: int, num_queries: int, block_size: int,
                                    input_tokens: torch.Tensor, sampled_token_ids: torch.Tensor,
                                    input_positions: torch.Tensor, seq_lens: torch.Tensor,
                                    slot_mapping: torch.Tensor, block_tables: torch.Tensor
                                    ) -> bool:
    """Native's static check: the kernel takes every layout native takes."""
    return static_check_passes(check_advance_step_flashattn, num_seqs, num_queries, block_size,
                               input_tokens, sampled_token_ids, input_positions, seq_lens,
                               slot_mapping, block_tables, provider="triton")
