"""Conformance of the registered KV-cache formats (:mod:`opmux.ops.kv_formats`).

Two layers:

- :func:`check_kv_cache_format` checks a format itself: caches written with the format's
  writer (``reshape_and_cache`` native, i.e. :meth:`~opmux.KVCacheFormat.write`) read back
  through :meth:`~opmux.KVCacheFormat.to_canonical` equal to the canonical write of the same
  tokens, and ``paged_attention`` native on the format equal to native on the canonical cache.
- :func:`kv_format_reshape_cases` / :func:`kv_format_attention_cases` add one case per
  registered non-canonical format to the op's conformance cases, so
  :func:`opmux.testing.check_provider` runs every provider on every format it accepts (a
  provider that declines a format in ``supports_args`` is skipped there).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.ops.kv_formats import (
    CANONICAL_NAME,
    KVCacheFormat,
    get_kv_cache_format,
    list_kv_cache_formats,
)
from opmux.testing.case_table import Case
from opmux.testing.paged_batches import paged_batch
from opmux.testing.seeded import seeded_generator, seeded_randn

__all__ = [
    "check_kv_cache_format",
    "in_format",
    "kv_format_attention_cases",
    "kv_format_reshape_cases",
]


def in_format(fmt: KVCacheFormat, key_cache: torch.Tensor, value_cache: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical ``[blocks, block_size, Hkv, D]`` caches copied into ``fmt`` (allocated with
    its :meth:`~opmux.KVCacheFormat.allocate`, every slot written with its writer)."""
    nb, bs, hkv, d = key_cache.shape
    kc, vc = fmt.allocate(nb, bs, hkv, d, key_cache.dtype, key_cache.device)
    slots = torch.arange(nb * bs, dtype=torch.int64, device=key_cache.device)
    fmt.write(key_cache.reshape(-1, hkv, d), value_cache.reshape(-1, hkv, d), kc, vc, slots)
    return kc, vc


def _formats() -> list[KVCacheFormat]:
    return [get_kv_cache_format(n) for n in list_kv_cache_formats() if n != CANONICAL_NAME]


def _write_inputs(name: str, dtype: torch.dtype, tokens: int, hkv: int, d: int, nb: int,
                  bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = seeded_generator(name)
    key = seeded_randn(g, (tokens, hkv, d), dtype)
    value = seeded_randn(g, (tokens, hkv, d), dtype)
    slots = torch.randperm(nb * bs, generator=g)[:tokens].to(torch.int64)
    if tokens > 2:
        slots[2] = -1
    return key, value, slots


_SHAPES = ((torch.float32, 11, 2, 32, 5, 4), (torch.bfloat16, 9, 4, 64, 3, 16))
"""(dtype, tokens, Hkv, D, num_blocks, block_size) of the format cases."""


def kv_format_reshape_cases() -> Iterator[Case]:
    """A ``reshape_and_cache`` case per registered non-canonical format and dtype."""
    for fmt in _formats():
        for dtype, t, hkv, d, nb, bs in _SHAPES:
            name = f"format-{fmt.name}-{str(dtype).removeprefix('torch.')}"
            key, value, slots = _write_inputs(name, dtype, t, hkv, d, nb, bs)
            g = seeded_generator(name + "-cache")
            kc, vc = in_format(fmt, seeded_randn(g, (nb, bs, hkv, d), dtype),
                               seeded_randn(g, (nb, bs, hkv, d), dtype))
            yield Case(name, (key, value, kc, vc, slots, fmt.name))


def kv_format_attention_cases() -> Iterator[Case]:
    """A ``paged_attention`` case per registered non-canonical format and dtype (prefill and
    decode rows, GQA 2, partial last blocks)."""
    for fmt in _formats():
        for dtype in (torch.float32, torch.bfloat16):
            batch = paged_batch([3, 1, 1], [20, 9, 17], heads=4, kv_heads=2, head_size=32,
                                block_size=8, dtype=dtype,
                                generator=seeded_generator(f"format-{fmt.name}-{dtype}"))
            args = list(batch.args(32 ** -0.5, None, None))
            args[1], args[2] = in_format(fmt, batch.key_cache, batch.value_cache)
            yield Case(f"format-{fmt.name}-{str(dtype).removeprefix('torch.')}",
                       (*args, fmt.name))


def check_kv_cache_format(name: str) -> list[str]:
    """Check format ``name`` against the canonical cache; returns the failures (empty: it
    conforms).

    For fp32 and bf16: tokens written with the catalog's ``reshape_and_cache`` (native, so
    the format's own writer) into zeroed format caches read back through ``to_canonical``
    exactly as the same tokens written into canonical caches; ``paged_attention`` native on
    the format's caches equal to native on the canonical ones.
    """
    fmt = get_kv_cache_format(name)
    failures: list[str] = []
    for dtype, t, hkv, d, nb, bs in _SHAPES:
        try:
            failures += _check_one(fmt, dtype, t, hkv, d, nb, bs)
        except Exception as exc:  # a format that raises fails the check; the others still run
            failures.append(f"{name} {dtype}: raised {type(exc).__name__}: {exc}")
    return failures


def _check_one(fmt: KVCacheFormat, dtype: torch.dtype, t: int, hkv: int, d: int, nb: int,
               bs: int) -> list[str]:
    from opmux.ops.attention import paged_attention
    from opmux.ops.cache import reshape_and_cache

    name = fmt.name
    canon = get_kv_cache_format(CANONICAL_NAME)
    failures: list[str] = []
    key, value, slots = _write_inputs(f"check-{name}-{dtype}", dtype, t, hkv, d, nb, bs)
    kc, vc = fmt.allocate(nb, bs, hkv, d, dtype, "cpu")
    ck, cv = canon.allocate(nb, bs, hkv, d, dtype, "cpu")
    reshape_and_cache.native(key, value, kc, vc, slots, name)
    reshape_and_cache.native(key, value, ck, cv, slots)
    got_k, got_v = fmt.to_canonical(kc, vc)
    if tuple(got_k.shape) != (nb, bs, hkv, d) or tuple(got_v.shape) != (nb, bs, hkv, d):
        return [f"{name} {dtype}: to_canonical gave {list(got_k.shape)} and "
                f"{list(got_v.shape)}, expected {[nb, bs, hkv, d]}"]
    if not (torch.equal(got_k, ck) and torch.equal(got_v, cv)):
        failures.append(f"{name} {dtype}: the format's write read through to_canonical "
                        "differs from the canonical write")
    batch = paged_batch([3, 1], [13, 6], heads=2 * hkv, kv_heads=hkv, head_size=d,
                        block_size=bs, dtype=dtype,
                        generator=seeded_generator(f"check-{name}-{dtype}-attn"))
    args = list(batch.args(d ** -0.5, None, None))
    want = paged_attention.native(*args)
    args[1], args[2] = in_format(fmt, batch.key_cache, batch.value_cache)
    got = paged_attention.native(*args, name)
    try:  # the same values in another memory order: equal up to summation order
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    except AssertionError:
        failures.append(f"{name} {dtype}: paged_attention on the format differs from "
                        f"native on the canonical cache (max abs "
                        f"{(got.float() - want.float()).abs().max().item():.3g})")
    return failures
