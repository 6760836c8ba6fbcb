"""Rotary position embedding: ``rotary_embedding`` (native reference, vLLM conventions)."""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
from typing import Optional

import torch
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops._checks import check_rotary_embedding, rotary_heads

__all__ = ["make_cos_sin_cache", "rotary_embedding"]


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
    they agree for every head size, rotary width, style and layout (#19).

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
