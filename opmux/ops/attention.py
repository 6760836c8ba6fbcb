"""Attention ops (native references).

- ``paged_attention``: causal attention of a ragged batch over a block-table KV cache.
- ``encoder_attention``: variable-length, non-causal attention over packed sequences with no
  cache, as vision encoders run it (vLLM's ``MMEncoderAttention``).
- ``concat_and_cache_mla``: writes the compressed latent ``kv_c`` and the rotary key part
  ``k_pe`` of each token into one paged latent cache row.
- ``mla_attention``: DeepSeek-style multi-head latent attention over that cache, prefill and
  decode in one ragged batch; decode rows use the absorbed up-projections.
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
import itertools
from typing import Optional

import torch
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks.attention import (
    check_concat_and_cache_mla,
    check_encoder_attention,
    check_mla_attention,
    check_paged_attention,
)
from opmux.ops.kv_formats import canonical_caches

__all__ = ["concat_and_cache_mla", "encoder_attention", "mla_attention", "paged_attention"]


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
                    soft_cap: Optional[float] = None,
                    kv_cache_format: str = "canonical") -> Tensor:
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
    :param kv_cache_format: the registered :class:`opmux.KVCacheFormat` the caches are in;
        the cache shapes above are those of its ``to_canonical`` form, which native reads.
    :returns: a new ``[T, H, D]`` tensor in query's dtype.
    :raises opmux.OpInputError: bad shapes or dtypes, ``kv_len < q_len``, a sequence longer
        than its block table, a block id out of range, or an unregistered ``kv_cache_format``.
    """
    if kv_cache_format != "canonical":
        key_cache, value_cache = canonical_caches("paged_attention", kv_cache_format,
                                                  key_cache, value_cache)
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


@paged_attention.register_meta
def _paged_attention_fake(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                          block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                          scale: float, sliding_window: Optional[int] = None,
                          soft_cap: Optional[float] = None,
                          kv_cache_format: str = "canonical") -> Tensor:
    key_cache, value_cache = canonical_caches("paged_attention", kv_cache_format, key_cache,
                                              value_cache)
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, scale, sliding_window, soft_cap, read_data=False)
    return query.new_empty(query.shape)


# -------------------------------------------------------------------------- encoder attention
@register_op
def encoder_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                      max_seqlen: Optional[int], scale: float) -> Tensor:
    """Non-causal attention within each packed sequence (no cache).

    Sequence ``i`` owns rows ``cu_seqlens[i]:cu_seqlens[i+1]`` of ``q``, ``k`` and ``v``;
    every query row sees every key row of its own sequence and none of the others. Scores are
    ``(q . k) * scale``, softmax in fp32; query head ``h`` reads kv head ``h // (H // Hkv)``
    (grouped-query attention, as vLLM's ``enable_gqa``). Rows at or past ``cu_seqlens[S]``
    are padding and come out as zeros.

    :param q: ``[T, H, D]`` float.
    :param k: ``[T, Hkv, D]``, q's dtype, ``H % Hkv == 0``.
    :param v: same shape and dtype as ``k``.
    :param cu_seqlens: ``[S + 1]`` int32/int64 offsets from 0, non-decreasing, ``<= T``.
    :param max_seqlen: an upper bound of the sequence lengths (a launch-size hint for
        kernels that need one), or ``None`` to have it derived from ``cu_seqlens``.
    :param scale: score multiplier, usually ``D ** -0.5``.
    :returns: a new ``[T, H, D]`` tensor in q's dtype.
    :raises opmux.OpInputError: bad shapes, dtypes, offsets, or ``max_seqlen`` below a length.

    >>> import torch, opmux
    >>> q = k = v = torch.randn(5, 2, 4)
    >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    >>> tuple(opmux.ops.encoder_attention(q, k, v, cu, None, 0.5).shape)
    (5, 2, 4)
    """
    check_encoder_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    offsets = cu_seqlens.tolist()
    for s0, s1 in itertools.pairwise(offsets):
        if s1 == s0:
            continue
        qh = q[s0:s1].float().transpose(0, 1)                              # [H, n, D]
        kh = k[s0:s1].float().transpose(0, 1).repeat_interleave(group, 0)  # [H, n, D]
        vh = v[s0:s1].float().transpose(0, 1).repeat_interleave(group, 0)
        probs = torch.softmax(torch.matmul(qh, kh.transpose(1, 2)) * scale, dim=-1)
        out[s0:s1] = torch.matmul(probs, vh).transpose(0, 1).to(q.dtype)
    return out


