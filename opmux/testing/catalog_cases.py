"""Seeded conformance cases for every catalog op, edge cases included.

Sizes stay small so that slow providers (the Triton interpreter, simulators) can run
every case in seconds. Mutated tensors start filled with random values, so a provider that
writes where it must not (a padding slot, a padding row) is caught.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Sequence

import torch

from opmux.ops.rotary import make_cos_sin_cache, make_dual_chunk_caches
from opmux.testing.activation_cases import GATED_SHAPES
from opmux.testing.cases import Case, CaseGenerator, _register_all
from opmux.testing.paged_batches import PagedBatch, paged_batch

__all__ = ["CACHE_LAYOUTS", "attention_case", "cache_layout", "register_catalog_cases"]

DTYPES: tuple[tuple[str, torch.dtype], ...] = (
    ("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))
"""Dtypes every op is checked in, with their case-name prefixes."""


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _randn(g: torch.Generator, shape: Sequence[int], dtype: torch.dtype,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=g) * scale).to(dtype)


# ---------------------------------------------------------------------------- activations
def _activation_cases(with_approximate: bool) -> Iterator[Case]:
    for name, dt, shape in GATED_SHAPES:
        x = _randn(_gen(name), shape, dt, scale=3.0)
        if with_approximate:
            for approx in ("none", "tanh"):
                yield Case(f"{name}-{approx}", (x, approx))
        else:
            yield Case(name, (x,))


def silu_and_mul_cases() -> Iterator[Case]:
    """Cases of ``silu_and_mul``."""
    return _activation_cases(False)


def gelu_and_mul_cases() -> Iterator[Case]:
    """Cases of ``gelu_and_mul`` (both approximations)."""
    return _activation_cases(True)


# ---------------------------------------------------------------------------------- norms
def _norm_inputs() -> Iterator[tuple[str, torch.Tensor, torch.Tensor, float]]:
    specs: list[tuple[str, torch.dtype, tuple[int, ...], float, float]] = [
        (f"{tag}-basic", dt, (13, 128), 1.0, 1e-6) for tag, dt in DTYPES]
    specs += [("fp32-d1000", torch.float32, (4, 1000), 1.0, 1e-6),
              ("fp32-3d", torch.float32, (2, 5, 64), 1.0, 1e-6),
              ("fp32-large-values", torch.float32, (6, 256), 50.0, 1e-6),
              ("fp32-eps1e-2-small-values", torch.float32, (6, 96), 1e-2, 1e-2),
              ("bf16-d4096", torch.bfloat16, (3, 4096), 1.0, 1e-5),
              ("fp16-d2048", torch.float16, (3, 2048), 1.0, 1e-5),
              ("fp32-one-row", torch.float32, (1, 32), 1.0, 1e-6),
              ("fp32-empty", torch.float32, (0, 64), 1.0, 1e-6)]
    for name, dt, shape, scale, eps in specs:
        g = _gen(name)
        x = _randn(g, shape, dt, scale)
        weight = (torch.randn(shape[-1], generator=g) * 0.5 + 1.0).to(dt)
        yield name, x, weight, eps


def rms_norm_cases() -> Iterator[Case]:
    """Cases of ``rms_norm``."""
    for name, x, weight, eps in _norm_inputs():
        yield Case(name, (x, weight, eps))


def fused_add_rms_norm_cases() -> Iterator[Case]:
    """Cases of ``fused_add_rms_norm``."""
    for name, x, weight, eps in _norm_inputs():
        residual = _randn(_gen(name + "-residual"), x.shape, x.dtype, 2.0)
        yield Case(name, (x, residual, weight, eps))


# --------------------------------------------------------------------------------- rotary
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
        g = _gen(name)
        positions = torch.randint(0, max_pos, (t,), generator=g, dtype=torch.int64)
        if t > 1:
            positions[0], positions[-1] = 0, max_pos - 1
        query = _randn(g, (t, h * d), dt)
        key = _randn(g, (t, hkv * d), dt)
        cache = make_cos_sin_cache(max_pos, rot, dtype=dt)
        yield Case(name, (positions, query, key, cache, d, neox))
    g = _gen("fp32-3d-layout")
    positions = torch.randint(0, 32, (5,), generator=g, dtype=torch.int64)
    yield Case("fp32-3d-layout", (positions, _randn(g, (5, 4, 32), torch.float32),
                                  _randn(g, (5, 2, 32), torch.float32),
                                  make_cos_sin_cache(32, 32), 32, True))
    # vLLM's layouts (#19): positions [batch, seq] with queries [batch, seq, H*D] or
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
        g = _gen(name)
        positions = torch.randint(0, 40, pshape, generator=g, dtype=torch.int64)
        q_tail = (heads, d) if per_head else (heads * d,)
        k_tail = (1, d) if per_head else (d,)
        yield Case(name, (positions, _randn(g, (*pshape, *q_tail), dt),
                          _randn(g, (*pshape, *k_tail), dt),
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
        g = _gen(name)
        x = _randn(g, shape, dt, scale=2.0)
        seq, half = shape[-3], shape[-1] // 2
        angles = torch.rand(seq, half, generator=g) * 6.3
        for style, neox in (("neox", True), ("gptj", False)):
            for fp32 in (False, True):
                yield Case(f"{name}-{style}{'-fp32-compute' if fp32 else ''}",
                           (x, angles.cos().to(table_dt), angles.sin().to(table_dt), neox, fp32))
    g = _gen("fp32-strided")
    base = _randn(g, (4, 9, 32), torch.float32)  # [H, S, D] seen as a transposed [S, H, D]
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
        g = _gen(name)
        caches = make_dual_chunk_caches(chunk_size, local_size, max_pos, rot, dtype=dt)
        hi = max_pos - 20 if with_offsets else max_pos
        positions = torch.randint(0, hi, (t,), generator=g, dtype=torch.int64)
        if t > 1:
            positions[0], positions[-1] = 0, hi - 1
        offsets = (torch.randint(0, 20, (t,), generator=g, dtype=torch.int64)
                   if with_offsets else None)
        query = _randn(g, (t, h * d), dt)
        key = _randn(g, (t, hkv * d), dt)
        yield Case(name, (positions, query, key, *caches, d, neox, offsets))
    g = _gen("fp32-strided-int32")
    qkv = _randn(g, (7, (4 + 2 + 2) * 32), torch.float32)  # query and key sliced from qkv
    positions = torch.randint(0, max_pos, (7,), generator=g, dtype=torch.int32)
    yield Case("fp32-strided-int32", (positions, qkv[:, :128], qkv[:, 128:192],
                                      *make_dual_chunk_caches(chunk_size, local_size, max_pos,
                                                              32), 32, True, None))


# ---------------------------------------------------------------------------------- cache
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
        g = _gen(name)
        key = _randn(g, (t, hkv, d), dt)
        value = _randn(g, (t, hkv, d), dt)
        key_cache = _randn(g, (nb, bs, hkv, d), dt)
        value_cache = _randn(g, (nb, bs, hkv, d), dt)
        slots = torch.randperm(nb * bs, generator=g)[:t].to(torch.int64)
        for i in pads:
            slots[i] = -1
        yield Case(name, (key, value, key_cache, value_cache, slots))
    yield from _reshape_and_cache_layout_cases()


def cache_layout(key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same cache values in an engine's memory layout (#19); logical shape unchanged.

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
    # #19: engines hand out permuted or sliced views of one cache allocation
    for tag, dt, layout in (("fp32", torch.float32, "hnd"), ("fp32", torch.float32, "kv-split"),
                            ("bf16", torch.bfloat16, "kv-split-hnd"),
                            ("fp16", torch.float16, "padded-d")):
        name = f"{tag}-layout-{layout}"
        g = _gen(name)
        t, hkv, d, nb, bs = 9, 2, 32, 5, 4
        qkv = _randn(g, (t, 3, hkv, d), dt)  # key and value as views of one projection
        key_cache, value_cache = cache_layout(_randn(g, (nb, bs, hkv, d), dt),
                                              _randn(g, (nb, bs, hkv, d), dt), layout)
        slots = torch.randperm(nb * bs, generator=g)[:t].to(torch.int64)
        slots[3] = -1
        yield Case(name, (qkv[:, 1], qkv[:, 2], key_cache, value_cache, slots))


def advance_step_flashattn_cases() -> Iterator[Case]:
    """Cases of ``advance_step_flashattn``: the DESIGN worked example, padding rows, empty."""
    def make(name: str, num_seqs: int, num_queries: int, block_size: int,
             seq_lens: list[int], tables: torch.Tensor) -> Case:
        g = _gen(name)
        garbage = torch.randint(-5, 1000, (4, num_seqs), generator=g, dtype=torch.int64)
        sampled = torch.randint(0, 32000, (num_queries, 1), generator=g, dtype=torch.int64)
        return Case(name, (num_seqs, num_queries, block_size, garbage[0].clone(), sampled,
                           garbage[1].clone(), torch.tensor(seq_lens, dtype=torch.int32),
                           garbage[2].clone(), tables.to(torch.int32)))

    yield make("worked-example", 4, 4, 128, [6, 8, 6, 6], torch.arange(4).view(4, 1))
    g = _gen("tables")
    perm = torch.randperm(64, generator=g).view(8, 8)
    yield make("bs4-multi-block", 8, 8, 4, [0, 3, 4, 5, 12, 17, 30, 31], perm)
    yield make("padding-rows", 8, 5, 4, [1, 7, 8, 9, 20, 2, 2, 2], perm)
    yield make("block-boundary", 4, 4, 16, [16, 32, 48, 0], perm[:4, :4] % 16)
    yield make("no-queries", 3, 0, 8, [3, 4, 5], perm[:3])
    yield make("empty", 0, 0, 16, [], perm[:0])


# ---------------------------------------------------------------- gemma / gated norms
def gemma_rms_norm_cases() -> Iterator[Case]:
    """Cases of ``gemma_rms_norm`` (the norm cases, plus an fp32 weight on bf16 rows)."""
    for name, x, weight, eps in _norm_inputs():
        yield Case(name, (x, weight - 1.0, eps))
    g = _gen("bf16-fp32-weight")
    yield Case("bf16-fp32-weight", (_randn(g, (5, 256), torch.bfloat16),
                                    _randn(g, (256,), torch.float32, 0.3), 1e-6))


def gemma_fused_add_rms_norm_cases() -> Iterator[Case]:
    """Cases of ``gemma_fused_add_rms_norm``."""
    for name, x, weight, eps in _norm_inputs():
        residual = _randn(_gen(name + "-residual"), x.shape, x.dtype, 2.0)
        yield Case(name, (x, residual, weight - 1.0, eps))


def rms_norm_gated_cases() -> Iterator[Case]:
    """Cases of ``rms_norm_gated``: no gate / gate before / after the norm, groups, sigmoid."""
    specs: list[tuple[str, torch.dtype, tuple[int, ...], str, int | None, str]] = []
    for tag, dt in DTYPES:
        for gate in ("none", "before", "after"):
            specs.append((f"{tag}-gate-{gate}", dt, (7, 256), gate, None, "swish"))
        specs.append((f"{tag}-groups64-after", dt, (5, 256), "after", 64, "silu"))
    specs += [("fp32-groups32-before-sigmoid", torch.float32, (4, 128), "before", 32, "sigmoid"),
              ("fp32-3d-groups-none", torch.float32, (2, 3, 96), "none", 48, "swish"),
              ("bf16-d2048-groups256", torch.bfloat16, (3, 2048), "after", 256, "swish"),
              ("fp32-odd-d", torch.float32, (3, 45), "before", None, "swish"),
              ("fp32-empty", torch.float32, (0, 64), "after", 16, "swish")]
    for name, dt, shape, gate, group, act in specs:
        g = _gen(name)
        x = _randn(g, shape, dt)
        z = None if gate == "none" else _randn(g, shape, dt, 2.0)
        weight = (torch.randn(shape[-1], generator=g) * 0.5 + 1.0).to(dt)
        yield Case(name, (x, weight, z, 1e-5, group, gate == "before", act))
    g = _gen("bf16-fp32-gate")
    yield Case("bf16-fp32-gate-fp32-weight",
               (_randn(g, (4, 64), torch.bfloat16), _randn(g, (64,), torch.float32),
                _randn(g, (4, 64), torch.float32), 1e-6, None, False, "swish"))


# -------------------------------------------------------------------------- quant_fp8
def quant_fp8_cases() -> Iterator[Case]:
    """Cases of ``quant_fp8``, compared exactly: every mode, zero rows, wide ranges."""
    def make(name: str, dt: torch.dtype, shape: tuple[int, ...], *args: object) -> Case:
        g = _gen(name)
        x = _randn(g, shape, dt, 4.0)
        if x.dim() >= 2 and x.shape[-2] > 2 and x.shape[-1] > 0:
            x[..., 1, :] = 0  # an all-zero row: the scale's lower bound
            x[..., 2, :] *= 1e3  # a wide row
        return Case(name, (x, *args), atol=0.0, rtol=0.0)

    for tag, dt in DTYPES:
        yield make(f"{tag}-dynamic-tensor", dt, (9, 256))
        yield make(f"{tag}-dynamic-token", dt, (9, 256), None, True)
        yield make(f"{tag}-dynamic-group128", dt, (6, 512), None, False, None, 128)
        yield make(f"{tag}-static-tensor", dt, (5, 64), torch.tensor(0.02))
    yield make("fp32-dynamic-token-ub", torch.float32, (8, 96), None, True,
               torch.tensor([0.5]))
    yield make("fp32-dynamic-group-ragged-3d", torch.float32, (2, 4, 200), None, False, None, 64)
    yield make("bf16-dynamic-group-ue8m0", torch.bfloat16, (5, 256), None, False, None, 128,
               True)
    yield make("fp32-dynamic-group1", torch.float32, (3, 16), None, False, None, 1)
    yield make("fp32-dynamic-3d-token", torch.float32, (2, 3, 40), None, True)
    yield make("fp32-dynamic-1d", torch.float32, (100,))
    def scales(name: str, shape: tuple[int, int], spread: float, low: float) -> torch.Tensor:
        return torch.rand(shape, generator=_gen(name + "-scale")) * spread + low

    yield make("fp32-static-token", torch.float32, (6, 80),
               scales("token", (6, 1), 0.1, 1e-3))
    yield make("fp32-static-channel", torch.float32, (6, 80),
               scales("channel", (1, 80), 0.1, 1e-3))
    yield make("bf16-static-block", torch.bfloat16, (8, 256),
               scales("block", (4, 2), 0.05, 1e-3))
    yield make("fp32-static-3d-group", torch.float32, (2, 6, 64),
               scales("3d-group", (3, 4), 1.0, 0.01))
    yield make("fp32-static-1elem-2d", torch.float32, (4, 32), torch.tensor([[0.5]]))
    yield make("fp32-static-empty", torch.float32, (0, 32), torch.tensor([1.0]))
    yield make("fp32-dynamic-token-empty", torch.float32, (0, 32), None, True)


# ------------------------------------------------------------------------------ attention
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
                        spare_blocks=spare_blocks, generator=_gen(name))
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
    # #19: caches that are permuted or sliced views of one allocation
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


#: the case generators of the ops above, by op name
_GENERATORS: dict[str, CaseGenerator] = {
    "silu_and_mul": silu_and_mul_cases,
    "gelu_and_mul": gelu_and_mul_cases,
    "rms_norm": rms_norm_cases,
    "fused_add_rms_norm": fused_add_rms_norm_cases,
    "rotary_embedding": rotary_embedding_cases,
    "reshape_and_cache": reshape_and_cache_cases,
    "advance_step_flashattn": advance_step_flashattn_cases,
    "paged_attention": paged_attention_cases,
    "apply_rotary_emb": apply_rotary_emb_cases,
    "dual_chunk_rotary_embedding": dual_chunk_rotary_embedding_cases,
    "gemma_rms_norm": gemma_rms_norm_cases,
    "gemma_fused_add_rms_norm": gemma_fused_add_rms_norm_cases,
    "rms_norm_gated": rms_norm_gated_cases,
    "quant_fp8": quant_fp8_cases,
}


def register_catalog_cases() -> None:
    """Register the generators above for the catalog ops (idempotent)."""
    _register_all(_GENERATORS)
    from opmux.testing.moe_cases import register_moe_cases
    from opmux.testing.xla_cases import register_xla_cases

    register_moe_cases()
    register_xla_cases()
    from opmux.testing.communication_cases import register_communication_cases

    register_communication_cases()
    from opmux.testing.activation_cases import register_activation_cases

    register_activation_cases()
    from opmux.testing.attention_extra_cases import register_attention_extra_cases

    register_attention_extra_cases()
    from opmux.testing.ssm_cases import register_ssm_cases

    register_ssm_cases()
    from opmux.testing.ssd_cases import register_ssd_cases

    register_ssd_cases()


register_catalog_cases()
