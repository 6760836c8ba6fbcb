"""Triton kernel for ``rotary_embedding`` (functional: writes new query and key tensors).

One launch covers query and key: program ``(t, j)`` handles token ``t`` and a block of
``BLOCK_H`` heads, of the query when ``j < query head blocks`` else of the key. Each output
column ``i < rot`` is ``x[i] * cos[c] + sign * x[partner] * sin[c]``:

- neox: ``c = i mod rot/2``, partner ``i +- rot/2``, sign ``-`` on the first half;
- gptj: ``c = i // 2``, partner ``i ^ 1``, sign ``-`` on even columns.

Columns ``rot..D`` are copied unchanged, so every output element is written exactly once.
"""

import torch
import triton
import triton.language as tl

from opmux.ops.checks import check_rotary_embedding
from opmux.plugins.cuda.triton_runtime import DTYPES, PROVIDER, next_pow2

__all__ = ["rotary_embedding", "rotary_embedding_supports"]


# Column i of a rotated head reads cos/sin entry c and partner column partner with sign sign
# (the layouts of the module docstring); shared with triton_rope_more.
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

    Takes every layout native takes (#19): positions of any shape, queries ``[*P, H*D]`` or
    ``[*P, H, D]``; positions are read contiguously (a strided or stride-0 view is copied,
    #11), query/key rows through their token stride.
    """
    check_rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox,
                           provider=PROVIDER,
                           read_data=not getattr(query, "is_cuda", False))
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
    """Float query/key of one dtype, integer positions, an even ``rot <= head_size``."""
    return (isinstance(positions, torch.Tensor) and isinstance(query, torch.Tensor)
            and isinstance(key, torch.Tensor) and isinstance(cos_sin_cache, torch.Tensor)
            and query.dtype in DTYPES and key.dtype == query.dtype
            and cos_sin_cache.dtype in DTYPES and cos_sin_cache.dim() == 2
            and positions.dtype in (torch.int64, torch.int32)
            and 0 < cos_sin_cache.shape[1] <= head_size and cos_sin_cache.shape[1] % 2 == 0)
