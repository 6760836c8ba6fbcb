"""Rotary position embedding (native references, vLLM conventions): ``rotary_embedding``,
``apply_rotary_emb`` and ``dual_chunk_rotary_embedding`` (vLLM 0.32 semantics).

``rotary_embedding`` rotates the first ``rot`` dims of each query and key head by the
cos/sin rows its positions pick. ``apply_rotary_emb`` is the rotation vLLM's
``ApplyRotaryEmb`` layer performs on a whole head (vision encoders call it with per-sequence
``cos``/``sin``); ``dual_chunk_rotary_embedding`` is the forward of vLLM's
``DualChunkRotaryEmbedding`` (Dual Chunk Attention, Qwen2.5-1M): the key rotated once, the
query rotated five times with the layer's five caches, the five query versions concatenated
along the last dimension.

Inputs are validated by :mod:`opmux.ops.checks.rotary`; providers call the same checks with
their name and ``read_data=False`` where reading values would cost a device sync.
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
from typing import Optional

import torch
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks.rotary import (
    check_apply_rotary_emb,
    check_dual_chunk_rotary_embedding,
    check_rotary_embedding,
    rotary_heads,
)

__all__ = [
    "DUAL_CHUNK_QUERY_VERSIONS",
    "apply_rotary_emb",
    "dual_chunk_rotary_embedding",
    "make_cos_sin_cache",
    "make_dual_chunk_caches",
    "rotary_embedding",
]

DUAL_CHUNK_QUERY_VERSIONS = 5
"""How many rotated copies of the query ``dual_chunk_rotary_embedding`` returns (intra,
successive, inter, successive-critical, inter-critical, in that order)."""


def make_dual_chunk_caches(chunk_size: int, local_size: int, max_position: int,
                           rotary_dim: int, base: float = 10000.0,
                           dtype: torch.dtype = torch.float32,
                           device: Optional[torch.device] = None
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The five caches of dual-chunk rotary embedding, in the op's argument order.

    With ``chunk_len = chunk_size - local_size`` and ``i in [0, chunk_len)``, the rows sit
    at positions ``i`` (``q``), ``min(i + chunk_len, chunk_size)`` (``qc``),
    ``p % chunk_len`` for ``p in [0, max_position)`` (``k``), ``i + chunk_len``
    (``qc_no_clamp``) and ``i + chunk_size`` (``q_inter``); each row is
    ``cat(cos(pos * inv_freq), sin(pos * inv_freq))`` with vLLM's ``inv_freq``.

    :returns: ``(q, qc, k, qc_no_clamp, q_inter)`` caches, ``[rows, rotary_dim]`` each.
    """
    chunk_len = chunk_size - local_size
    if chunk_len <= 0:
        raise ValueError(f"chunk_size ({chunk_size}) must exceed local_size ({local_size})")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32)
                               / rotary_dim))
    i = torch.arange(chunk_len, dtype=torch.float32)
    rows = (i, (i + chunk_len).clamp(max=chunk_size),
            torch.arange(max_position, dtype=torch.float32) % chunk_len, i + chunk_len,
            i + chunk_size)

    def cache(t: Tensor) -> Tensor:
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)

    q, qc, k, qc_no_clamp, q_inter = (cache(t) for t in rows)
    return q, qc, k, qc_no_clamp, q_inter


