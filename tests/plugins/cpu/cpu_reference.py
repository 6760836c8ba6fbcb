"""Straightforward fp32 references for the CPU kernel tests (independent of opmux.ops)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: Tensor) -> Tensor:
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def gelu_and_mul(x: Tensor, approximate: str) -> Tensor:
    d = x.shape[-1] // 2
    return (F.gelu(x[..., :d].float(), approximate=approximate) * x[..., d:].float()).to(x.dtype)


def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, cache: Tensor,
                     head_size: int, is_neox: bool) -> tuple[Tensor, Tensor]:
    rot = cache.shape[1]
    cos, sin = cache[positions].float().chunk(2, dim=-1)  # [T, rot/2]

    def apply(x: Tensor) -> Tensor:
        t = x.shape[0]
        xf = x.float().reshape(t, -1, head_size).clone()
        r = xf[..., :rot]
        c, s = cos[:, None, :], sin[:, None, :]
        if is_neox:
            x1, x2 = r[..., : rot // 2], r[..., rot // 2:]
            r_new = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
            r_new = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        xf[..., :rot] = r_new
        return xf.reshape(x.shape).to(x.dtype)

    return apply(query), apply(key)


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    bs = key_cache.shape[1]
    for t, s in enumerate(slot_mapping.tolist()):
        if s >= 0:
            key_cache[s // bs, s % bs] = key[t]
            value_cache[s // bs, s % bs] = value[t]


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                    sliding_window: int | None, soft_cap: float | None) -> Tensor:
    n_tok, n_heads, d = query.shape
    bs, n_kv = key_cache.shape[1], key_cache.shape[2]
    group = n_heads // n_kv
    out = torch.zeros(n_tok, n_heads, d)
    qsl = query_start_loc.tolist()
    for i, kv_len in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[i], qsl[i + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        blocks = block_tables[i, : math.ceil(kv_len / bs)].long()
        k = key_cache[blocks].reshape(-1, n_kv, d)[:kv_len].float().repeat_interleave(group, 1)
        v = value_cache[blocks].reshape(-1, n_kv, d)[:kv_len].float().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), k) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = kv_len - q_len + torch.arange(q_len)[:, None]
        t = torch.arange(kv_len)[None, :]
        mask = t <= pos
        if sliding_window is not None:
            mask &= t > pos - sliding_window
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v)
    return out.to(query.dtype)


def advance_step(num_seqs: int, num_queries: int, block_size: int, input_tokens: Tensor,
                 sampled: Tensor, input_positions: Tensor, seq_lens: Tensor,
                 slot_mapping: Tensor, block_tables: Tensor) -> None:
    for i in range(num_seqs):
        if i < num_queries:
            pos = int(seq_lens[i])
            input_tokens[i] = sampled[i, 0]
            seq_lens[i] = pos + 1
            input_positions[i] = pos
            block = int(block_tables[i, pos // block_size])
            slot_mapping[i] = block * block_size + pos % block_size
        else:
            input_tokens[i] = 0
            input_positions[i] = 0
            slot_mapping[i] = -1
