"""The ``cpp`` provider of ``encoder_attention``, ``concat_and_cache_mla`` and ``mla_attention``.

- ``encoder_attention``: one task per (sequence, head, 64-row query tile), run in parallel;
  a task converts its kv head's keys and values to fp32 once, multiplies the tiles with
  ATen's CPU GEMM (single-threaded inside the task) and does the softmax in at::vec loops,
  so no ``[H, n, n]`` score tensor is ever built.
- ``mla_attention``: the absorbed form for every row, prefill included (the same result as
  the native prefill path, computed in latent space): ``q_nope @ W_UK`` and the final
  ``@ W_UV^T`` are batched GEMMs (``torch.bmm``, fp32); the latent attention between them is
  the C++ kernel, one task per (query row, group of 16 heads): per cache block, scores and
  the weighted latent sum are GEMMs over the block's rows in place (no gather), with a
  vectorised softmax between the two passes.
- ``concat_and_cache_mla``: row copies into the paged latent cache.

Each ``supports_args`` runs native's static check on metadata
(:func:`opmux.ops.checks.with_static_check`) before its own conditions; each impl checks the
index values with the catalog's value checks (``provider="cpp"``) before any kernel runs, so
a bad call writes nothing and raises the standard error naming the argument.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
from typing import Optional

import torch
from torch import Tensor

from opmux.ops.checks import (
    check_concat_and_cache_mla,
    check_concat_and_cache_mla_values,
    check_encoder_attention,
    check_encoder_attention_values,
    check_mla_attention,
    check_mla_attention_values,
    with_static_check,
)
from opmux.plugins.cpu._kernels import FLOATS, K, call
from opmux.plugins.registration import OpTable, op_table

__all__ = ["OPS", "concat_and_cache_mla", "encoder_attention", "mla_attention"]



def _int32(t: Tensor) -> Tensor:
    """Index tensors as the kernels read them (int32, contiguous; a no-op when they are)."""
    return t.to(torch.int32).contiguous()


def encoder_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                      max_seqlen: Optional[int], scale: float) -> Tensor:
    # the kernel checks the offsets too, not that max_seqlen bounds the lengths
    check_encoder_attention_values(q, cu_seqlens, max_seqlen, provider="cpp")
    out = torch.empty(q.shape, dtype=q.dtype)
    call("encoder_attention", K.encoder_attention_out, out, q, k, v, _int32(cu_seqlens),
          scale)
    return out


def _encoder_attention_ok(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                         max_seqlen: Optional[int], scale: float) -> bool:
    return (q.is_cpu and q.dtype in FLOATS and q.dim() == 3 and k.dim() == 3 and v.dim() == 3
            and k.dtype == q.dtype and v.dtype == q.dtype and k.is_cpu and v.is_cpu
            and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
            and cu_seqlens.is_cpu)


def concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                         slot_mapping: Tensor) -> None:
    # the kernel checks the slots too; this names slot_mapping in the error
    check_concat_and_cache_mla_values(kv_cache, slot_mapping, provider="cpp")
    call("concat_and_cache_mla", K.concat_and_cache_mla, kv_c, k_pe, kv_cache, slot_mapping)


def _concat_and_cache_mla_ok(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                            slot_mapping: Tensor) -> bool:
    return (kv_cache.is_cpu and kv_cache.dtype in FLOATS and kv_c.dim() == 2
            and k_pe.dim() == 2 and kv_c.stride(1) == 1 and k_pe.stride(1) == 1
            and slot_mapping.is_contiguous())


def mla_attention(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, block_tables: Tensor,
                  seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                  qk_nope_head_dim: int) -> Tensor:
    # the kernel checks the offsets and lengths, not the block ids
    check_mla_attention_values(q, kv_cache, block_tables, seq_lens, query_start_loc,
                               provider="cpp")
    tokens, heads, qk_dim = q.shape
    nope = qk_nope_head_dim
    lora = kv_cache.shape[2] - (qk_dim - nope)
    v_dim = kv_b_weight.shape[0] // heads - nope
    w = kv_b_weight.view(heads, nope + v_dim, lora).float()
    qh = q.transpose(0, 1).float()                                      # [H, T, nope + R]
    q_lat = torch.cat([torch.bmm(qh[..., :nope], w[:, :nope]), qh[..., nope:]], dim=-1)
    q_lat = q_lat.transpose(0, 1).contiguous()                          # [T, H, L + R]
    o_lat = torch.empty((tokens, heads, lora), dtype=torch.float32)
    call("mla_attention", K.mla_latent_attention_out, o_lat, q_lat, kv_cache,
          _int32(block_tables), _int32(seq_lens), _int32(query_start_loc), scale)
    out = torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2))  # [H, T, v]
    return out.transpose(0, 1).to(q.dtype).contiguous()


def _mla_attention_ok(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, block_tables: Tensor,
                      seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                      qk_nope_head_dim: int) -> bool:
    return (q.is_cpu and q.dtype in FLOATS and q.dim() == 3 and kv_cache.dim() == 3
            and kv_cache.dtype == q.dtype and kv_cache.is_contiguous()
            and kv_b_weight.dim() == 2 and kv_b_weight.is_contiguous())


encoder_attention_supports = with_static_check(encoder_attention, check_encoder_attention,
                                               "cpp", _encoder_attention_ok)
concat_and_cache_mla_supports = with_static_check(concat_and_cache_mla,
                                                  check_concat_and_cache_mla, "cpp",
                                                  _concat_and_cache_mla_ok)
mla_attention_supports = with_static_check(mla_attention, check_mla_attention, "cpp",
                                           _mla_attention_ok)


OPS: OpTable = op_table(
    (encoder_attention, encoder_attention_supports),
    (concat_and_cache_mla, concat_and_cache_mla_supports),
    (mla_attention, mla_attention_supports),
)
"""Op name -> (impl, supports_args) of the ops this module serves."""
