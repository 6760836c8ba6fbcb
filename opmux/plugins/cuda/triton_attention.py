"""Triton kernel for ``paged_attention``: decode and prefill in one ragged launch.

Grid: ``(T // BLOCK_Q + S, Hkv)``. Program ``(i, kvh)`` finds its sequence by binary search
over ``query_start_loc[s] // BLOCK_Q + s`` (the first query tile of sequence ``s``), so the
grid needs only host-known sizes (no device sync, CUDA-graph friendly); surplus programs
exit at once. A program owns ``BLOCK_Q`` query tokens of its sequence times all
``G = H / Hkv`` query heads that share kv head ``kvh`` (GQA): its ``BLOCK_M = BLOCK_Q * G_PAD``
rows share every K/V tile it loads. It walks the KV positions its rows can see (causal end,
sliding-window start) in tiles of ``BLOCK_N`` tokens gathered through the block table, with
an online softmax in fp32 (scores scaled, soft-capped, masked, then exponentiated). A
program whose accumulators come out inf or NaN (a damaged cache) walks its keys a second time
with the value products taken key by key, so a value a row does not see never reaches it.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from opmux.ops.checks import check_paged_attention
from opmux.plugins.cuda.triton_runtime import (
    DTYPES,
    interpreting,
    next_pow2,
    one_config_when_interpreting,
)
from opmux.plugins.cuda.validation import check

__all__ = ["paged_attention", "paged_attention_supports"]

_INDEX = (torch.int32, torch.int64)

_CONFIGS = one_config_when_interpreting(
    [
        triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_N": 32}, num_warps=2, num_stages=3),
    ]
)


_BF16_DOT_IN_FP32 = interpreting()
"""The interpreter (Triton 3.9) multiplies bf16 ``tl.dot`` operands as their raw uint16 bits
(triton-lang/triton#11584, "we just don't support it yet"), so under it bf16 tiles are upcast
and multiplied in fp32; on a GPU bf16 dots stay bf16."""


@triton.jit  # type: ignore[untyped-decorator]
def _attend(  # type: ignore[no-untyped-def]
    q, pos, kv_begin, kv_end, bt_row, k_head, v_head, scale, soft_cap, window, block_size,
    k_sb, k_so, k_sd, v_sb, v_so, v_sd, dims, d_ok,
    BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One program's rows over keys [kv_begin, kv_end) with an online softmax in fp32: the
    unnormalised accumulator and the softmax sum. EXACT takes the value products key by key,
    each only for the rows that see the key, instead of one tile product."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for start in range(kv_begin, kv_end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < kv_end
        blk = tl.load(bt_row + t // block_size, mask=t_ok, other=0).to(tl.int64)
        off = (t % block_size).to(tl.int64)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + blk[:, None] * k_sb + off[:, None] * k_so + dims[None, :] * k_sd,
                    mask=kv_mask, other=0.0)
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if USE_SOFTCAP:
            # tanh from exp(-2|x|): never overflows
            e = tl.exp(-2.0 * tl.abs(s / soft_cap))
            th = (1.0 - e) / (1.0 + e)
            s = soft_cap * tl.where(s < 0.0, -th, th)
        visible = t_ok[None, :] & (t[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (t[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if EXACT:
            acc = acc * alpha[:, None]
            cols = tl.arange(0, BLOCK_N)
            for j in range(BLOCK_N):
                t_j = start + j
                if t_j < kv_end:
                    blk_j = tl.load(bt_row + t_j // block_size).to(tl.int64)
                    v_j = tl.load(v_head + blk_j * v_sb + (t_j % block_size) * v_so
                                  + dims * v_sd, mask=d_ok, other=0.0).to(tl.float32)
                    p_j = tl.sum(tl.where(cols[None, :] == j, p, 0.0), axis=1)
                    sees = t_j <= pos
                    if USE_WINDOW:
                        sees = sees & (t_j > pos - window)
                    acc += tl.where(sees[:, None], p_j[:, None] * v_j[None, :], 0.0)
        else:
            v = tl.load(v_head + blk[:, None] * v_sb + off[:, None] * v_so
                        + dims[None, :] * v_sd, mask=kv_mask, other=0.0)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i


@triton.autotune(  # type: ignore[untyped-decorator]
    configs=_CONFIGS, key=["HEAD_D", "G_PAD", "BLOCK_Q", "USE_WINDOW"])
@triton.jit  # type: ignore[untyped-decorator]
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    scale, soft_cap, window, num_seqs, block_size,
    q_st, q_sh, q_sd, k_sb, k_so, k_sh, k_sd, v_sb, v_so, v_sh, v_sd, o_st, o_sh, o_sd, bt_s,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_D: tl.constexpr,
    D_PAD: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # sequence of this tile: the last s with query_start_loc[s] // BLOCK_Q + s <= pid
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < q_len:
        kv_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + rows // G_PAD
        g = rows % G_PAD
        row_ok = (tok < q_len) & (g < G)
        head = kvh * G + g
        dims = tl.arange(0, D_PAD)
        d_ok = dims < HEAD_D
        q_rows = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * q_st + head[:, None] * q_sh + dims[None, :] * q_sd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
        pos = kv_len - q_len + tok  # absolute position of each query row
        last_tok = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_end = kv_len - q_len + last_tok + 1
        kv_begin = 0
        if USE_WINDOW:
            first_pos = kv_len - q_len + q_tile * BLOCK_Q
            kv_begin = tl.maximum(first_pos - window + 1, 0)
            kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
        bt_row = bt_ptr + seq * bt_s
        k_head = k_ptr + kvh.to(tl.int64) * k_sh
        v_head = v_ptr + kvh.to(tl.int64) * v_sh
        # A value cell that is inf or NaN reaches, through the tile products, the rows that do
        # not see its key too (0 * inf is NaN), which native never lets happen. The products
        # are exact whenever every value read is finite, and then so is every accumulator; so
        # a program whose accumulators end non-finite walks its keys again with the products
        # taken key by key, each kept only for the rows that see the key (damaged caches only).
        acc, l_i = _attend(q, pos, kv_begin, kv_end, bt_row, k_head, v_head, scale, soft_cap,
                           window, block_size, k_sb, k_so, k_sd, v_sb, v_so, v_sd, dims, d_ok,
                           BLOCK_M, D_PAD, USE_WINDOW, USE_SOFTCAP, FP32_DOT, BLOCK_N, False)
        bad = ((acc != acc) | (tl.abs(acc) == float("inf"))) & row_ok[:, None] & d_ok[None, :]
        if tl.sum(tl.where(bad, 1, 0)) > 0:
            acc, l_i = _attend(q, pos, kv_begin, kv_end, bt_row, k_head, v_head, scale,
                               soft_cap, window, block_size, k_sb, k_so, k_sd, v_sb, v_so, v_sd,
                               dims, d_ok, BLOCK_M, D_PAD, USE_WINDOW, USE_SOFTCAP, FP32_DOT,
                               BLOCK_N, True)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(o_ptr + q_rows[:, None] * o_st + head[:, None] * o_sh + dims[None, :] * o_sd,
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _validate(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, scale: float, sliding_window: Optional[int],
              soft_cap: Optional[float]) -> None:
    # the catalog's checks; index values are read only where that costs no device sync
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, scale, sliding_window, soft_cap, provider="triton",
                          read_data=getattr(query, "is_cpu", False))
    check(query.dtype in DTYPES, "paged_attention", "query", "float32/float16/bfloat16",
          query.dtype)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: Optional[int] = None,
                    soft_cap: Optional[float] = None) -> torch.Tensor:
    """Ragged paged attention over a block-table KV cache (decode and prefill; Triton)."""
    _validate(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
              sliding_window, soft_cap)
    tokens, heads, d = query.shape
    hkv = key_cache.shape[2]
    num_seqs = block_tables.shape[0]
    # rows past query_start_loc[S] are padding and read as zeros, as in the native reference
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    if tokens == 0 or num_seqs == 0 or heads == 0 or d == 0:
        return out
    group = heads // hkv
    g_pad = next_pow2(group)
    # decode-heavy batches (about one query per sequence) take 16-row tiles, prefill 64
    rows = 16 if tokens <= 2 * num_seqs else 64
    block_q = max(1, rows // g_pad)
    bt = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    grid = (tokens // block_q + num_seqs, hkv)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, bt, seq_lens.contiguous(),
        query_start_loc.contiguous(), float(scale),
        float(soft_cap) if soft_cap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
        num_seqs, key_cache.shape[1],
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
        bt.stride(0),
        G=group, G_PAD=g_pad, BLOCK_Q=block_q, HEAD_D=d, D_PAD=max(next_pow2(d), 16),
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=soft_cap is not None,
        FP32_DOT=query.dtype == torch.float32 or (_BF16_DOT_IN_FP32
                                                  and query.dtype == torch.bfloat16),
    )
    return out


def paged_attention_supports(query: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                             sliding_window: Optional[int] = None,
                             soft_cap: Optional[float] = None) -> bool:
    """Float query with caches of the same dtype and the catalog's 3-D/4-D layouts (any
    strides: the kernel addresses query, caches and output through them)."""
    tensors = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    return (all(isinstance(t, torch.Tensor) for t in tensors) and query.dtype in DTYPES
            and key_cache.dtype == query.dtype
            and value_cache.dtype == query.dtype and query.dim() == 3 and key_cache.dim() == 4
            and key_cache.shape[3] == query.shape[2] and key_cache.shape[2] > 0
            and query.shape[1] % key_cache.shape[2] == 0
            and block_tables.dtype in _INDEX and seq_lens.dtype in _INDEX
            and query_start_loc.dtype in _INDEX)
