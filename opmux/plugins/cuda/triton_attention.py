"""Triton kernels of the attention ops.

``paged_attention``: decode and prefill in one ragged launch. Grid: ``(T // BLOCK_Q + S, Hkv)``.
Program ``(i, kvh)`` finds its sequence by binary search over ``query_start_loc[s] // BLOCK_Q +
s`` (the first query tile of sequence ``s``), so the grid needs only host-known sizes (no device
sync, CUDA-graph friendly); surplus programs exit at once. A program owns ``BLOCK_Q`` query
tokens of its sequence times all ``G = H / Hkv`` query heads that share kv head ``kvh`` (GQA):
its ``BLOCK_M = BLOCK_Q * G_PAD`` rows share every K/V tile it loads. It walks the KV positions
its rows can see (causal end, sliding-window start) in tiles of ``BLOCK_N`` tokens gathered
through the block table, with an online softmax in fp32 (scores scaled, soft-capped, masked,
then exponentiated). A program whose accumulators come out inf or NaN (a damaged cache) walks
its keys a second time with the value products taken key by key, so a value a row does not see
never reaches it.


- ``encoder_attention``: grid ``(ceil(max_seqlen / BLOCK_M), S, H)``; a program owns
  ``BLOCK_M`` query rows of one sequence and head and walks that sequence's keys in tiles of
  ``BLOCK_N`` with an online softmax in fp32 (non-causal). Without ``max_seqlen`` the grid
  size is read from ``cu_seqlens`` (one device sync).
- ``mla_attention``: the absorbed form for every row. ``q_nope @ W_UK`` and the final
  ``@ W_UV^T`` are batched GEMMs (``torch.bmm`` in fp32); the kernel between them has grid
  ``(T, H)``: a program finds its sequence by binary search over ``query_start_loc``, then
  walks the visible latent rows through the block table in tiles of ``BLOCK_N`` (scores from
  the latent and rope parts, online softmax, the weighted latent sum).
- ``concat_and_cache_mla``: one program per token writes ``cat(kv_c, k_pe)`` into its slot.

Checked once: each ``supports_args`` runs native's static check (metadata only) before its own
conditions, so a call it declines runs native, whose check gives the error. The kernels do not
check indices; the impls check their values (native's value checks) only for CPU tensors (the
interpreter): on a GPU that would cost a device sync per call.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from opmux.ops.checks import (
    check_concat_and_cache_mla,
    check_concat_and_cache_mla_values,
    check_encoder_attention,
    check_encoder_attention_values,
    check_mla_attention,
    check_mla_attention_values,
    check_paged_attention,
    check_paged_attention_values,
    static_check_passes,
)
from opmux.plugins.cuda.triton_runtime import (
    DTYPES,
    interpreting,
    next_pow2,
    one_config_when_interpreting,
)

__all__ = [
    "concat_and_cache_mla", "concat_and_cache_mla_supports", "encoder_attention",
    "encoder_attention_supports", "mla_attention", "mla_attention_supports", "paged_attention",
    "paged_attention_supports",
]

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


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: Optional[int] = None,
                    soft_cap: Optional[float] = None,
                    kv_cache_format: str = "canonical") -> torch.Tensor:
    """Ragged paged attention over a block-table KV cache (decode and prefill; Triton)."""
    if query.is_cpu:  # index values: the kernel does not check them
        check_paged_attention_values(query, key_cache, block_tables, seq_lens, query_start_loc,
                                     provider="triton")
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
                             soft_cap: Optional[float] = None,
                             kv_cache_format: str = "canonical") -> bool:
    """The canonical format, native's static check, a float query (any strides: the kernel
    addresses query, caches and output through them)."""
    return (kv_cache_format == "canonical"
            and static_check_passes(check_paged_attention, query, key_cache, value_cache,
                                    block_tables, seq_lens, query_start_loc, scale,
                                    sliding_window, soft_cap, provider="triton")
            and query.dtype in DTYPES)


_FP32_DOT_BF16 = interpreting()


"""Under the interpreter bf16 ``tl.dot`` operands are upcast (see ``triton_attention``)."""


@triton.jit  # type: ignore[untyped-decorator]
def _encoder_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, scale,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, o_st, o_sh,
    G: tl.constexpr, HEAD_D: tl.constexpr, D_PAD: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - start
    if tile * BLOCK_M < n:
        kvh = head // G
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n
        dims = tl.arange(0, D_PAD)
        d_ok = dims < HEAD_D
        tok = (start + rows).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * q_st + head * q_sh + dims[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        for n0 in range(0, n, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            c_ok = cols < n
            ktok = (start + cols).to(tl.int64)
            kv_mask = c_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + ktok[:, None] * k_st + kvh * k_sh + dims[None, :], mask=kv_mask,
                        other=0.0)
            v = tl.load(v_ptr + ktok[:, None] * v_st + kvh * v_sh + dims[None, :], mask=kv_mask,
                        other=0.0)
            if FP32_DOT:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(c_ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + tok[:, None] * o_st + head * o_sh + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor, max_seqlen: Optional[int],
                      scale: float) -> torch.Tensor:
    """Packed non-causal attention (Triton)."""
    if q.is_cpu:  # offset values: the kernel does not check them
        check_encoder_attention_values(q, cu_seqlens, max_seqlen, provider="triton")
    tokens, heads, d = q.shape
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if max_seqlen is None:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        max_seqlen = int(lens.max()) if num_seqs > 0 else 0
    if tokens == 0 or num_seqs == 0 or heads == 0 or d == 0 or max_seqlen == 0:
        return out
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    block_m = 16
    grid = (triton.cdiv(max_seqlen, block_m), num_seqs, heads)
    _encoder_kernel[grid](
        q, k, v, out, cu_seqlens.contiguous(), float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        G=heads // k.shape[1], HEAD_D=d, D_PAD=max(next_pow2(d), 16),
        FP32_DOT=q.dtype == torch.float32 or (_FP32_DOT_BF16 and q.dtype == torch.bfloat16),
        BLOCK_M=block_m, BLOCK_N=32,
    )
    return out


def encoder_attention_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens: torch.Tensor, max_seqlen: Optional[int],
                               scale: float) -> bool:
    """Native's static check; float q/k/v of one dtype."""
    return (static_check_passes(check_encoder_attention, q, k, v, cu_seqlens, max_seqlen, scale,
                                provider="triton")
            and q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype)


