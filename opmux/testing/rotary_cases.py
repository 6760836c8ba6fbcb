"""Seeded conformance cases of the rotary ops (:mod:`opmux.ops.rotary`): ``rotary_embedding``,
``apply_rotary_emb`` and ``dual_chunk_rotary_embedding``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.ops.rotary import make_cos_sin_cache, make_dual_chunk_caches
from opmux.testing.case_table import Case, register_cases
from opmux.testing.seeded import DTYPES, seeded_generator, seeded_randn

__all__ = [
    "apply_rotary_emb_cases",
    "dual_chunk_rotary_embedding_cases",
    "register_rotary_cases",
    "rotary_embedding_cases",
]


def rotary_embedding_cases() -> Iterator[Case]:
    """Cases of ``rotary_embedding``: neox/gptj, rot < head_size, GQA/MQA, 3-d layout."""
    specs: list[tuple[str, torch.dtype, int, int, int, int, int, int, bool]] = []
    for tag, dt in DTYPES:
        for style, neox in (("neox", True), ("gptj", False)):
            # name, dtype, T, H, Hkv, D, rot, max_pos, is_neox
            specs.append((f"{tag}-{style}", dt, 7, 4, 2, 64, 64, 64, neox))
    specs += [("fp32-neox-partial-rot", torch.float32, 6, 4, 4, 64, 32, 32, True),
              ("fp32-gptj-partial-rot", torch.float32, 6, 4, 4, 64, 16, 32, False),
              ("bf16-neox-partial-rot", torch.bfloat16, 6, 2, 1, 128, 64, 64, True),
              ("fp32-mqa-d128", torch.float32, 5, 8, 1, 128, 128, 128, True),
              ("fp32-long-cache", torch.float32, 9, 2, 2, 32, 32, 4096, True),
              ("fp32-one-token", torch.float32, 1, 2, 1, 32, 32, 16, False),
              ("fp32-empty", torch.float32, 0, 2, 2, 32, 32, 16, True)]
    for name, dt, t, h, hkv, d, rot, max_pos, neox in specs:
        g = seeded_generator(name)
        positions = torch.randint(0, max_pos, (t,), generator=g, dtype=torch.int64)
        if t > 1:
            positions[0], positions[-1] = 0, max_pos - 1
        query = seeded_randn(g, (t, h * d), dt)
        key = seeded_randn(g, (t, hkv * d), dt)
        cache = make_cos_sin_cache(max_pos, rot, dtype=dt)
        yield Case(name, (positions, query, key, cache, d, neox))
    g = seeded_generator("fp32-3d-layout")
    positions = torch.randint(0, 32, (5,), generator=g, dtype=torch.int64)
    yield Case("fp32-3d-layout", (positions, seeded_randn(g, (5, 4, 32), torch.float32),
                                  seeded_randn(g, (5, 2, 32), torch.float32),
                                  make_cos_sin_cache(32, 32), 32, True))
    # vLLM's layouts: positions [batch, seq] with queries [batch, seq, H*D] or
    # [batch, seq, H, D]; per-head [T, H, D] with a partial rotary width (strided views of
    # every layout come from opmux.testing.views)
    layouts: list[tuple[str, torch.dtype, tuple[int, ...], int, bool, int, int, bool]] = [
        # name, dtype, positions shape, heads, per-head, D, rot, is_neox
        ("fp32-batch-seq-flat", torch.float32, (2, 3), 4, False, 32, 32, True),
        ("fp32-batch-seq-per-head-gptj", torch.float32, (2, 3), 4, True, 32, 16, False),
        ("bf16-batch-seq-per-head", torch.bfloat16, (3, 2), 2, True, 64, 64, True),
        ("fp32-per-head-d48-rot32", torch.float32, (5,), 3, True, 48, 32, True),
        ("fp32-batch-seq-flat-gptj-partial", torch.float32, (2, 2), 2, False, 32, 8, False),
    ]
    for name, dt, pshape, heads, per_head, d, rot, neox in layouts:
        g = seeded_generator(name)
        positions = torch.randint(0, 40, pshape, generator=g, dtype=torch.int64)
        q_tail = (heads, d) if per_head else (heads * d,)
        k_tail = (1, d) if per_head else (d,)
        yield Case(name, (positions, seeded_randn(g, (*pshape, *q_tail), dt),
                          seeded_randn(g, (*pshape, *k_tail), dt),
                          make_cos_sin_cache(40, rot, dtype=dt), d, neox))


def apply_rotary_emb_cases() -> Iterator[Case]:
    """Cases of ``apply_rotary_emb``: neox/gptj, fp32 compute on/off, 3-d and 4-d ``x``, fp32
    tables with half-precision ``x``, a transposed ``x`` and tables sliced from a cache."""
    specs: list[tuple[str, torch.dtype, tuple[int, ...], torch.dtype]] = []
    for tag, dt in DTYPES:
        specs.append((f"{tag}", dt, (7, 4, 64), dt))
    specs += [("bf16-fp32-tables", torch.bfloat16, (2, 5, 3, 32), torch.float32),
              ("fp16-fp32-tables-4d", torch.float16, (3, 4, 2, 16), torch.float32),
              ("fp32-4d-d128", torch.float32, (2, 6, 2, 128), torch.float32),
              ("fp32-one-position", torch.float32, (1, 3, 8), torch.float32),
              ("fp32-empty", torch.float32, (0, 2, 16), torch.float32)]
    for name, dt, shape, table_dt in specs:
        g = seeded_generator(name)
        x = seeded_randn(g, shape, dt, scale=2.0)
        seq, half = shape[-3], shape[-1] // 2
        angles = torch.rand(seq, half, generator=g) * 6.3
        for style, neox in (("neox", True), ("gptj", False)):
            for fp32 in (False, True):
                yield Case(f"{name}-{style}{'-fp32-compute' if fp32 else ''}",
                           (x, angles.cos().to(table_dt), angles.sin().to(table_dt), neox, fp32))
    g = seeded_generator("fp32-strided")
    base = seeded_randn(g, (4, 9, 32), torch.float32)  # [H, S, D] seen as a transposed [S, H, D]
    cache = make_cos_sin_cache(16, 32)[3:12]
    cos, sin = cache[:, :16], cache[:, 16:]  # row stride 32: views into one cache
    for style, neox in (("neox", True), ("gptj", False)):
        yield Case(f"fp32-strided-{style}", (base.transpose(0, 1), cos, sin, neox, False))


def dual_chunk_rotary_embedding_cases() -> Iterator[Case]:
    """Cases of ``dual_chunk_rotary_embedding``: neox/gptj, partial rot, offsets, GQA,
    positions across several chunks, int32 positions, a strided query, one and no token."""
    specs: list[tuple[str, torch.dtype, int, int, int, int, int, bool, bool]] = []
    for tag, dt in DTYPES:
        for style, neox in (("neox", True), ("gptj", False)):
            # name, dtype, T, H, Hkv, D, rot, is_neox, offsets
            specs.append((f"{tag}-{style}", dt, 11, 4, 2, 64, 64, neox, False))
    specs += [("fp32-neox-partial-rot-offsets", torch.float32, 9, 2, 1, 64, 32, True, True),
              ("fp32-gptj-partial-rot", torch.float32, 6, 2, 2, 64, 16, False, False),
              ("bf16-neox-offsets", torch.bfloat16, 8, 2, 2, 32, 32, True, True),
              ("fp32-one-token", torch.float32, 1, 2, 1, 32, 32, False, False),
              ("fp32-empty", torch.float32, 0, 2, 2, 32, 32, True, False)]
    chunk_size, local_size, max_pos = 24, 8, 96
    for name, dt, t, h, hkv, d, rot, neox, with_offsets in specs:
        g = seeded_generator(name)
        caches = make_dual_chunk_caches(chunk_size, local_size, max_pos, rot, dtype=dt)
        hi = max_pos - 20 if with_offsets else max_pos
        positions = torch.randint(0, hi, (t,), generator=g, dtype=torch.int64)
        if t > 1:
            positions[0], positions[-1] = 0, hi - 1
        offsets = (torch.randint(0, 20, (t,), generator=g, dtype=torch.int64)
                   if with_offsets else None)
        query = seeded_randn(g, (t, h * d), dt)
        key = seeded_randn(g, (t, hkv * d), dt)
        yield Case(name, (positions, query, key, *caches, d, neox, offsets))
    g = seeded_generator("fp32-strided-int32")
    qkv = seeded_randn(g, (7, (4 + 2 + 2) * 32), torch.float32)  # query and key sliced from qkv
    positions = torch.randint(0, max_pos, (7,), generator=g, dtype=torch.int32)
    yield Case("fp32-strided-int32", (positions, qkv[:, :128], qkv[:, 128:192],
                                      *make_dual_chunk_caches(chunk_size, local_size, max_pos,
                                                              32), 32, True, None))


def register_rotary_cases() -> None:
    """Register the generators above, ``<op>_cases`` for op ``<op>`` (replacing earlier
    ones)."""
    for generator in (rotary_embedding_cases, apply_rotary_emb_cases,
                      dual_chunk_rotary_embedding_cases):
        register_cases(generator.__name__.removesuffix("_cases"), generator, replace=True)