@encoder_attention.register_meta
def _encoder_attention_fake(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                            max_seqlen: Optional[int], scale: float) -> Tensor:
    check_encoder_attention(q, k, v, cu_seqlens, max_seqlen, scale, read_data=False)
    return q.new_empty(q.shape)


# -------------------------------------------------------------------------------- MLA cache
@register_op(mutates_args=("kv_cache",))
def concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                         slot_mapping: Tensor) -> None:
    """Write ``cat(kv_c[t], k_pe[t])`` into slot ``slot_mapping[t]`` of the latent cache.

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; slot ``-1`` is skipped
    (padding token). Nothing is written when validation fails.

    :param kv_c: ``[T, kv_lora_rank]``, the cache's dtype (the normed compressed latent).
    :param k_pe: ``[T, rope_dim]`` (the rotated positional key part, shared by all heads).
    :param kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, contiguous;
        written in place.
    :param slot_mapping: ``[T]`` int64, each ``-1`` or in ``[0, num_blocks*block_size)``.
    :raises opmux.OpInputError: bad shapes, dtypes, layout, or a slot out of range.
    """
    check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping)
    valid = slot_mapping >= 0
    rows = torch.cat([kv_c[valid], k_pe[valid]], dim=-1)
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping[valid], rows)


@concat_and_cache_mla.register_meta
def _concat_and_cache_mla_fake(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                               slot_mapping: Tensor) -> None:
    check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, read_data=False)