def make_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0,
                       dtype: torch.dtype = torch.float32,
                       device: Optional[torch.device] = None) -> Tensor:
    """Build a ``[max_position, rotary_dim]`` cache: ``cos`` columns first, then ``sin``.

    :param rotary_dim: the rotary width ``rot`` (even, at most the head size).
    :param base: the frequency base (10000 for Llama-style models).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                            device=device) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, tokens: int, lead: int,
            head_size: int, is_neox: bool) -> Tensor:
    """Rotate the first ``rot`` dims of every head of ``x`` ([*P, H*D] or [*P, H, D])."""
    shape = x.shape
    heads = x.reshape(tokens, rotary_heads(x, lead, head_size), head_size)
    rot = cos.shape[-1] * 2
    xr = heads[..., :rot].float()
    c = cos.unsqueeze(1)
    s = sin.unsqueeze(1)
    if is_neox:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    out = torch.cat((rotated.to(x.dtype), heads[..., rot:]), dim=-1)
    return out.reshape(shape)


@register_op
def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor,
                     head_size: int, is_neox: bool = True) -> tuple[Tensor, Tensor]:
    """Apply rotary embedding to ``query`` and ``key``; returns new tensors.

    ``cos_sin_cache[max_pos, rot]`` holds ``cos`` in its first ``rot/2`` columns and ``sin``
    in the last ``rot/2`` (vLLM convention). The first ``rot`` dims of each head rotate
    (fp32 math); dims ``rot..head_size`` pass through unchanged. Neox style rotates the two
    halves of the rotary dims, GPT-J style rotates interleaved pairs.

    Layouts (as vLLM's kernel): ``positions`` may have any shape ``P`` (``[T]``,
    ``[batch, seq]``, ...); ``query``/``key`` are ``[*P, heads*head_size]`` or
    ``[*P, heads, head_size]`` (told apart by rank). Outputs keep the inputs' shapes; any
    strides are read.

    Precision: the rotation is computed in fp32 and rounded once to the input dtype, as
    vLLM's CPU kernel does. vLLM's Python reference instead rotates bf16/fp16 inputs in
    that dtype (cos and sin cast down, every product and sum rounded), so on large bf16
    inputs the two differ by about one bf16 ulp, beyond vLLM's test tolerance; in fp32
    they agree for every head size, rotary width, style and layout.

    :param positions: int64/int32 positions, each in ``[0, max_pos)``.
    :param query: ``[*P, H*D]`` or ``[*P, H, D]``.
    :param key: ``[*P, Hkv*D]`` or ``[*P, Hkv, D]``, same dtype as ``query``.
    :returns: ``(query, key)`` rotated, same shapes and dtype as the inputs.
    :raises opmux.OpInputError: bad shapes or dtypes, or a position outside the cache.
    """
    check_rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox)
    flat = positions.reshape(-1)
    lead = positions.dim()
    cos_sin = cos_sin_cache.index_select(0, flat.long()).float()
    cos, sin = cos_sin.chunk(2, dim=-1)
    tokens = flat.shape[0]
    return (_rotate(query, cos, sin, tokens, lead, head_size, is_neox),
            _rotate(key, cos, sin, tokens, lead, head_size, is_neox))


@register_op
def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, is_neox_style: bool = True,
                     enable_fp32_compute: bool = False) -> Tensor:
    """Rotate every head of ``x`` by per-position angles; returns a new tensor like ``x``.

    vLLM's ``ApplyRotaryEmb.forward_static``: with ``x1, x2`` the two halves of each head
    (neox style) or its even/odd entries (GPT-J style), the result is
    ``(x1*cos - x2*sin, x2*cos + x1*sin)`` put back in the same layout. The math runs in
    ``x.dtype`` (``cos``/``sin`` cast to it), or in float32 when ``enable_fp32_compute``;
    the result has ``x``'s dtype and shape either way.

    :param x: ``[seq_len, num_heads, head_size]`` or ``[batch, seq_len, num_heads, head_size]``
        (any leading dims before ``seq_len``), head_size even.
    :param cos: ``[seq_len, head_size // 2]``, any floating dtype.
    :param sin: like ``cos``.
    :raises opmux.OpInputError: bad shapes, dtypes or devices.
    """
    check_apply_rotary_emb(x, cos, sin, is_neox_style, enable_fp32_compute)
    dtype = torch.float32 if enable_fp32_compute else x.dtype
    xc = x.to(dtype)
    c = cos.unsqueeze(-2).to(dtype)
    s = sin.unsqueeze(-2).to(dtype)
    if is_neox_style:
        x1, x2 = xc.chunk(2, dim=-1)
    else:
        x1, x2 = xc[..., 0::2], xc[..., 1::2]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    out = torch.cat((o1, o2), dim=-1) if is_neox_style else torch.stack((o1, o2), -1).flatten(-2)
    return out.to(x.dtype)


def _dual_chunk_rotate(hidden: Tensor, cos_sin: Tensor, rot: int, is_neox: bool) -> Tensor:
    """Rotate the first ``rot`` dims of each head of ``hidden[T, H, D]`` by ``cos_sin[T, rot]``
    (math in the promoted dtype of the two, as vLLM's layer); returns ``[T, H*D]``."""
    cos, sin = cos_sin.chunk(2, dim=-1)
    x = hidden[..., :rot]
    if is_neox:
        cos2 = torch.cat((cos, cos), dim=-1).unsqueeze(-2)
        sin2 = torch.cat((sin, sin), dim=-1).unsqueeze(-2)
        x1, x2 = x[..., : rot // 2], x[..., rot // 2:]
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        cos2 = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
        sin2 = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    out = x * cos2 + rotated * sin2
    if rot < hidden.shape[-1]:
        out = torch.cat((out, hidden[..., rot:].to(out.dtype)), dim=-1)
    return out.flatten(-2)


@register_op
def dual_chunk_rotary_embedding(positions: Tensor, query: Tensor, key: Tensor,
                                cos_sin_q_cache: Tensor, cos_sin_qc_cache: Tensor,
                                cos_sin_k_cache: Tensor, cos_sin_qc_no_clamp_cache: Tensor,
                                cos_sin_q_inter_cache: Tensor, head_size: int,
                                is_neox_style: bool = True, offsets: Optional[Tensor] = None
                                ) -> tuple[Tensor, Tensor]:
    """Dual-chunk rotary embedding (vLLM's ``DualChunkRotaryEmbedding`` forward).

    With ``p = positions (+ offsets)`` and ``chunk_len = cos_sin_q_cache.shape[0]``
    (``chunk_size - local_size``), the key rotates by ``cos_sin_k_cache[p]`` and the query
    five times: by ``cos_sin_q_cache[p % chunk_len]`` (intra-chunk),
    ``cos_sin_qc_cache[p % chunk_len]`` (successive chunk), ``cos_sin_qc_cache[chunk_len-1]``
    (inter-chunk, the same row for every token), ``cos_sin_qc_no_clamp_cache[p % chunk_len]``
    and ``cos_sin_q_inter_cache[p % chunk_len]`` (the two critical variants). Each cache is
    ``[rows, rot]``, cos columns first; the first ``rot`` dims of every head rotate (neox or
    GPT-J style), the rest pass through. Returns new tensors; the math runs in the promoted
    dtype of query and caches (as vLLM's layer), which is also the result dtype.

    :param positions: ``[T]`` int32/int64.
    :param query: ``[T, H*head_size]``.
    :param key: ``[T, Hkv*head_size]``, query's dtype.
    :param offsets: optional ``[T]`` int offsets added to ``positions``.
    :returns: ``(query_out [T, 5*H*head_size], key_out [T, Hkv*head_size])``, the five query
        versions concatenated along the last dimension in the order above.
    :raises opmux.OpInputError: bad shapes or dtypes, or a position outside
        ``cos_sin_k_cache``.
    """
    check_dual_chunk_rotary_embedding(positions, query, key, cos_sin_q_cache, cos_sin_qc_cache,
                                      cos_sin_k_cache, cos_sin_qc_no_clamp_cache,
                                      cos_sin_q_inter_cache, head_size, is_neox_style, offsets)
    tokens = positions.shape[0]
    rot = cos_sin_q_cache.shape[1]
    chunk_len = cos_sin_q_cache.shape[0]
    pos = positions.long() if offsets is None else positions.long() + offsets.long()
    q = query.reshape(tokens, query.shape[1] // head_size, head_size)
    k = key.reshape(tokens, key.shape[1] // head_size, head_size)
    key_out = _dual_chunk_rotate(k, cos_sin_k_cache.index_select(0, pos), rot, is_neox_style)
    in_chunk = pos % chunk_len
    inter = cos_sin_qc_cache[chunk_len - 1].expand(tokens, rot)
    versions = [_dual_chunk_rotate(q, cache, rot, is_neox_style) for cache in (
        cos_sin_q_cache.index_select(0, in_chunk), cos_sin_qc_cache.index_select(0, in_chunk),
        inter, cos_sin_qc_no_clamp_cache.index_select(0, in_chunk),
        cos_sin_q_inter_cache.index_select(0, in_chunk))]
    return torch.cat(versions, dim=-1), key_out
