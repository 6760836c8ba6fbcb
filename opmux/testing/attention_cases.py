"""Seeded conformance cases of the attention ops (:mod:`opmux.ops.attention`):
``paged_attention`` (:func:`attention_case` builds one), ``encoder_attention``,
``concat_and_cache_mla`` and ``mla_attention``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

from opmux.testing.cache_cases import CACHE_LAYOUTS, cache_layout
from opmux.testing.case_table import Case, register_cases
from opmux.testing.kv_format_cases import kv_format_attention_cases
from opmux.testing.paged_batches import PagedBatch, paged_batch
from opmux.testing.seeded import DTYPES, seeded_generator, seeded_randn

__all__ = [
    "attention_case",
    "concat_and_cache_mla_cases",
    "encoder_attention_cases",
    "mla_attention_cases",
    "mla_case",
    "paged_attention_cases",
    "register_attention_cases",
]


def _offsets(lens: Sequence[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=dtype)
    out[1:] = torch.tensor(list(lens), dtype=dtype).cumsum(0)
    return out


# -------------------------------------------------------------------------- encoder attention
def _encoder_case(name: str, lens: Sequence[int], *, dtype: torch.dtype = torch.float32,
                  heads: int = 4, kv_heads: int = 4, head_size: int = 32, pad_rows: int = 0,
                  packed_qkv: bool = False, max_seqlen: int | None = -1,
                  index_dtype: torch.dtype = torch.int32) -> Case:
    g = seeded_generator(name)
    tokens = sum(lens) + pad_rows
    if packed_qkv:   # q, k, v as strided views of one [T, (H + 2 Hkv), D] projection
        qkv = seeded_randn(g, (tokens, heads + 2 * kv_heads, head_size), dtype)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    else:
        q = seeded_randn(g, (tokens, heads, head_size), dtype)
        k = seeded_randn(g, (tokens, kv_heads, head_size), dtype)
        v = seeded_randn(g, (tokens, kv_heads, head_size), dtype)
    longest = max(lens, default=0)
    hint = longest if max_seqlen == -1 else max_seqlen
    return Case(name, (q, k, v, _offsets(lens, index_dtype), hint, head_size ** -0.5))


def encoder_attention_cases() -> Iterator[Case]:
    """Ragged batches, GQA, strided q/k/v views, padding rows, int64 offsets, empty."""
    for tag, dt in DTYPES:
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
        (f"{tag}-basic", dt, 10, 32, 8, 6, 4, (2, 7), False) for tag, dt in DTYPES]
    specs += [("fp32-bs16-views", torch.float32, 20, 64, 16, 3, 16, (0,), True),
              ("fp32-all-padding", torch.float32, 4, 32, 8, 2, 4, (0, 1, 2, 3), False),
              ("fp32-empty", torch.float32, 0, 32, 8, 2, 4, (), False)]
    for name, dt, t, lora, rope, nb, bs, pads, views in specs:
        g = seeded_generator(name)
        if views:   # as the layer has them: slices of one [T, L + R] projection
            kv = seeded_randn(g, (t, lora + rope), dt)
            kv_c, k_pe = kv.split([lora, rope], dim=-1)
        else:
            kv_c, k_pe = seeded_randn(g, (t, lora), dt), seeded_randn(g, (t, rope), dt)
        cache = seeded_randn(g, (nb, bs, lora + rope), dt)
        slots = torch.randperm(nb * bs, generator=g)[:t].to(torch.int64)
        for i in pads:
            slots[i] = -1
        yield Case(name, (kv_c, k_pe, cache, slots))


def mla_case(name: str, *, q_lens: Sequence[int], kv_lens: Sequence[int],
             dtype: torch.dtype = torch.float32, heads: int = 4, nope: int = 16,
             rope: int = 8, lora: int = 32, v_dim: int = 16, block_size: int = 8,
             pad_rows: int = 0, spare_blocks: int = 2) -> Case:
    """Build an ``mla_attention`` case: shuffled blocks, random unused cache rows."""
    g = seeded_generator(name)
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
    cache = seeded_randn(g, (num_blocks, block_size, lora + rope), dtype)
    q = seeded_randn(g, (sum(q_lens) + pad_rows, heads, nope + rope), dtype)
    weight = seeded_randn(g, (heads * (nope + v_dim), lora), dtype, lora ** -0.5)
    scale = (nope + rope) ** -0.5
    return Case(name, (q, cache, weight, tables, torch.tensor(list(kv_lens), dtype=torch.int32),
                       _offsets(q_lens), scale, nope))


def mla_attention_cases() -> Iterator[Case]:
    """Decode, prefill, chunked prefill, mixed batches, q_len 0, padding rows, empty."""
    for tag, dt in DTYPES:
        yield mla_case(f"{tag}-decode", dtype=dt, q_lens=[1, 1, 1], kv_lens=[1, 9, 20])
        yield mla_case(f"{tag}-mixed", dtype=dt, q_lens=[3, 1, 6], kv_lens=[10, 17, 6])
    yield mla_case("fp32-prefill", q_lens=[5, 12], kv_lens=[5, 12])
    yield mla_case("fp32-decode-20-heads", q_lens=[1, 1], kv_lens=[30, 4], heads=20)
    yield mla_case("fp32-qlen0", q_lens=[0, 2, 0], kv_lens=[4, 5, 3])
    yield mla_case("fp32-padding-rows", q_lens=[2, 1], kv_lens=[7, 3], pad_rows=2)
    yield mla_case("fp32-bs16-wide", q_lens=[1, 4], kv_lens=[40, 21], lora=64, rope=16,
                   nope=32, v_dim=24, block_size=16)
    yield mla_case("fp32-empty", q_lens=[], kv_lens=[])


# ---------------------------------------------------------------------------- paged attention
def attention_case(name: str, *, dtype: torch.dtype = torch.float32,
                   q_lens: Sequence[int], kv_lens: Sequence[int], heads: int = 8,
                   kv_heads: int = 2, head_size: int = 32, block_size: int = 16,
                   sliding_window: int | None = None, soft_cap: float | None = None,
                   pad_rows: int = 0, spare_blocks: int = 3, layout: str = "nhd",
                   damage: tuple[str, int, float] | None = None) -> Case:
    """Build a ``paged_attention`` case: shuffled blocks, random unused cache contents.

    :param q_lens: query rows per sequence (0 allowed).
    :param damage: ``(cache, token, bad)``: NaN in every cache row no sequence owns, and
        ``bad`` (inf or NaN) in one cell of token ``token`` of the last sequence, in its key
        (``cache`` ``"key"``) or value (``"value"``), so a provider must keep it away from the
        rows that do not see that key, as native does.
    :param kv_lens: cached tokens per sequence (``>= q_len``).
    :param pad_rows: extra query rows after the last sequence (padding, output zeros).
    :param layout: the caches' memory layout, one of :data:`CACHE_LAYOUTS`.
    """
    batch = paged_batch(q_lens, kv_lens, heads=heads, kv_heads=kv_heads, head_size=head_size,
                        block_size=block_size, dtype=dtype, pad_rows=pad_rows,
                        spare_blocks=spare_blocks, generator=seeded_generator(name))
    if damage is not None:
        _damage(batch, *damage)
    key_cache, value_cache = cache_layout(batch.key_cache, batch.value_cache, layout)
    batch = dataclasses.replace(batch, key_cache=key_cache, value_cache=value_cache)
    return Case(name, batch.args(head_size ** -0.5, sliding_window, soft_cap))


def _damage(batch: PagedBatch, cache: str, token: int, bad: float) -> None:
    """See :func:`attention_case`'s ``damage`` (in place)."""
    kc = batch.key_cache
    bs = kc.shape[1]
    owned = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i, kv_len in enumerate(batch.seq_lens.tolist()):
        t = torch.arange(kv_len)
        owned[batch.block_tables[i, t // bs].long(), t % bs] = True
    batch.key_cache[~owned] = float("nan")
    batch.value_cache[~owned] = float("nan")
    last = batch.block_tables.shape[0] - 1
    target = batch.key_cache if cache == "key" else batch.value_cache
    target[int(batch.block_tables[last, token // bs]), token % bs, -1, 1] = bad


def paged_attention_cases() -> Iterator[Case]:
    """Cases of ``paged_attention``: decode, prefill, chunked prefill, GQA 1/4/8, windows,
    soft cap, partial last blocks, q_len 0, padding rows, empty batch."""
    q1, kv = [1, 1, 1, 1], [1, 17, 33, 40]  # decode: partial last blocks, a 1-token sequence
    for ratio, (h, hkv) in {1: (4, 4), 4: (8, 2), 8: (8, 1)}.items():
        yield attention_case(f"fp32-decode-gqa{ratio}", heads=h, kv_heads=hkv, q_lens=q1,
                             kv_lens=kv)
    for tag, dt in DTYPES[1:]:
        yield attention_case(f"{tag}-decode-gqa4", dtype=dt, q_lens=q1, kv_lens=kv)
        yield attention_case(f"{tag}-chunked-prefill", dtype=dt, q_lens=[3, 1, 7],
                             kv_lens=[20, 9, 7])
        yield attention_case(f"{tag}-window-softcap", dtype=dt, q_lens=[4, 1], kv_lens=[30, 19],
                             sliding_window=8, soft_cap=2.0)
    yield attention_case("fp32-prefill", q_lens=[5, 16, 1], kv_lens=[5, 16, 1])
    yield attention_case("fp32-chunked-prefill", q_lens=[3, 1, 7], kv_lens=[20, 9, 7])
    yield attention_case("fp32-window", q_lens=[4, 1, 1], kv_lens=[30, 25, 5],
                         sliding_window=8)
    yield attention_case("fp32-window-1", q_lens=[3, 1], kv_lens=[3, 12], sliding_window=1)
    yield attention_case("fp32-softcap", q_lens=[2, 1], kv_lens=[18, 33], soft_cap=1.0)
    yield attention_case("fp32-window-softcap-gqa8", q_lens=[6, 1], kv_lens=[40, 7],
                         heads=8, kv_heads=1, sliding_window=5, soft_cap=3.0)
    yield attention_case("fp32-qlen0", q_lens=[0, 2, 1, 0], kv_lens=[10, 5, 3, 1])
    yield attention_case("fp32-padding-rows", q_lens=[2, 1], kv_lens=[9, 4], pad_rows=3)
    yield attention_case("fp32-bs4-d64", q_lens=[3, 1], kv_lens=[13, 6], heads=4, kv_heads=2,
                         head_size=64, block_size=4)
    yield attention_case("fp32-d128-long", q_lens=[1, 1], kv_lens=[300, 129], heads=4,
                         kv_heads=1, head_size=128, block_size=32)
    yield attention_case("fp32-empty", q_lens=[], kv_lens=[])
    # caches that are permuted or sliced views of one allocation
    for layout in CACHE_LAYOUTS[1:]:
        yield attention_case(f"fp32-layout-{layout}", q_lens=[3, 1, 2], kv_lens=[20, 9, 2],
                             layout=layout)
    yield attention_case("bf16-layout-kv-split-hnd", dtype=torch.bfloat16, q_lens=[1, 4],
                         kv_lens=[17, 6], layout="kv-split-hnd", sliding_window=8)
    # damaged caches: NaN in unowned rows, inf or NaN in key 8 of a 9-row prefill at 12 keys
    # (its rows 0..4 do not see that key)
    inf, nan = float("inf"), float("nan")
    yield attention_case("fp32-damaged-value-inf", q_lens=[1, 9], kv_lens=[20, 12],
                         block_size=4, damage=("value", 8, inf))
    yield attention_case("fp32-damaged-value-nan-window", q_lens=[1, 9], kv_lens=[20, 12],
                         block_size=4, sliding_window=3, damage=("value", 8, nan))
    yield attention_case("bf16-damaged-key-nan-softcap", dtype=torch.bfloat16, q_lens=[1, 9],
                         kv_lens=[20, 12], block_size=4, soft_cap=4.0, damage=("key", 8, nan))
    yield attention_case("fp16-damaged-value-nan-gqa8", dtype=torch.float16, q_lens=[1, 9],
                         kv_lens=[20, 12], heads=8, kv_heads=1, head_size=64, block_size=4,
                         damage=("value", 8, nan))
    yield from kv_format_attention_cases()  # every registered KV-cache format


#: the case generators of the ops above, by op name


def register_attention_cases() -> None:
    """Register the generators above, ``<op>_cases`` for op ``<op>`` (replacing earlier
    ones)."""
    for generator in (paged_attention_cases, encoder_attention_cases, concat_and_cache_mla_cases,
                      mla_attention_cases):
        register_cases(generator.__name__.removesuffix("_cases"), generator, replace=True)
