"""Seeded conformance cases of the cache ops (:mod:`opmux.ops.cache`): ``reshape_and_cache`` (in
the cache layouts engines use, :func:`cache_layout`) and ``advance_step_flashattn``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.testing.case_table import Case, register_cases
from opmux.testing.kv_format_cases import kv_format_reshape_cases
from opmux.testing.seeded import DTYPES, seeded_generator, seeded_randn

__all__ = [
    "CACHE_LAYOUTS",
    "advance_step_flashattn_cases",
    "cache_layout",
    "register_cache_cases",
    "reshape_and_cache_cases",
]


def reshape_and_cache_cases() -> Iterator[Case]:
    """Cases of ``reshape_and_cache``: padding slots (-1), several block sizes, empty."""
    specs: list[tuple[str, torch.dtype, int, int, int, int, int, tuple[int, ...]]] = [
        # name, dtype, T, Hkv, D, num_blocks, block_size, padding token indices
        (f"{tag}-basic", dt, 10, 2, 32, 6, 4, (2, 7)) for tag, dt in DTYPES]
    specs += [("fp32-bs16-hkv1", torch.float32, 20, 1, 64, 3, 16, (0,)),
              ("fp32-hkv8-d128", torch.float32, 6, 8, 128, 4, 8, ()),
              ("fp32-all-padding", torch.float32, 4, 2, 32, 2, 4, (0, 1, 2, 3)),
              ("fp32-empty", torch.float32, 0, 2, 32, 2, 4, ())]
    for name, dt, t, hkv, d, nb, bs, pads in specs:
        g = seeded_generator(name)
        key = seeded_randn(g, (t, hkv, d), dt)
        value = seeded_randn(g, (t, hkv, d), dt)
        key_cache = seeded_randn(g, (nb, bs, hkv, d), dt)
        value_cache = seeded_randn(g, (nb, bs, hkv, d), dt)
        slots = torch.randperm(nb * bs, generator=g)[:t].to(torch.int64)
        for i in pads:
            slots[i] = -1
        yield Case(name, (key, value, key_cache, value_cache, slots))
    yield from _reshape_and_cache_layout_cases()
    yield from kv_format_reshape_cases()  # every registered KV-cache format


def cache_layout(key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same cache values in an engine's memory layout; logical shape unchanged.

    - ``"nhd"``: two contiguous ``[num_blocks, block_size, Hkv, D]`` tensors;
    - ``"hnd"``: each stored ``[num_blocks, Hkv, block_size, D]``, viewed permuted;
    - ``"kv-split"``: one ``[num_blocks, 2, block_size, Hkv, D]`` buffer, K = ``kv[:, 0]``,
      V = ``kv[:, 1]``;
    - ``"kv-split-hnd"``: one ``[num_blocks, 2, Hkv, block_size, D]`` buffer, halves permuted;
    - ``"padded-d"``: heads padded to ``D + 8`` elements (``buf[..., :D]``).
    """
    def hnd(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1, 3)

    if layout == "nhd":
        return key_cache.contiguous(), value_cache.contiguous()
    if layout == "hnd":
        return hnd(hnd(key_cache).contiguous()), hnd(hnd(value_cache).contiguous())
    if layout == "kv-split":
        kv = torch.stack((key_cache, value_cache), 1)
        return kv[:, 0], kv[:, 1]
    if layout == "kv-split-hnd":
        kv = torch.stack((hnd(key_cache), hnd(value_cache)), 1)
        return hnd(kv[:, 0]), hnd(kv[:, 1])
    if layout == "padded-d":
        d = key_cache.shape[3]
        pad = key_cache.new_zeros((*key_cache.shape[:3], 8))
        kc = torch.cat((key_cache, pad), 3)[..., :d]
        vc = torch.cat((value_cache, pad), 3)[..., :d]
        return kc, vc
    raise ValueError(f"unknown cache layout {layout!r}; valid: "
                     f"{sorted(CACHE_LAYOUTS)}")


CACHE_LAYOUTS: tuple[str, ...] = ("nhd", "hnd", "kv-split", "kv-split-hnd", "padded-d")
"""Cache memory layouts :func:`cache_layout` makes."""


def _reshape_and_cache_layout_cases() -> Iterator[Case]:
    # engines hand out permuted or sliced views of one cache allocation
    for tag, dt, layout in (("fp32", torch.float32, "hnd"), ("fp32", torch.float32, "kv-split"),
                            ("bf16", torch.bfloat16, "kv-split-hnd"),
                            ("fp16", torch.float16, "padded-d")):
        name = f"{tag}-layout-{layout}"
        g = seeded_generator(name)
        t, hkv, d, nb, bs = 9, 2, 32, 5, 4
        qkv = seeded_randn(g, (t, 3, hkv, d), dt)  # key and value as views of one projection
        key_cache, value_cache = cache_layout(seeded_randn(g, (nb, bs, hkv, d), dt),
                                              seeded_randn(g, (nb, bs, hkv, d), dt), layout)
        slots = torch.randperm(nb * bs, generator=g)[:t].to(torch.int64)
        slots[3] = -1
        yield Case(name, (qkv[:, 1], qkv[:, 2], key_cache, value_cache, slots))


def advance_step_flashattn_cases() -> Iterator[Case]:
    """Cases of ``advance_step_flashattn``: the DESIGN worked example, padding rows, empty."""
    def make(name: str, num_seqs: int, num_queries: int, block_size: int,
             seq_lens: list[int], tables: torch.Tensor) -> Case:
        g = seeded_generator(name)
        garbage = torch.randint(-5, 1000, (4, num_seqs), generator=g, dtype=torch.int64)
        sampled = torch.randint(0, 32000, (num_queries, 1), generator=g, dtype=torch.int64)
        return Case(name, (num_seqs, num_queries, block_size, garbage[0].clone(), sampled,
                           garbage[1].clone(), torch.tensor(seq_lens, dtype=torch.int32),
                           garbage[2].clone(), tables.to(torch.int32)))

    yield make("worked-example", 4, 4, 128, [6, 8, 6, 6], torch.arange(4).view(4, 1))
    g = seeded_generator("tables")
    perm = torch.randperm(64, generator=g).view(8, 8)
    yield make("bs4-multi-block", 8, 8, 4, [0, 3, 4, 5, 12, 17, 30, 31], perm)
    yield make("padding-rows", 8, 5, 4, [1, 7, 8, 9, 20, 2, 2, 2], perm)
    yield make("block-boundary", 4, 4, 16, [16, 32, 48, 0], perm[:4, :4] % 16)
    yield make("no-queries", 3, 0, 8, [3, 4, 5], perm[:3])
    yield make("empty", 0, 0, 16, [], perm[:0])


def register_cache_cases() -> None:
    """Register the generators above, ``<op>_cases`` for op ``<op>`` (replacing earlier
    ones)."""
    for generator in (reshape_and_cache_cases, advance_step_flashattn_cases):
        register_cases(generator.__name__.removesuffix("_cases"), generator, replace=True)
