"""Input checks of the attention ops (:mod:`opmux.ops.attention`): ``paged_attention``,
``encoder_attention``, ``concat_and_cache_mla`` and ``mla_attention``.

Same contract as every module of :mod:`opmux.ops.checks`: each ``check_<op>`` takes the op's
arguments plus ``provider`` and ``read_data`` and raises :class:`opmux.OpInputError` (built
by :func:`~opmux.ops.checks.input_errors.input_error`) naming op, provider, argument, expected
and got, before anything is written. Index values are read only when ``read_data`` is true
and the tensors hold data (not meta, not fake, not traced).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from opmux.ops.checks.cache import check_cache_pair
from opmux.ops.checks.input_errors import input_error, shape_text, value_text
from opmux.ops.checks.single_arguments import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_rank,
    check_real,
    check_same_device,
    check_tensor,
)
from opmux.ops.checks.symbolic import has_data, require

__all__ = [
    "check_concat_and_cache_mla",
    "check_concat_and_cache_mla_values",
    "check_encoder_attention",
    "check_encoder_attention_values",
    "check_mla_attention",
    "check_mla_attention_values",
    "check_paged_attention",
    "check_paged_attention_values",
    "check_paged_lens",
]


# ---------------------------------------------------------------------------- paged attention
def check_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                          block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                          scale: float, sliding_window: int | None = None,
                          soft_cap: float | None = None, *, provider: str = "native",
                          read_data: bool = True) -> None:
    """Validate ``paged_attention``; reads the index tensors when ``read_data``.

    Static checks: the caches as in :func:`check_reshape_and_cache` (any strides, overlap
    allowed since they are only read); ``query [T, H, D]`` in the caches' dtype with
    ``H % Hkv == 0``; int32/int64 index tensors of matching lengths; ``scale`` a real
    number; ``sliding_window`` None or a positive int; ``soft_cap`` None or a positive float
    (0 and negative values are errors, never "none": one meaning everywhere).

    Value checks: ``query_start_loc`` starts at 0, never decreases and ends at most at T;
    ``0 <= kv_len <= max_blocks*block_size``; ``q_len <= kv_len``; every block a sequence
    reads lies in ``[0, num_blocks)``.
    """
    op = "paged_attention"
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            sliding_window, soft_cap)
    _static_paged_attention(op, provider, *args)
    if read_data:
        check_paged_attention_values(query, key_cache, block_tables, seq_lens,
                                     query_start_loc, provider=provider)


def check_paged_attention_values(query: Tensor, key_cache: Tensor, block_tables: Tensor,
                                 seq_lens: Tensor, query_start_loc: Tensor, *,
                                 provider: str = "native") -> None:
    """The value checks of :func:`check_paged_attention` alone (its static checks passed);
    nothing when the index tensors hold no data."""
    if not has_data(block_tables, seq_lens, query_start_loc):
        return
    op = "paged_attention"
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_tokens = query.shape[0]
    _offsets(op, provider, "query_start_loc", qsl, num_tokens)
    check_paged_lens(op, provider, qsl, lens, block_tables, key_cache.shape[1],
                     key_cache.shape[0])


def _static_paged_attention(op: str, provider: str, query: Tensor, key_cache: Tensor,
                            value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                            query_start_loc: Tensor, scale: float, sliding_window: int | None,
                            soft_cap: float | None) -> None:
    query = check_tensor(op, provider, "query", query)
    _, _, hkv, d = check_cache_pair(op, provider, key_cache, value_cache)
    check_rank(op, provider, "query", query, 3, "[T, H, D]")
    if query.dtype != key_cache.dtype:
        raise input_error(op, provider, "query", f"the cache's dtype {key_cache.dtype}",
                          query.dtype)
    # sizes stay symbolic under torch.compile: int() would specialise them
    _, heads, head_size = query.shape
    require(head_size == d, op, provider, "query",
            lambda: f"head size {d} (the cache's D) in dim 2", lambda: shape_text(query))
    require(heads % hkv == 0, op, provider, "query",
            lambda: f"a head count divisible by the cache's Hkv={hkv}", lambda: f"H={heads}")
    block_tables = check_tensor(op, provider, "block_tables", block_tables)
    seq_lens = check_tensor(op, provider, "seq_lens", seq_lens)
    query_start_loc = check_tensor(op, provider, "query_start_loc", query_start_loc)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        check_dtype(op, provider, name, t, INDEX_DTYPES)
    check_rank(op, provider, "block_tables", block_tables, 2, "[S, max_blocks]")
    num_seqs = block_tables.shape[0]
    check_rank(op, provider, "seq_lens", seq_lens, 1, "[S] (block_tables' S)")
    require(seq_lens.shape[0] == num_seqs, op, provider, "seq_lens",
            lambda: f"shape [{num_seqs}] (block_tables' S)", lambda: shape_text(seq_lens))
    check_rank(op, provider, "query_start_loc", query_start_loc, 1, "[S + 1]")
    require(query_start_loc.shape[0] == num_seqs + 1, op, provider, "query_start_loc",
            lambda: f"shape [{num_seqs + 1}] (S + 1)", lambda: shape_text(query_start_loc))
    check_real(op, provider, "scale", scale)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window,
                                                              (int, torch.SymInt)):
            raise input_error(op, provider, "sliding_window", "None or a positive int",
                              value_text(sliding_window))
        require(sliding_window > 0, op, provider, "sliding_window", "None or a positive int",
                sliding_window)
    if soft_cap is not None:
        check_real(op, provider, "soft_cap", soft_cap)
        require(soft_cap > 0, op, provider, "soft_cap", "None or a positive float", soft_cap)
    # the cache (the engine's persistent state) sets the device the others must match
    check_same_device(op, provider, key_cache, query=query, block_tables=block_tables,
                      seq_lens=seq_lens, query_start_loc=query_start_loc)


def check_paged_lens(op: str, provider: str, qsl: list[int], lens: list[int],
                     block_tables: Tensor, bs: int, nb: int) -> None:
    """Check a paged batch's data: every ``seq_lens`` value fits its block-table row and
    covers its queries (``qsl``: the query offsets, already checked), and the block ids in
    use are in ``[0, nb)``."""
    max_blocks = int(block_tables.shape[1])
    for i, kv_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        if kv_len < 0 or kv_len > max_blocks * bs:
            raise input_error(op, provider, "seq_lens", f"values in [0, {max_blocks * bs}] "
                              f"(max_blocks*block_size) for sequence {i}", kv_len)
        if kv_len < q_len:
            raise input_error(op, provider, "seq_lens", f"kv_len >= q_len={q_len} (the "
                              f"queries are the last tokens of the sequence) for sequence {i}",
                              kv_len)
    needed = [(n + bs - 1) // bs for n in lens]
    if lens and max(needed) > 0:
        cols = torch.arange(max_blocks, device=block_tables.device)
        used = cols.unsqueeze(0) < torch.tensor(needed, device=block_tables.device).unsqueeze(1)
        # unused columns read as block 0 (valid), so they never hide a bad id in use
        ids = torch.where(used, block_tables, 0)
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= nb:
            raise input_error(op, provider, "block_tables",
                              f"block ids in [0, {nb}) (num_blocks) for the blocks in use",
                              f"ids in [{lo}, {hi}]")


def _tensor(op: str, provider: str, name: str, t: object, rank: int, layout: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise input_error(op, provider, name, "a torch.Tensor", type(t).__name__)
    if t.dim() != rank:
        raise input_error(op, provider, name, f"a {rank}-d tensor {layout}",
                          f"shape {list(t.shape)}")
    return t


def _float(op: str, provider: str, name: str, t: Tensor, dtype: torch.dtype | None) -> None:
    if dtype is None and t.dtype not in FLOAT_DTYPES:
        raise input_error(op, provider, name, "a floating tensor (float32/float16/bfloat16)",
                          t.dtype)
    if dtype is not None and t.dtype != dtype:
        raise input_error(op, provider, name, f"dtype {dtype} (as the first tensor)", t.dtype)


def _index(op: str, provider: str, name: str, t: Tensor, device: torch.device) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise input_error(op, provider, name, "dtype int32 or int64", t.dtype)
    if t.device != device:
        raise input_error(op, provider, name, f"device {device}", t.device)


def _offsets(op: str, provider: str, name: str, offsets: list[int], total: int) -> None:
    if (offsets[0] != 0 or any(b < a for a, b in itertools.pairwise(offsets))
            or offsets[-1] > total):
        raise input_error(op, provider, name,
                          f"non-decreasing offsets from 0 to at most T={total}", offsets)


# -------------------------------------------------------------------------- encoder attention
def check_encoder_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                            max_seqlen: int | None, scale: float, *, provider: str = "native",
                            read_data: bool = True) -> None:
    """Validate ``encoder_attention``; reads ``cu_seqlens`` when ``read_data``."""
    op = "encoder_attention"
    q = _tensor(op, provider, "q", q, 3, "[T, H, D]")
    _float(op, provider, "q", q, None)
    k = _tensor(op, provider, "k", k, 3, "[T, Hkv, D]")
    v = _tensor(op, provider, "v", v, 3, "[T, Hkv, D]")
    tokens, heads, d = (int(s) for s in q.shape)
    for name, t in (("k", k), ("v", v)):
        _float(op, provider, name, t, q.dtype)
        if t.device != q.device:
            raise input_error(op, provider, name, f"device {q.device}", t.device)
    if k.shape[0] != tokens or k.shape[2] != d or k.shape[1] == 0 or heads % k.shape[1]:
        raise input_error(op, provider, "k", f"[{tokens}, Hkv, {d}] with Hkv dividing "
                          f"H={heads}", f"shape {list(k.shape)}")
    if v.shape != k.shape:
        raise input_error(op, provider, "v", f"k's shape {list(k.shape)}",
                          f"shape {list(v.shape)}")
    cu_seqlens = _tensor(op, provider, "cu_seqlens", cu_seqlens, 1, "[S + 1]")
    _index(op, provider, "cu_seqlens", cu_seqlens, q.device)
    if cu_seqlens.shape[0] < 1:
        raise input_error(op, provider, "cu_seqlens", "at least one offset (S + 1 >= 1)",
                          "shape [0]")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or max_seqlen < 0):
        raise input_error(op, provider, "max_seqlen", "None or an int >= 0", max_seqlen)
    if not scale > 0:
        raise input_error(op, provider, "scale", "a positive float", scale)
    if read_data:
        check_encoder_attention_values(q, cu_seqlens, max_seqlen, provider=provider)


def check_encoder_attention_values(q: Tensor, cu_seqlens: Tensor, max_seqlen: int | None, *,
                                   provider: str = "native") -> None:
    """The value checks of :func:`check_encoder_attention` alone (its static checks passed):
    ``cu_seqlens`` runs from 0 to at most T without decreasing, and ``max_seqlen`` bounds the
    sequence lengths; nothing when ``cu_seqlens`` holds no data."""
    if not has_data(cu_seqlens):
        return
    op = "encoder_attention"
    offsets = cu_seqlens.tolist()
    _offsets(op, provider, "cu_seqlens", offsets, int(q.shape[0]))
    longest = max((b - a for a, b in itertools.pairwise(offsets)), default=0)
    if max_seqlen is not None and longest > max_seqlen:
        raise input_error(op, provider, "max_seqlen",
                          f"an upper bound of the sequence lengths (>= {longest})", max_seqlen)


# -------------------------------------------------------------------------------- MLA cache
def _latent_cache(op: str, provider: str, kv_cache: object) -> Tensor:
    cache = _tensor(op, provider, "kv_cache", kv_cache, 3,
                    "[num_blocks, block_size, kv_lora_rank + rope_dim]")
    _float(op, provider, "kv_cache", cache, None)
    return cache


def check_concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                               slot_mapping: Tensor, *, provider: str = "native",
                               read_data: bool = True) -> None:
    """Validate ``concat_and_cache_mla``; reads ``slot_mapping`` (range) when ``read_data``."""
    op = "concat_and_cache_mla"
    cache = _latent_cache(op, provider, kv_cache)
    if not cache.is_contiguous():
        raise input_error(op, provider, "kv_cache", "a contiguous tensor",
                          f"strides {list(cache.stride())}")
    width = int(cache.shape[2])
    kv_c = _tensor(op, provider, "kv_c", kv_c, 2, "[T, kv_lora_rank]")
    k_pe = _tensor(op, provider, "k_pe", k_pe, 2, "[T, rope_dim]")
    tokens = int(kv_c.shape[0])
    if k_pe.shape[0] != tokens or kv_c.shape[1] + k_pe.shape[1] != width:
        raise input_error(op, provider, "k_pe", f"[{tokens}, {width - kv_c.shape[1]}] (T of "
                          f"kv_c, cache width {width} minus kv_lora_rank)",
                          f"shape {list(k_pe.shape)}")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        _float(op, provider, name, t, cache.dtype)
        if t.device != cache.device:
            raise input_error(op, provider, name, f"device {cache.device}", t.device)
    slot_mapping = _tensor(op, provider, "slot_mapping", slot_mapping, 1, "[T]")
    if slot_mapping.dtype != torch.int64:
        raise input_error(op, provider, "slot_mapping", "dtype int64", slot_mapping.dtype)
    if slot_mapping.device != cache.device:
        raise input_error(op, provider, "slot_mapping", f"device {cache.device}",
                          slot_mapping.device)
    if slot_mapping.shape[0] != tokens:
        raise input_error(op, provider, "slot_mapping", f"shape [{tokens}] (one slot per "
                          "token)", f"shape {list(slot_mapping.shape)}")
    if read_data:
        check_concat_and_cache_mla_values(kv_cache, slot_mapping, provider=provider)


def check_concat_and_cache_mla_values(kv_cache: Tensor, slot_mapping: Tensor, *,
                                      provider: str = "native") -> None:
    """The value check of :func:`check_concat_and_cache_mla` alone (its static checks
    passed): every slot is -1 or in the cache; nothing when ``slot_mapping`` holds no data."""
    op = "concat_and_cache_mla"
    nb, bs = int(kv_cache.shape[0]), int(kv_cache.shape[1])
    if slot_mapping.numel() > 0 and has_data(slot_mapping):
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= nb * bs:
            raise input_error(op, provider, "slot_mapping",
                              f"-1 (skip) or slots in [0, {nb * bs}) (num_blocks*block_size)",
                              f"values in [{lo}, {hi}]")


# ---------------------------------------------------------------------------- MLA attention
def check_mla_attention(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor,
                        block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                        scale: float, qk_nope_head_dim: int, *, provider: str = "native",
                        read_data: bool = True) -> tuple[int, int, int]:
    """Validate ``mla_attention``; reads the index tensors when ``read_data``.

    :returns: ``(kv_lora_rank, rope_dim, v_head_dim)``.
    """
    op = "mla_attention"
    cache = _latent_cache(op, provider, kv_cache)
    width = int(cache.shape[2])
    q = _tensor(op, provider, "q", q, 3, "[T, H, qk_nope_head_dim + rope_dim]")
    _float(op, provider, "q", q, cache.dtype)
    _, heads, qk_dim = (int(s) for s in q.shape)
    if isinstance(qk_nope_head_dim, bool) or not 0 < qk_nope_head_dim < qk_dim:
        raise input_error(op, provider, "qk_nope_head_dim", f"an int in (0, {qk_dim}) (q's "
                          "head size is qk_nope_head_dim + rope_dim)", qk_nope_head_dim)
    rope = qk_dim - qk_nope_head_dim
    lora = width - rope
    w = _tensor(op, provider, "kv_b_weight", kv_b_weight, 2,
                "[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]")
    _float(op, provider, "kv_b_weight", w, cache.dtype)
    if (lora <= 0 or w.shape[1] != lora or heads == 0 or w.shape[0] % heads
            or w.shape[0] // heads <= qk_nope_head_dim):
        raise input_error(op, provider, "kv_b_weight",
                          f"[{heads} * ({qk_nope_head_dim} + v_head_dim), {lora}] "
                          f"(kv_lora_rank = cache width {width} - rope_dim {rope})",
                          f"shape {list(w.shape)}")
    v_dim = w.shape[0] // heads - qk_nope_head_dim
    if not scale > 0:
        raise input_error(op, provider, "scale", "a positive float", scale)
    block_tables = _tensor(op, provider, "block_tables", block_tables, 2, "[S, max_blocks]")
    seq_lens = _tensor(op, provider, "seq_lens", seq_lens, 1, "[S]")
    query_start_loc = _tensor(op, provider, "query_start_loc", query_start_loc, 1, "[S + 1]")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        _index(op, provider, name, t, q.device)
    for name, t in (("kv_cache", cache), ("kv_b_weight", w)):
        if t.device != q.device:
            raise input_error(op, provider, name, f"device {q.device}", t.device)
    num_seqs = int(block_tables.shape[0])
    if seq_lens.shape[0] != num_seqs:
        raise input_error(op, provider, "seq_lens", f"shape [{num_seqs}] (block_tables' S)",
                          f"shape {list(seq_lens.shape)}")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise input_error(op, provider, "query_start_loc", f"shape [{num_seqs + 1}] (S + 1)",
                          f"shape {list(query_start_loc.shape)}")
    if read_data:
        check_mla_attention_values(q, kv_cache, block_tables, seq_lens, query_start_loc,
                                   provider=provider)
    return lora, rope, v_dim


def check_mla_attention_values(q: Tensor, kv_cache: Tensor, block_tables: Tensor,
                               seq_lens: Tensor, query_start_loc: Tensor, *,
                               provider: str = "native") -> None:
    """The value checks of :func:`check_mla_attention` alone (its static checks passed), as
    :func:`check_paged_attention_values`'; nothing when the index tensors hold no data."""
    if not has_data(block_tables, seq_lens, query_start_loc):
        return
    op = "mla_attention"
    qsl = query_start_loc.tolist()
    _offsets(op, provider, "query_start_loc", qsl, int(q.shape[0]))
    check_paged_lens(op, provider, qsl, seq_lens.tolist(), block_tables,
                     int(kv_cache.shape[1]), int(kv_cache.shape[0]))
