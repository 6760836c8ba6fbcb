"""Paged attention over a block-table KV cache (native reference)."""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
from typing import Optional

import torch
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops._checks import check_paged_attention

__all__ = ["paged_attention"]


def _sequence_attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
                        sliding_window: Optional[int], soft_cap: Optional[float]) -> Tensor:
    """Attention of ``q[q_len, Hkv, G, D]`` over ``k, v[kv_len, Hkv, D]`` (fp32), causal."""
    q_len, kv_len = q.shape[0], k.shape[0]
    qh = q.permute(1, 2, 0, 3)                     # [Hkv, G, q_len, D]
    kh = k.permute(1, 2, 0).unsqueeze(1)           # [Hkv, 1, D, kv_len]
    vh = v.permute(1, 0, 2).unsqueeze(1)           # [Hkv, 1, kv_len, D]
    scores = torch.matmul(qh, kh) * scale          # [Hkv, G, q_len, kv_len]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    pos = torch.arange(kv_len - q_len, kv_len, device=q.device).unsqueeze(1)
    t = torch.arange(kv_len, device=q.device).unsqueeze(0)
    visible = t <= pos
    if sliding_window is not None:
        visible &= t > pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vh)                  # [Hkv, G, q_len, D]
    if not bool(torch.isfinite(vh).all()):
        # a key a row does not see must not reach it: 0 * inf in the product above would
        # (rare, damaged caches only: each row again over the keys it sees)
        for j in range(q_len):
            seen = visible[j].nonzero().squeeze(1)
            out[:, :, j] = torch.matmul(probs[:, :, j, seen].unsqueeze(2),
                                        vh[:, :, seen]).squeeze(2)
    return out.permute(2, 0, 1, 3)                 # [q_len, Hkv, G, D]


@register_op
def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                    sliding_window: Optional[int] = None,
                    soft_cap: Optional[float] = None) -> Tensor:
    """Causal attention of ragged query rows over a paged KV cache.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` (``q_len``,
    possibly 0) and ``kv_len = seq_lens[i]`` cached tokens in the blocks
    ``block_tables[i, :ceil(kv_len / block_size)]``. Query row ``j`` sits at position
    ``p = kv_len - q_len + j`` and sees key ``t`` iff ``t <= p`` and, with a window,
    ``t > p - sliding_window``. Scores are ``(q . k) * scale``, soft-capped as
    ``soft_cap * tanh(s / soft_cap)`` when given, then a masked softmax in fp32 (a key a row
    does not see never reaches it, not even through an inf or NaN value). Query head
    ``h`` reads kv head ``h // (H // Hkv)``. Rows at or past ``query_start_loc[S]`` are
    padding and come out as zeros.

    :param query: ``[T, H, D]``.
    :param key_cache: ``[num_blocks, block_size, Hkv, D]``, query's dtype.
    :param value_cache: same shape as ``key_cache``.
    :param block_tables: ``[S, max_blocks]`` int32.
    :param seq_lens: ``[S]`` int32 (``kv_len`` per sequence).
    :param query_start_loc: ``[S + 1]`` int32 offsets, from 0, non-decreasing, ``<= T``.
    :param scale: score multiplier, usually ``D ** -0.5``.
    :param sliding_window: keep only the last ``sliding_window`` positions, or ``None``.
    :param soft_cap: tanh soft cap of the scores, or ``None``.
    :returns: a new ``[T, H, D]`` tensor in query's dtype.
    :raises opmux.OpInputError: bad shapes or dtypes, ``kv_len < q_len``, a sequence longer
        than its block table, or a block id out of range.
    """
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, scale, sliding_window, soft_cap)
    _, heads, head_size = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.long()
    for i, kv_len in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        if q1 == q0:
            continue
        blocks = tables[i, : (kv_len + block_size - 1) // block_size]
        k = key_cache.index_select(0, blocks).reshape(-1, kv_heads, head_size)[:kv_len]
        v = value_cache.index_select(0, blocks).reshape(-1, kv_heads, head_size)[:kv_len]
        q = query[q0:q1].float().reshape(q1 - q0, kv_heads, group, head_size)
        o = _sequence_attention(q, k.float(), v.float(), scale, sliding_window, soft_cap)
        out[q0:q1] = o.reshape(q1 - q0, heads, head_size).to(query.dtype)
    return out


@paged_attention.register_fake
def _paged_attention_fake(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                          block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                          scale: float, sliding_window: Optional[int] = None,
                          soft_cap: Optional[float] = None) -> Tensor:
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, scale, sliding_window, soft_cap, read_data=False)
    return query.new_empty(query.shape)
