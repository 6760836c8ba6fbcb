"""Triton kernels of the rotary ops (functional: they write new tensors).

``rotary_embedding``: one launch covers query and key: program ``(t, j)`` handles token ``t``
and a block of ``BLOCK_H`` heads, of the query when ``j < query head blocks`` else of the key.
Each output column ``i < rot`` is ``x[i] * cos[c] + sign * x[partner] * sin[c]``:

- neox: ``c = i mod rot/2``, partner ``i +- rot/2``, sign ``-`` on the first half;
- gptj: ``c = i // 2``, partner ``i ^ 1``, sign ``-`` on even columns.

Columns ``rot..D`` are copied unchanged, so every output element is written exactly once.

``apply_rotary_emb`` and ``dual_chunk_rotary_embedding`` also write every output element exactly
once, from inputs read through their strides (arbitrary strides are honoured, no copies), with
the same column rule. ``apply_rotary_emb``: program ``(row, j)`` handles one (batch, position)
row and a block of heads; without ``enable_fp32_compute`` the tables are rounded to ``x``'s
dtype first, as the native reference does. ``dual_chunk_rotary_embedding``: program ``(t, v,
j)`` handles token ``t``, query version ``v`` and a block of heads; a second launch rotates the
key.

Checked once: each ``supports_args`` runs native's static check (metadata only) before its own
conditions, so a call it declines runs native, whose check gives the error. The kernels do not
check positions; the impls check their range (native's value checks) only for CPU tensors (the
interpreter): on a GPU that would cost a sync per call.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from opmux.ops.checks import (
    check_apply_rotary_emb,
    check_dual_chunk_rotary_embedding,
    check_dual_chunk_rotary_embedding_values,
    check_rotary_embedding,
    check_rotary_embedding_values,
    static_check_passes,
)
from opmux.plugins.cuda.triton_runtime import DTYPES, PROVIDER, next_pow2

__all__ = [
    "apply_rotary_emb", "apply_rotary_emb_supports", "dual_chunk_rotary_embedding",
    "dual_chunk_rotary_embedding_supports", "rotary_embedding", "rotary_embedding_supports",
]


# Column i of a rotated head reads cos/sin entry c and partner column partner with sign sign
# (the layouts of the module docstring); shared by every rotary kernel here.
@triton.jit  # type: ignore[untyped-decorator]
def _columns(rot, IS_NEOX: tl.constexpr, D_PAD: tl.constexpr):  # type: ignore[no-untyped-def]
    cols = tl.arange(0, D_PAD)
    half = rot // 2
    if IS_NEOX:
        c = tl.where(cols < half, cols, cols - half)
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    else:
        c = cols // 2
        partner = cols ^ 1
        sign = tl.where((cols % 2) == 0, -1.0, 1.0)
    return cols, c, partner, sign


@triton.jit  # type: ignore[untyped-decorator]
def _rope_heads(  # type: ignore[no-untyped-def]
    src_ptr, dst_ptr, src_stride, dst_stride, cos_row, sin_row, tok, head0, n_heads, head_size,
    rot, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr,
):
    heads = head0 + tl.arange(0, BLOCK_H)
    cols, c, partner, sign = _columns(rot, IS_NEOX, D_PAD)
    in_rot = cols < rot
    hmask = heads < n_heads
    mask = hmask[:, None] & (cols < head_size)[None, :]
    base = src_ptr + tok * src_stride + heads[:, None] * head_size
    x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rmask = hmask[:, None] & in_rot[None, :]
    xp = tl.load(base + partner[None, :], mask=rmask, other=0.0).to(tl.float32)
    cos = tl.load(cos_row + c, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_row + c, mask=in_rot, other=0.0).to(tl.float32)
    rotated = x * cos[None, :] + sign[None, :] * xp * sin[None, :]
    y = tl.where(in_rot[None, :], rotated, x)
    out = dst_ptr + tok * dst_stride + heads[:, None] * head_size + cols[None, :]
    tl.store(out, y.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _rope_kernel(  # type: ignore[no-untyped-def]
    pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cache_ptr,
    q_stride, k_stride, q_out_stride, k_out_stride, cache_stride,
    num_heads, num_kv_heads, head_size, rot, q_blocks,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + tok)
    cos_row = cache_ptr + pos * cache_stride
    sin_row = cos_row + rot // 2
    if j < q_blocks:
        _rope_heads(q_ptr, q_out_ptr, q_stride, q_out_stride, cos_row, sin_row, tok,
                    j * BLOCK_H, num_heads, head_size, rot, IS_NEOX, BLOCK_H, D_PAD)
    else:
        _rope_heads(k_ptr, k_out_ptr, k_stride, k_out_stride, cos_row, sin_row, tok,
                    (j - q_blocks) * BLOCK_H, num_kv_heads, head_size, rot, IS_NEOX,
                    BLOCK_H, D_PAD)


def _as_rows(t: torch.Tensor, tokens: int) -> torch.Tensor:
    t2 = t.reshape(tokens, t.numel() // tokens)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int, is_neox: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on the first ``rot`` dims of every head; new (query, key) (Triton).

    Takes every layout native takes: positions of any shape, queries ``[*P, H*D]`` or
    ``[*P, H, D]``; positions are read contiguously (a strided or stride-0 view is copied),
    query/key rows through their token stride.
    """
    if not query.is_cuda:  # position values: the kernel does not check them
        check_rotary_embedding_values(positions, cos_sin_cache, provider=PROVIDER)
    flat = positions.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    tokens = flat.shape[0]
    q_width = query.numel() // max(tokens, 1)
    k_width = key.numel() // max(tokens, 1)
    rot = cos_sin_cache.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if tokens == 0 or (q_width == 0 and k_width == 0):
        return q_out, k_out
    num_heads, num_kv_heads = q_width // head_size, k_width // head_size
    q2, k2 = _as_rows(query, tokens), _as_rows(key, tokens)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    d_pad = next_pow2(head_size)
    block_h = max(1, min(next_pow2(max(num_heads, num_kv_heads)), 4096 // d_pad))
    q_blocks = triton.cdiv(num_heads, block_h)
    k_blocks = triton.cdiv(num_kv_heads, block_h)
    _rope_kernel[(tokens, q_blocks + k_blocks)](
        flat, q2, k2, q_out.view(tokens, q_width), k_out.view(tokens, k_width), cache,
        q2.stride(0), k2.stride(0), q_width, k_width, cache.stride(0),
        num_heads, num_kv_heads, head_size, rot, q_blocks,
        IS_NEOX=bool(is_neox), BLOCK_H=block_h, D_PAD=d_pad,
        num_warps=4 if block_h * d_pad >= 1024 else 1,
    )
    return q_out, k_out


def rotary_embedding_supports(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                              cos_sin_cache: torch.Tensor, head_size: int,
                              is_neox: bool = True) -> bool:
    """Native's static check; float query/key of one dtype, integer positions, an even
    ``rot <= head_size``."""
    return (static_check_passes(check_rotary_embedding, positions, query, key, cos_sin_cache,
                                head_size, is_neox, provider=PROVIDER)
            and query.dtype in DTYPES and key.dtype == query.dtype
            and cos_sin_cache.dtype in DTYPES and cos_sin_cache.dim() == 2
            and positions.dtype in (torch.int64, torch.int32)
            and 0 < cos_sin_cache.shape[1] <= head_size and cos_sin_cache.shape[1] % 2 == 0)


@triton.jit  # type: ignore[untyped-decorator]
def _apply_kernel(  # type: ignore[no-untyped-def]
    x_ptr, cos_ptr, sin_ptr, out_ptr, seq_len, num_heads, head_size,
    sxb, sxs, sxh, sxd, scs, scd, sss, ssd,
    IS_NEOX: tl.constexpr, FP32_TABLES: tl.constexpr, BLOCK_H: tl.constexpr,
    D_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // seq_len
    s = row % seq_len
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols, c, partner, sign = _columns(head_size, IS_NEOX, D_PAD)
    cmask = cols < head_size
    mask = (heads < num_heads)[:, None] & cmask[None, :]
    base = x_ptr + b * sxb + s * sxs + heads[:, None].to(tl.int64) * sxh
    x = tl.load(base + cols[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + s * scs + c * scd, mask=cmask, other=0.0)
    sin = tl.load(sin_ptr + s * sss + c * ssd, mask=cmask, other=0.0)
    if not FP32_TABLES:  # native casts the tables to x's dtype before the math
        cos = cos.to(out_ptr.dtype.element_ty)
        sin = sin.to(out_ptr.dtype.element_ty)
    y = x * cos.to(tl.float32)[None, :] + sign[None, :] * xp * sin.to(tl.float32)[None, :]
    out = out_ptr + (row * num_heads + heads[:, None]) * head_size + cols[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     is_neox_style: bool = True, enable_fp32_compute: bool = False
                     ) -> torch.Tensor:
    """Rotate every head of ``x[(B,) S, H, D]`` by ``cos``/``sin`` ``[S, D/2]`` (Triton)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x4 = x if x.dim() == 4 else x.unsqueeze(0)
    batch, seq_len, num_heads, head_size = x4.shape
    if out.numel() == 0:
        return out
    d_pad = next_pow2(head_size)
    block_h = max(1, min(next_pow2(num_heads), 4096 // d_pad))
    _apply_kernel[(batch * seq_len, triton.cdiv(num_heads, block_h))](
        x4, cos, sin, out, seq_len, num_heads, head_size, *x4.stride(), *cos.stride(),
        *sin.stride(), IS_NEOX=bool(is_neox_style), FP32_TABLES=bool(enable_fp32_compute),
        BLOCK_H=block_h, D_PAD=d_pad, num_warps=4 if block_h * d_pad >= 1024 else 1,
    )
    return out


def apply_rotary_emb_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              is_neox_style: bool = True,
                              enable_fp32_compute: bool = False) -> bool:
    """Native's static check; ``x`` 3-d or 4-d in float32/float16/bfloat16 (any strides),
    floating tables."""
    return (static_check_passes(check_apply_rotary_emb, x, cos, sin, is_neox_style,
                                enable_fp32_compute, provider=PROVIDER)
            and x.dtype in DTYPES and x.dim() in (3, 4) and cos.dtype in DTYPES
            and sin.dtype in DTYPES and cos.dim() == 2 and sin.dim() == 2)


@triton.jit  # type: ignore[untyped-decorator]
def _rope_block(  # type: ignore[no-untyped-def]
    src, s1, dst, row, heads, n_heads, head_size, rot, IS_NEOX: tl.constexpr,
    D_PAD: tl.constexpr,
):
    cols, ci, partner, sign = _columns(rot, IS_NEOX, D_PAD)
    in_rot = cols < rot
    hmask = heads < n_heads
    mask = hmask[:, None] & (cols < head_size)[None, :]
    hoff = heads[:, None].to(tl.int64) * head_size
    x = tl.load(src + (hoff + cols[None, :]) * s1, mask=mask, other=0.0).to(tl.float32)
    rmask = hmask[:, None] & in_rot[None, :]
    xp = tl.load(src + (hoff + partner[None, :]) * s1, mask=rmask, other=0.0).to(tl.float32)
    cos = tl.load(row + ci, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(row + rot // 2 + ci, mask=in_rot, other=0.0).to(tl.float32)
    y = tl.where(in_rot[None, :], x * cos[None, :] + sign[None, :] * xp * sin[None, :], x)
    tl.store(dst + hoff + cols[None, :], y.to(dst.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _position(pos_ptr, off_ptr, tok, HAS_OFFSETS: tl.constexpr):  # type: ignore[no-untyped-def]
    p = tl.load(pos_ptr + tok).to(tl.int64)
    if HAS_OFFSETS:
        p += tl.load(off_ptr + tok).to(tl.int64)
    return p


@triton.jit  # type: ignore[untyped-decorator]
def _dual_chunk_query_kernel(  # type: ignore[no-untyped-def]
    pos_ptr, off_ptr, q_ptr, q_out_ptr, q_cache, qc_cache, qcnc_cache, qi_cache,
    sq0, sq1, num_heads, head_size, rot, chunk_len,
    HAS_OFFSETS: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
    D_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = _position(pos_ptr, off_ptr, tok, HAS_OFFSETS) % chunk_len
    if v == 0:
        row = q_cache + c * rot
    elif v == 1:
        row = qc_cache + c * rot
    elif v == 2:  # inter-chunk: the last successive row, whatever the position
        row = qc_cache + (chunk_len - 1) * rot
    elif v == 3:
        row = qcnc_cache + c * rot
    else:
        row = qi_cache + c * rot
    q_width = num_heads * head_size
    dst = q_out_ptr + tok * 5 * q_width + v * q_width
    _rope_block(q_ptr + tok * sq0, sq1, dst, row, heads, num_heads, head_size, rot, IS_NEOX,
                D_PAD)


@triton.jit  # type: ignore[untyped-decorator]
def _dual_chunk_key_kernel(  # type: ignore[no-untyped-def]
    pos_ptr, off_ptr, k_ptr, k_out_ptr, k_cache, sk0, sk1, num_kv_heads, head_size, rot,
    HAS_OFFSETS: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
    D_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    p = _position(pos_ptr, off_ptr, tok, HAS_OFFSETS)
    dst = k_out_ptr + tok * num_kv_heads * head_size
    _rope_block(k_ptr + tok * sk0, sk1, dst, k_cache + p * rot, heads, num_kv_heads,
                head_size, rot, IS_NEOX, D_PAD)


def dual_chunk_rotary_embedding(
        positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        cos_sin_q_cache: torch.Tensor, cos_sin_qc_cache: torch.Tensor,
        cos_sin_k_cache: torch.Tensor, cos_sin_qc_no_clamp_cache: torch.Tensor,
        cos_sin_q_inter_cache: torch.Tensor, head_size: int, is_neox_style: bool = True,
        offsets: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-chunk rotary embedding: ``(query_out [T, 5*H*D], key_out [T, Hkv*D])`` (Triton)."""
    if positions.is_cpu:  # position values: the kernels do not check them
        check_dual_chunk_rotary_embedding_values(positions, cos_sin_k_cache, offsets,
                                                 provider=PROVIDER)
    tokens = positions.shape[0]
    q_out = torch.empty((tokens, 5 * query.shape[1]), dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if tokens == 0:
        return q_out, k_out
    num_heads, num_kv_heads = query.shape[1] // head_size, key.shape[1] // head_size
    d_pad = next_pow2(head_size)
    block_h = max(1, min(next_pow2(max(num_heads, num_kv_heads)), 4096 // d_pad))
    rot, chunk_len = cos_sin_q_cache.shape[1], cos_sin_q_cache.shape[0]
    off = positions if offsets is None else offsets
    meta = {"HAS_OFFSETS": offsets is not None, "IS_NEOX": bool(is_neox_style),
            "BLOCK_H": block_h, "D_PAD": d_pad, "num_warps": 4 if block_h * d_pad >= 1024 else 1}
    if num_heads:
        _dual_chunk_query_kernel[(tokens, 5, triton.cdiv(num_heads, block_h))](
            positions, off, query, q_out, cos_sin_q_cache, cos_sin_qc_cache,
            cos_sin_qc_no_clamp_cache, cos_sin_q_inter_cache, *query.stride(), num_heads,
            head_size, rot, chunk_len, **meta)
    if num_kv_heads:
        _dual_chunk_key_kernel[(tokens, triton.cdiv(num_kv_heads, block_h))](
            positions, off, key, k_out, cos_sin_k_cache, *key.stride(), num_kv_heads,
            head_size, rot, **meta)
    return q_out, k_out


def dual_chunk_rotary_embedding_supports(
        positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        cos_sin_q_cache: torch.Tensor, cos_sin_qc_cache: torch.Tensor,
        cos_sin_k_cache: torch.Tensor, cos_sin_qc_no_clamp_cache: torch.Tensor,
        cos_sin_q_inter_cache: torch.Tensor, head_size: int, is_neox_style: bool = True,
        offsets: Optional[torch.Tensor] = None) -> bool:
    """Native's static check; query/key of one float dtype (any strides); contiguous caches
    of that dtype."""
    caches = (cos_sin_q_cache, cos_sin_qc_cache, cos_sin_k_cache, cos_sin_qc_no_clamp_cache,
              cos_sin_q_inter_cache)
    return (static_check_passes(check_dual_chunk_rotary_embedding, positions, query, key,
                                *caches, head_size, is_neox_style, offsets, provider=PROVIDER)
            and query.dtype in DTYPES and key.dtype == query.dtype
            and all(c.dtype == query.dtype and c.is_contiguous() for c in caches))
