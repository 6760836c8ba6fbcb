"""Paged-attention test cases for the xla_gpu op: builders, layout conversion, a loop reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from opmux.testing import paged_batch


@dataclass
class Case:
    """Inputs of ``xla_gpu.paged_attention`` plus the catalog-layout view of the same data."""

    query: Tensor  # [T_pad, H, D]
    kv_cache: Tensor  # [2, NB, bs, Hkv, D]
    context_lens: Tensor  # [S_pad] int32
    block_tables: Tensor  # [S_pad, M] int32
    query_start_loc: Tensor  # [S_pad + 1] int32
    num_seqs: Tensor  # [1] int32
    scale: float
    sliding_window: int | None
    soft_cap: float | None
    q_lens: list[int]
    kv_lens: list[int]

    @property
    def live_tokens(self) -> int:
        return sum(self.q_lens)

    def args(self) -> tuple[object, ...]:
        return (self.query, self.kv_cache, self.context_lens, self.block_tables,
                self.query_start_loc, self.num_seqs, self.scale, self.sliding_window,
                self.soft_cap)

    def catalog_args(self) -> tuple[object, ...]:
        """Arguments of the catalog ``paged_attention`` (separate caches, live rows only)."""
        n = len(self.q_lens)
        return (self.query[: self.live_tokens], self.kv_cache[0], self.kv_cache[1],
                self.block_tables[:n], self.context_lens[:n], self.query_start_loc[: n + 1],
                self.scale, self.sliding_window, self.soft_cap)

    def to(self, device: torch.device | str) -> Case:
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v)
                 for k, v in self.__dict__.items()}
        return Case(**moved)


def make_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_size: int = 16,
    block_size: int = 4,
    max_blocks: int | None = None,
    batch_bucket: int | None = None,
    token_bucket: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    """Random case; padding rows/sequences are filled with garbage the op must ignore."""
    assert len(q_lens) == len(kv_lens) and all(k >= q for q, k in zip(q_lens, kv_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    need = [math.ceil(k / block_size) for k in kv_lens]
    max_blocks = max_blocks if max_blocks is not None else max([*need, 1])
    batch = batch_bucket if batch_bucket is not None else n
    tokens = token_bucket if token_bucket is not None else sum(q_lens)
    live = paged_batch(q_lens, kv_lens, heads=heads, kv_heads=kv_heads, head_size=head_size,
                       block_size=block_size, dtype=dtype, pad_rows=tokens - sum(q_lens),
                       extra_columns=max_blocks - max(need, default=0), unused=-2,
                       generator=gen)
    num_blocks = live.key_cache.shape[0]
    # garbage in unused table slots and padding rows: out-of-range and negative ids
    tables = torch.randint(-2, num_blocks + 5, (batch, max_blocks), generator=gen).to(torch.int32)
    tables[:n] = torch.where(live.block_tables == -2, tables[:n], live.block_tables)
    qsl = torch.zeros(batch + 1, dtype=torch.int32)
    qsl[: n + 1] = live.query_start_loc
    qsl[n + 1:] = torch.randint(0, tokens + 3, (batch - n,), generator=gen).to(torch.int32)
    ctx = torch.randint(0, max_blocks * block_size + 7, (batch,), generator=gen).to(torch.int32)
    ctx[:n] = live.seq_lens
    query = live.query
    kv = torch.stack([live.key_cache, live.value_cache])
    return Case(query, kv, ctx, tables, qsl, torch.tensor([n], dtype=torch.int32),
                head_size ** -0.5, sliding_window, soft_cap, list(q_lens), list(kv_lens))


def loop_reference(case: Case) -> Tensor:
    """Catalog semantics written as the plainest per-sequence loop (fp32 math).

    Padding rows come out zero, as the xla_gpu op documents.
    """
    query = case.query.float()
    keys, values = case.kv_cache[0].float(), case.kv_cache[1].float()
    heads, kv_heads = query.shape[1], keys.shape[2]
    block_size = keys.shape[1]
    out = torch.zeros_like(query)
    for i, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        start = int(case.query_start_loc[i])
        nb = math.ceil(kv_len / block_size)
        ids = case.block_tables[i, :nb].long()
        k = keys[ids].reshape(-1, kv_heads, keys.shape[-1])[:kv_len]
        v = values[ids].reshape(-1, kv_heads, keys.shape[-1])[:kv_len]
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        q = query[start: start + q_len]
        s = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        if case.soft_cap is not None:
            s = case.soft_cap * torch.tanh(s / case.soft_cap)
        pos = torch.arange(q_len).unsqueeze(1) + kv_len - q_len
        t = torch.arange(kv_len).unsqueeze(0)
        vis = t <= pos
        if case.sliding_window is not None:
            vis &= t > pos - case.sliding_window
        s = s.masked_fill(~vis, float("-inf"))
        out[start: start + q_len] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out.to(case.query.dtype)


#: name -> keyword arguments of :func:`make_case`
CASES: dict[str, dict[str, object]] = {
    "decode": dict(q_lens=[1, 1, 1], kv_lens=[5, 17, 9]),
    "decode_padded": dict(q_lens=[1, 1], kv_lens=[3, 12], batch_bucket=4, token_bucket=4,
                          max_blocks=5),
    "prefill": dict(q_lens=[7, 5], kv_lens=[7, 5]),
    "prefill_with_prefix": dict(q_lens=[6, 3], kv_lens=[13, 9]),
    "mixed": dict(q_lens=[1, 6, 1, 3], kv_lens=[11, 6, 2, 14], batch_bucket=6,
                  token_bucket=16),
    "gqa_4": dict(q_lens=[1, 4], kv_lens=[9, 10], heads=8, kv_heads=2),
    "mha": dict(q_lens=[2, 1], kv_lens=[7, 3], heads=3, kv_heads=3),
    "mqa": dict(q_lens=[3, 1], kv_lens=[8, 6], heads=4, kv_heads=1),
    "window": dict(q_lens=[1, 5, 2], kv_lens=[15, 9, 12], sliding_window=4),
    "soft_cap": dict(q_lens=[1, 4], kv_lens=[10, 7], soft_cap=2.5),
    "window_soft_cap_padded": dict(q_lens=[3, 1], kv_lens=[10, 18], sliding_window=5,
                                   soft_cap=1.5, batch_bucket=3, token_bucket=6),
}


def damage(case: Case, cell: int, bad: float) -> None:
    """NaN in every cache row no live sequence owns, and ``bad`` in one cell of key 8 of the
    second sequence (``cell`` 0: keys, 1: values), kv head 1: with ``make_case([1, 9], [20,
    12], block_size=4)`` its prefill rows 0..4 (positions 3..7) do not see that key."""
    kc = case.kv_cache
    bs = kc.shape[2]
    owned = torch.zeros(kc.shape[1:3], dtype=torch.bool)
    for i, kv_len in enumerate(case.kv_lens):
        t = torch.arange(kv_len)
        owned[case.block_tables[i, t // bs].long(), t % bs] = True
    kc[:, ~owned] = float("nan")
    kc[cell, case.block_tables[1, 8 // bs].long(), 8 % bs, 1, 5] = bad
