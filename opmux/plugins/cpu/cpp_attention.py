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

The index values are validated with the catalog's checks (``provider="cpp"``) before any
kernel runs, so a bad call writes nothing and raises the standard error.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
from typing import Optional

import torch
from torch import Tensor

from opmux.ops.checks import (
    check_concat_and_cache_mla,
    check_encoder_attention,
    check_mla_attention,
)
from opmux.plugins.cpu._kernels import FLOATS, K, call
from opmux.plugins.registration import OpTable, op_table

__all__ = ["OPS", "concat_and_cache_mla", "encoder_attention", "mla_attention"]



def _int32(t: Tensor) -> Tensor:
    """Index tensors as the kernels read them (int32, contiguous; a no-op when they are)."""
    return t.to(torch.int32).contiguous()


def encoder_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                      max_seqlen: Optional[int], scale: float) -> Tensor:
    check_encoder_attention(q, k, v, cu_seqlens, max_seqlen, scale, provider="cpp")
    out = torch.empty(q.shape, dtype=q.dtype)
    call("encoder_attention", K.encoder_attention_out, out, q, k, v, _int32(cu_seqlens),
          scale)
    return out


def encoder_attention_supports(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                               max_seqlen: Optional[int], scale: float) -> bool:
    return (q.is_cpu and q.dtype in FLOATS and q.dim() == 3 and k.dim() == 3 and v.dim() == 3
            and k.dtype == q.dtype and v.dtype == q.dtype and k.is_cpu and v.is_cpu
            and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
            and cu_seqlens.is_cpu)


def concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                         slot_mapping: Tensor) -> None:
    check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, provider="cpp")
    call("concat_and_cache_mla", K.concat_and_cache_mla, kv_c, k_pe, kv_cache, slot_mapping)


def concat_and_cache_mla_supports(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                                  slot_mapping: Tensor) -> bool:
    return (kv_cache.is_cpu and kv_cache.dtype in FLOATS and kv_c.dim() == 2
            and k_pe.dim() == 2 and kv_c.stride(1) == 1 and k_pe.stride(1) == 1
            and slot_mapping.is_contiguous())


def mla_attention(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, block_tables: Tensor,
                  seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                  qk_nope_head_dim: int) -> Tensor:
    lora, _, v_dim = check_mla_attention(q, kv_cache, kv_b_weight, block_tables, seq_lens,
                                         query_start_loc, scale, qk_nope_head_dim,
                                         provider="cpp")
    tokens, heads, _ = q.shape
    nope = qk_nope_head_dim
    w = kv_b_weight.view(heads, nope + v_dim, lora).float()
    qh = q.transpose(0, 1).float()                                      # [H, T, nope + R]
    q_lat = torch.cat([torch.bmm(qh[..., :nope], w[:, :nope]), qh[..., nope:]], dim=-1)
    q_lat = q_lat.transpose(0, 1).contiguous()                          # [T, H, L + R]
    o_lat = torch.empty((tokens, heads, lora), dtype=torch.float32)
    call("mla_attention", K.mla_latent_attention_out, o_lat, q_lat, kv_cache,
          _int32(block_tables), _int32(seq_lens), _int32(query_start_loc), scale)
    out = torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2))  # [H, T, v]
    return out.transpose(0, 1).to(q.dtype).contiguous()


def mla_attention_supports(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, block_tables: Tensor,
                           seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                           qk_nope_head_dim: int) -> bool:
    return (q.is_cpu and q.dtype in FLOATS and q.dim() == 3 and kv_cache.dim() == 3
            and kv_cache.dtype == q.dtype and kv_cache.is_contiguous()
            and kv_b_weight.dim() == 2 and kv_b_weight.is_contiguous())


OPS: OpTable = op_table(
    (encoder_attention, encoder_attention_supports),
    (concat_and_cache_mla, concat_and_cache_mla_supports),
    (mla_attention, mla_attention_supports),
)
"""Op name -> (impl, supports_args) of the ops this module serves."""
