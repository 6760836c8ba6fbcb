"""Seeded conformance cases of ``encoder_attention``, ``concat_and_cache_mla`` and
``mla_attention`` (issue 14)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence

import torch

from opmux.testing.cases import Case, register_cases

__all__ = ["mla_case", "register_attention_extra_cases"]

_DTYPES = (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _randn(g: torch.Generator, shape: Sequence[int], dtype: torch.dtype,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=g) * scale).to(dtype)


def _offsets(lens: Sequence[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=dtype)
    out[1:] = torch.tensor(list(lens), dtype=dtype).cumsum(0)
    return out


# -------------------------------------------------------------------------- encoder attention
def _encoder_case(name: str, lens: Sequence[int], *, dtype: torch.dtype = torch.float32,
                  heads: int = 4, kv_heads: int = 4, head_size: int = 32, pad_rows: int = 0,
                  packed_qkv: bool = False, max_seqlen: int | None = -1,
                  index_dtype: torch.dtype = torch.int32) -> Case:
    g = _gen(name)
    tokens = sum(lens) + pad_rows
    if packed_qkv:   # q, k, v as strided views of one [T, (H + 2 Hkv), D] projection
        qkv = _randn(g, (tokens, heads + 2 * kv_heads, head_size), dtype)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    else:
        q = _randn(g, (tokens, heads, head_size), dtype)
        k = _randn(g, (tokens, kv_heads, head_size), dtype)
        v = _randn(g, (tokens, kv_heads, head_size), dtype)
    longest = max(lens, default=0)
    hint = longest if max_seqlen == -1 else max_seqlen
    return Case(name, (q, k, v, _offsets(lens, index_dtype), hint, head_size ** -0.5))


def encoder_attention_cases() -> Iterator[Case]:
    """Ragged batches, GQA, strided q/k/v views, padding rows, int64 offsets, empty."""
    for tag, dt in _DTYPES:
        yield _encoder_case(f"{tag}-ragged", [5, 17, 1, 9], dtype=dt)
        yield _encoder_case(f"{tag}-gqa2-packed", [7, 12], dtype=dt, heads=4, kv_heads=2,
                            packed_qkv=True)
    yield _encoder_case("fp32-long-d80", [70, 3], heads=2, kv_heads=2, head_size=80)
    yield _encoder_case("fp32-one-sequence-no-hint", [33], max_seqlen=None)
    yield _encoder_case("fp32-empty-sequences", [0, 4, 0, 2], heads=2, kv_heads=1)
    yield _encoder_case("fp32-padding-rows", [3, 2], pad_rows=3)
    yield _encoder_case("fp32-int64-offsets", [6, 4], index_dtype=torch.int64)
    yield _encoder_case("fp32-empty", [], heads=2, kv_heads=2)


# ------------------------------------------------------------------------------------- MLA
def concat_and_cache_mla_cases() -> Iterator[Case]:
    """Padding slots (-1), several block sizes, strided ``kv_c``/``k_pe`` views, empty."""
    specs: list[tuple[str, torch.dtype, int, int, int, int, int, tuple[int, ...], bool]] = [
        (f"{tag}-basic", dt, 10, 32, 8, 6, 4, (2, 7), False) for tag, dt in _DTYPES]
    specs += [("fp32-bs16-views", torch.float32, 20, 64, 16, 3, 16, (0,), True),
              ("fp32-all-padding", torch.float32, 4, 32, 8, 2, 4, (0, 1, 2, 3), False),
              ("fp32-empty", torch.float32, 0, 32, 8, 2, 4, (), False)]
    for name, dt, t, lora, rope, nb, bs, pads, views in specs:
        g = _gen(name)
        if views:   # as the layer has them: slices of one [T, L + R] projection
            kv = _randn(g, (t, lora + rope), dt)
            kv_c, k_pe = kv.split([lora, rope], dim=-1)
        else:
            kv_c, k_pe = _randn(g, (t, lora), dt), _randn(g, (t, rope), dt)
        cache = _randn(g, (nb, bs, lora + rope), dt)
        slots = torch.randperm(nb * bs, generator=g)[:t].to(torch.int64)
        for i in pads:
            slots[i] = -1
        yield Case(name, (kv_c, k_pe, cache, slots))


def mla_case(name: str, *, q_lens: Sequence[int], kv_lens: Sequence[int],
             dtype: torch.dtype = torch.float32, heads: int = 4, nope: int = 16,
             rope: int = 8, lora: int = 32, v_dim: int = 16, block_size: int = 8,
             pad_rows: int = 0, spare_blocks: int = 2) -> Case:
    """Build an ``mla_attention`` case: shuffled blocks, random unused cache rows."""
    g = _gen(name)
    per_seq = [(n + block_size - 1) // block_size for n in kv_lens]
    num_blocks = sum(per_seq) + spare_blocks
    max_blocks = max(per_seq, default=0) + 1
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.randint(0, num_blocks, (len(kv_lens), max_blocks), generator=g,
                           dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[start:start + n]
        start += n
    cache = _randn(g, (num_blocks, block_size, lora + rope), dtype)
    q = _randn(g, (sum(q_lens) + pad_rows, heads, nope + rope), dtype)
    weight = _randn(g, (heads * (nope + v_dim), lora), dtype, lora ** -0.5)
    scale = (nope + rope) ** -0.5
    return Case(name, (q, cache, weight, tables, torch.tensor(list(kv_lens), dtype=torch.int32),
                       _offsets(q_lens), scale, nope))


def mla_attention_cases() -> Iterator[Case]:
    """Decode, prefill, chunked prefill, mixed batches, q_len 0, padding rows, empty."""
    for tag, dt in _DTYPES:
        yield mla_case(f"{tag}-decode", dtype=dt, q_lens=[1, 1, 1], kv_lens=[1, 9, 20])
        yield mla_case(f"{tag}-mixed", dtype=dt, q_lens=[3, 1, 6], kv_lens=[10, 17, 6])
    yield mla_case("fp32-prefill", q_lens=[5, 12], kv_lens=[5, 12])
    yield mla_case("fp32-decode-20-heads", q_lens=[1, 1], kv_lens=[30, 4], heads=20)
    yield mla_case("fp32-qlen0", q_lens=[0, 2, 0], kv_lens=[4, 5, 3])
    yield mla_case("fp32-padding-rows", q_lens=[2, 1], kv_lens=[7, 3], pad_rows=2)
    yield mla_case("fp32-bs16-wide", q_lens=[1, 4], kv_lens=[40, 21], lora=64, rope=16,
                   nope=32, v_dim=24, block_size=16)
    yield mla_case("fp32-empty", q_lens=[], kv_lens=[])


def register_attention_extra_cases() -> None:
    """Register the generators above (idempotent)."""
    register_cases("encoder_attention", encoder_attention_cases, replace=True)
    register_cases("concat_and_cache_mla", concat_and_cache_mla_cases, replace=True)
    register_cases("mla_attention", mla_attention_cases, replace=True)