# ---------------------------------------------------------------------------- MLA attention
def _softmax_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal_offset: int
                       ) -> Tensor:
    """``q[H, m, Dk] . k[H, n, Dk]`` then softmax and ``@ v[H, n, Dv]``; row ``j`` sees keys
    ``t <= causal_offset + j`` (fp32)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    rows = torch.arange(q.shape[-2], device=q.device).unsqueeze(1) + causal_offset
    cols = torch.arange(k.shape[-2], device=q.device).unsqueeze(0)
    scores = scores.masked_fill(cols > rows, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


@register_op
def mla_attention(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, block_tables: Tensor,
                  seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                  qk_nope_head_dim: int) -> Tensor:
    """Causal multi-head latent attention of ragged query rows over a paged latent cache.

    Each cache row holds a token's ``kv_c`` (``kv_lora_rank`` = L dims) then its ``k_pe``
    (``rope_dim`` = R dims). ``kv_b_weight`` (vLLM's ``kv_b_proj.weight``) viewed as
    ``[H, nope + v_head_dim, L]`` up-projects a latent into a head's key part ``k_nope``
    (first ``nope`` rows, ``W_UK``) and value (``W_UV``); every head's key is
    ``cat(k_nope, k_pe)``. Sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]`` and ``kv_len = seq_lens[i]`` cached tokens
    at ``block_tables[i]``; query row ``j`` sits at position ``kv_len - q_len + j`` and sees
    the keys up to it (as ``paged_attention``). Scores are ``(q . k) * scale``, softmax in
    fp32. A prefill sequence (``q_len > 1``) up-projects its cached latents and runs
    multi-head attention; a decode sequence (``q_len == 1``) runs the absorbed form:
    ``q_nope @ W_UK`` against the latents, softmax, the weighted latent sum ``@ W_UV^T``
    (the same result, in latent space). Rows at or past ``query_start_loc[S]`` are padding
    and come out as zeros.

    :param q: ``[T, H, nope + R]`` (the rotary part already applied), the cache's dtype.
    :param kv_cache: ``[num_blocks, block_size, L + R]``.
    :param kv_b_weight: ``[H * (nope + v_head_dim), L]``, the cache's dtype.
    :param block_tables: ``[S, max_blocks]`` int32/int64.
    :param seq_lens: ``[S]`` int32/int64 (``kv_len`` per sequence).
    :param query_start_loc: ``[S + 1]`` offsets from 0, non-decreasing, ``<= T``.
    :param scale: score multiplier (vLLM passes ``qk_head_dim ** -0.5``, maybe rope-scaled).
    :param qk_nope_head_dim: ``nope``; the rotary dims are ``q.shape[2] - nope``.
    :returns: a new ``[T, H, v_head_dim]`` tensor in q's dtype.
    :raises opmux.OpInputError: bad shapes or dtypes, ``kv_len < q_len``, a sequence longer
        than its block table, or a block id out of range.
    """
    lora, _, v_dim = check_mla_attention(q, kv_cache, kv_b_weight, block_tables, seq_lens,
                                         query_start_loc, scale, qk_nope_head_dim)
    tokens, heads, _ = q.shape
    nope = qk_nope_head_dim
    w = kv_b_weight.float().view(heads, nope + v_dim, lora)
    w_uk, w_uv = w[:, :nope], w[:, nope:]                    # [H, nope, L], [H, v, L]
    out = q.new_zeros((tokens, heads, v_dim))
    block_size = kv_cache.shape[1]
    starts = query_start_loc.tolist()
    tables = block_tables.long()
    for i, kv_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[i], starts[i + 1]
        if q1 == q0:
            continue
        blocks = tables[i, : (kv_len + block_size - 1) // block_size]
        latent = kv_cache.index_select(0, blocks).reshape(-1, kv_cache.shape[-1])[:kv_len]
        kv_c, k_pe = latent.float().split([lora, latent.shape[-1] - lora], dim=-1)
        qh = q[q0:q1].float().transpose(0, 1)                 # [H, m, nope + R]
        q_nope, q_pe = qh[..., :nope], qh[..., nope:]
        if q1 - q0 == 1:   # decode: absorbed up-projections, attention in latent space
            q_lat = torch.cat([torch.matmul(q_nope, w_uk), q_pe], dim=-1)[:, 0]  # [H, L + R]
            probs = torch.softmax(torch.matmul(q_lat, latent.float().T) * scale, dim=-1)
            o_lat = torch.matmul(probs, kv_c)                    # [H, L]: all keys visible
            o = torch.matmul(o_lat.unsqueeze(1), w_uv.transpose(1, 2))     # [H, 1, v]
        else:              # prefill: materialised keys and values, multi-head attention
            k_nope = torch.einsum("hnl,tl->htn", w_uk, kv_c)   # [H, kv_len, nope]
            vals = torch.einsum("hvl,tl->htv", w_uv, kv_c)      # [H, kv_len, v]
            keys = torch.cat([k_nope, k_pe.expand(heads, -1, -1)], dim=-1)
            o = _softmax_attention(qh, keys, vals, scale, kv_len - (q1 - q0))
        out[q0:q1] = o.transpose(0, 1).to(q.dtype)
    return out


@mla_attention.register_meta
def _mla_attention_fake(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, block_tables: Tensor,
                        seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                        qk_nope_head_dim: int) -> Tensor:
    _, _, v_dim = check_mla_attention(q, kv_cache, kv_b_weight, block_tables, seq_lens,
                                      query_start_loc, scale, qk_nope_head_dim,
                                      read_data=False)
    return q.new_empty((q.shape[0], q.shape[1], v_dim))