# ------------------------------------------------------------------------------- MLA cache
@triton.jit  # type: ignore[untyped-decorator]
def _concat_kernel(  # type: ignore[no-untyped-def]
    c_ptr, pe_ptr, cache_ptr, slot_ptr, c_st, pe_st,
    LORA: tl.constexpr, ROPE: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        row = cache_ptr + slot.to(tl.int64) * (LORA + ROPE)
        cl = tl.arange(0, L_PAD)
        cr = tl.arange(0, R_PAD)
        c = tl.load(c_ptr + t.to(tl.int64) * c_st + cl, mask=cl < LORA)
        tl.store(row + cl, c, mask=cl < LORA)
        pe = tl.load(pe_ptr + t.to(tl.int64) * pe_st + cr, mask=cr < ROPE)
        tl.store(row + LORA + cr, pe, mask=cr < ROPE)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Write latent rows into the paged latent cache (Triton)."""
    if kv_cache.is_cpu:  # slot values: the kernel does not check them
        check_concat_and_cache_mla_values(kv_cache, slot_mapping, provider="triton")
    tokens, lora = kv_c.shape
    rope = k_pe.shape[1]
    if tokens == 0:
        return
    kv_c = kv_c if kv_c.stride(1) == 1 else kv_c.contiguous()
    k_pe = k_pe if k_pe.stride(1) == 1 else k_pe.contiguous()
    _concat_kernel[(tokens,)](kv_c, k_pe, kv_cache, slot_mapping.contiguous(), kv_c.stride(0),
                              k_pe.stride(0), LORA=lora, ROPE=rope, L_PAD=next_pow2(lora),
                              R_PAD=next_pow2(rope))


def concat_and_cache_mla_supports(kv_c: torch.Tensor, k_pe: torch.Tensor,
                                  kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Native's static check; float tensors of one dtype."""
    return (static_check_passes(check_concat_and_cache_mla, kv_c, k_pe, kv_cache, slot_mapping,
                                provider="triton")
            and kv_cache.dtype in DTYPES and kv_c.dtype == kv_cache.dtype
            and k_pe.dtype == kv_cache.dtype)


# --------------------------------------------------------------------------- MLA attention
@triton.jit  # type: ignore[untyped-decorator]
def _mla_latent_kernel(  # type: ignore[no-untyped-def]
    q_ptr, cache_ptr, o_ptr, bt_ptr, lens_ptr, qsl_ptr, scale, num_seqs, block_size, bt_s,
    HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, L_PAD: tl.constexpr,
    R_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    lo = 0
    hi = num_seqs
    while lo < hi:   # the sequence of row r: first s with query_start_loc[s + 1] > r
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid + 1) <= r:
            lo = mid + 1
        else:
            hi = mid
    if lo < num_seqs:
        seq = lo
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        kv_len = tl.load(lens_ptr + seq)
        visible = kv_len - q_len + (r - q_start) + 1
        width = LORA + ROPE
        cl = tl.arange(0, L_PAD)
        cr = tl.arange(0, R_PAD)
        l_ok = cl < LORA
        r_ok = cr < ROPE
        q_row = q_ptr + (r.to(tl.int64) * HEADS + h) * width
        q_c = tl.load(q_row + cl, mask=l_ok, other=0.0)
        q_r = tl.load(q_row + LORA + cr, mask=r_ok, other=0.0)
        m_i = float("-inf")
        l_i = 0.0
        acc = tl.zeros([L_PAD], dtype=tl.float32)
        for t0 in range(0, visible, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_ok = t < visible
            blk = tl.load(bt_ptr + seq * bt_s + t // block_size, mask=t_ok, other=0)
            rows = (blk.to(tl.int64) * block_size + t % block_size) * width
            c = tl.load(cache_ptr + rows[:, None] + cl[None, :],
                        mask=t_ok[:, None] & l_ok[None, :], other=0.0).to(tl.float32)
            pe = tl.load(cache_ptr + rows[:, None] + LORA + cr[None, :],
                         mask=t_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
            s = (tl.sum(c * q_c[None, :], axis=1) + tl.sum(pe * q_r[None, :], axis=1)) * scale
            s = tl.where(t_ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * c, axis=0)
            m_i = m_new
        tl.store(o_ptr + (r.to(tl.int64) * HEADS + h) * LORA + cl, acc / l_i, mask=l_ok)


def mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_b_weight: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, scale: float,
                  qk_nope_head_dim: int) -> torch.Tensor:
    """Multi-head latent attention over the paged latent cache, absorbed form (Triton)."""
    if q.is_cpu:  # index values: the kernel does not check them
        check_mla_attention_values(q, kv_cache, block_tables, seq_lens, query_start_loc,
                                   provider="triton")
    tokens, heads, qk_dim = q.shape
    nope = qk_nope_head_dim
    rope = qk_dim - nope
    lora = kv_cache.shape[2] - rope
    v_dim = kv_b_weight.shape[0] // heads - nope
    num_seqs = block_tables.shape[0]
    w = kv_b_weight.reshape(heads, nope + v_dim, lora).float()
    qh = q.transpose(0, 1).float()
    q_lat = torch.cat([torch.bmm(qh[..., :nope], w[:, :nope]), qh[..., nope:]], dim=-1)
    q_lat = q_lat.transpose(0, 1).contiguous()                  # [T, H, L + R] fp32
    o_lat = torch.zeros((tokens, heads, lora), dtype=torch.float32, device=q.device)
    if tokens > 0 and num_seqs > 0 and heads > 0:
        bt = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
        _mla_latent_kernel[(tokens, heads)](
            q_lat, kv_cache.contiguous(), o_lat, bt, seq_lens.contiguous(),
            query_start_loc.contiguous(), float(scale), num_seqs, kv_cache.shape[1],
            bt.stride(0), HEADS=heads, LORA=lora, ROPE=rope, L_PAD=next_pow2(lora),
            R_PAD=next_pow2(rope), BLOCK_N=16,
        )
    out = torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2))   # [H, T, v]
    return out.transpose(0, 1).to(q.dtype).contiguous()


def mla_attention_supports(q: torch.Tensor, kv_cache: torch.Tensor, kv_b_weight: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float,
                           qk_nope_head_dim: int) -> bool:
    """Native's static check; float tensors of one dtype."""
    return (static_check_passes(check_mla_attention, q, kv_cache, kv_b_weight, block_tables,
                                seq_lens, query_start_loc, scale, qk_nope_head_dim,
                                provider="triton")
            and q.dtype in DTYPES and kv_cache.dtype == q.dtype
            and kv_b_weight.dtype == q.dtype)
