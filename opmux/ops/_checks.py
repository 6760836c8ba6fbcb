"""Input validation of the catalog ops, shared by the native references and providers.

Every ``check_<op>`` function takes the op's arguments (same names and order), plus
``provider`` (named in the error) and ``read_data``. Static properties (dtype, rank, sizes,
contiguity, device) are always checked; value checks (index ranges) run only when
``read_data`` is true *and* the tensors hold data: never on meta or fake tensors, never
while tracing. Providers on devices where reading values costs a sync pass
``read_data=False``.

Each check raises :class:`opmux.OpInputError` naming the op, the provider, the argument,
what was expected and what was got, before the op writes anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Final

import torch
from torch import Tensor

from opmux.core.errors import OpInputError

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check_advance_step_flashattn",
    "check_fused_add_rms_norm",
    "check_gelu_and_mul",
    "check_paged_attention",
    "check_reshape_and_cache",
    "check_rms_norm",
    "check_rotary_embedding",
    "check_silu_and_mul",
    "has_data",
    "input_error",
]

FLOAT_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""Floating dtypes the native references accept."""

INDEX_DTYPES: Final = (torch.int32, torch.int64)
"""Dtypes accepted for block tables, sequence lengths and query offsets."""

GELU_APPROXIMATIONS: Final = ("none", "tanh")
"""Valid values of ``gelu_and_mul``'s ``approximate``."""


def input_error(op: str, provider: str, argument: str, expected: str,
                got: object) -> OpInputError:
    """Build the standard error: ``opmux::op (provider 'p'): argument 'a' expected E, got G``."""
    return OpInputError(
        f"opmux::{op} (provider {provider!r}): argument {argument!r} expected {expected}, "
        f"got {got}", op=f"opmux::{op}", provider=provider, argument=argument,
    )


def has_data(*tensors: Tensor) -> bool:
    """Whether the values of ``tensors`` can be read (not meta, not fake, not tracing)."""
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return all(t.device.type != "meta" and not is_fake(t) for t in tensors)


def _shape(t: Tensor) -> str:
    return f"shape {list(t.shape)}"


def _describe(t: Tensor) -> str:
    return f"{t.dtype} tensor of shape {list(t.shape)} on {t.device}"


def _tensor(op: str, provider: str, name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise input_error(op, provider, name, "a torch.Tensor", type(t).__name__)
    return t


def _float(op: str, provider: str, name: str, t: Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise input_error(op, provider, name, "a floating tensor (float32/float16/bfloat16)",
                          t.dtype)


def _dtype(op: str, provider: str, name: str, t: Tensor,
           dtypes: Sequence[torch.dtype]) -> None:
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise input_error(op, provider, name, f"dtype {want}", t.dtype)


def _rank(op: str, provider: str, name: str, t: Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise input_error(op, provider, name, f"a {rank}-d tensor {layout}", _shape(t))


def _same_device(op: str, provider: str, ref: Tensor, **others: Tensor) -> None:
    for name, t in others.items():
        if t.device != ref.device:
            raise input_error(op, provider, name, f"device {ref.device}", t.device)


def _contiguous(op: str, provider: str, name: str, t: Tensor) -> None:
    if not t.is_contiguous():
        raise input_error(op, provider, name, "a contiguous tensor",
                          f"strides {list(t.stride())} for {_shape(t)}")


# ---------------------------------------------------------------------------- activations
def _check_gated(op: str, provider: str, x: Tensor) -> None:
    x = _tensor(op, provider, "x", x)
    _float(op, provider, "x", x)
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise input_error(op, provider, "x", "a tensor [..., 2*d] with an even last dimension",
                          _shape(x))


def check_silu_and_mul(x: Tensor, *, provider: str = "native", read_data: bool = True) -> None:
    """Validate ``silu_and_mul(x)``."""
    _check_gated("silu_and_mul", provider, x)


def check_gelu_and_mul(x: Tensor, approximate: str = "none", *, provider: str = "native",
                       read_data: bool = True) -> None:
    """Validate ``gelu_and_mul(x, approximate)``."""
    _check_gated("gelu_and_mul", provider, x)
    if approximate not in GELU_APPROXIMATIONS:
        raise input_error("gelu_and_mul", provider, "approximate",
                          f"one of {sorted(GELU_APPROXIMATIONS)}", repr(approximate))


# ---------------------------------------------------------------------------------- norms
def _check_norm(op: str, provider: str, x: Tensor, weight: Tensor, eps: float) -> None:
    x = _tensor(op, provider, "x", x)
    weight = _tensor(op, provider, "weight", weight)
    _float(op, provider, "x", x)
    _float(op, provider, "weight", weight)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., d] with at least one dimension",
                          _shape(x))
    d = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != d:
        raise input_error(op, provider, "weight", f"shape [{d}] (x's last dimension)",
                          _shape(weight))
    _same_device(op, provider, x, weight=weight)
    if not eps >= 0.0:
        raise input_error(op, provider, "eps", "a non-negative float", eps)


def check_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, provider: str = "native",
                   read_data: bool = True) -> None:
    """Validate ``rms_norm(x, weight, eps)``."""
    _check_norm("rms_norm", provider, x, weight, eps)


def check_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                             *, provider: str = "native", read_data: bool = True) -> None:
    """Validate ``fused_add_rms_norm(x, residual, weight, eps)``."""
    op = "fused_add_rms_norm"
    _check_norm(op, provider, x, weight, eps)
    residual = _tensor(op, provider, "residual", residual)
    if residual.shape != x.shape:
        raise input_error(op, provider, "residual", f"x's shape {list(x.shape)}",
                          _shape(residual))
    if residual.dtype != x.dtype:
        raise input_error(op, provider, "residual", f"x's dtype {x.dtype}", residual.dtype)
    _same_device(op, provider, x, residual=residual)


# --------------------------------------------------------------------------------- rotary
def check_rotary_embedding(positions: Tensor, query: Tensor, key: Tensor,
                           cos_sin_cache: Tensor, head_size: int, is_neox: bool = True, *,
                           provider: str = "native", read_data: bool = True) -> None:
    """Validate ``rotary_embedding``; reads ``positions`` (range) when ``read_data``."""
    op = "rotary_embedding"
    positions = _tensor(op, provider, "positions", positions)
    query = _tensor(op, provider, "query", query)
    key = _tensor(op, provider, "key", key)
    cos_sin_cache = _tensor(op, provider, "cos_sin_cache", cos_sin_cache)
    _dtype(op, provider, "positions", positions, INDEX_DTYPES)
    _rank(op, provider, "positions", positions, 1, "[T]")
    num_tokens = positions.shape[0]
    if head_size <= 0:
        raise input_error(op, provider, "head_size", "a positive int", head_size)
    for name, t in (("query", query), ("key", key)):
        _float(op, provider, name, t)
        if t.dim() == 2:
            if t.shape[1] % head_size != 0:
                raise input_error(op, provider, name,
                                  f"[T, heads*{head_size}] (a multiple of head_size)", _shape(t))
        elif t.dim() == 3:
            if t.shape[2] != head_size:
                raise input_error(op, provider, name, f"[T, heads, {head_size}]", _shape(t))
        else:
            raise input_error(op, provider, name, f"[T, heads*{head_size}] or "
                              f"[T, heads, {head_size}]", _shape(t))
        if t.shape[0] != num_tokens:
            raise input_error(op, provider, name, f"{num_tokens} tokens (positions' length) "
                              f"in dim 0", _shape(t))
    if key.dtype != query.dtype:
        raise input_error(op, provider, "key", f"query's dtype {query.dtype}", key.dtype)
    _float(op, provider, "cos_sin_cache", cos_sin_cache)
    _rank(op, provider, "cos_sin_cache", cos_sin_cache, 2, "[max_position, rot]")
    rot = cos_sin_cache.shape[1]
    if rot % 2 != 0 or rot <= 0 or rot > head_size:
        raise input_error(op, provider, "cos_sin_cache",
                          f"an even rotary width 0 < rot <= head_size={head_size} in dim 1",
                          _shape(cos_sin_cache))
    _same_device(op, provider, query, positions=positions, key=key,
                 cos_sin_cache=cos_sin_cache)
    if read_data and num_tokens > 0 and has_data(positions):
        lo, hi = int(positions.min()), int(positions.max())
        max_pos = cos_sin_cache.shape[0]
        if lo < 0 or hi >= max_pos:
            raise input_error(op, provider, "positions",
                              f"values in [0, {max_pos}) (cos_sin_cache rows)",
                              f"values in [{lo}, {hi}]")


# ---------------------------------------------------------------------------------- cache
def _no_overlap(op: str, provider: str, name: str, t: Tensor) -> None:
    # a written tensor must not alias itself (an expanded, stride-0 view): the writes would
    # race and their result depend on the order
    if torch._debug_has_internal_overlap(t) == 1:
        raise input_error(op, provider, name, "a tensor whose elements do not overlap "
                          "(no stride-0 dimension of size > 1)",
                          f"strides {list(t.stride())} for {_shape(t)}")


def _check_cache_pair(op: str, provider: str, key_cache: Tensor,
                      value_cache: Tensor) -> tuple[int, int, int, int]:
    """Shapes, dtypes and device of the paged caches: any strides (NHD/HND views, K and V as
    two views of one buffer) are accepted. Returns ``(num_blocks, block_size, Hkv, D)``,
    symbolic under ``torch.compile`` (never ``int()``-ed: that would specialise them).
    """
    key_cache = _tensor(op, provider, "key_cache", key_cache)
    value_cache = _tensor(op, provider, "value_cache", value_cache)
    layout = "[num_blocks, block_size, Hkv, D]"
    _rank(op, provider, "key_cache", key_cache, 4, layout)
    _float(op, provider, "key_cache", key_cache)
    if value_cache.shape != key_cache.shape:
        raise input_error(op, provider, "value_cache", f"key_cache's shape "
                          f"{list(key_cache.shape)}", _shape(value_cache))
    if value_cache.dtype != key_cache.dtype:
        raise input_error(op, provider, "value_cache", f"key_cache's dtype {key_cache.dtype}",
                          value_cache.dtype)
    _same_device(op, provider, key_cache, value_cache=value_cache)
    nb, bs, hkv, d = key_cache.shape
    for dim, what, size in ((1, "block_size", bs), (2, "Hkv", hkv), (3, "D", d)):
        if size <= 0:
            raise input_error(op, provider, "key_cache", f"{layout} with a positive {what} "
                              f"in dim {dim}", _shape(key_cache))
    return nb, bs, hkv, d


def check_reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                            slot_mapping: Tensor, *, provider: str = "native",
                            read_data: bool = True) -> None:
    """Validate ``reshape_and_cache``; reads ``slot_mapping`` (range) when ``read_data``."""
    op = "reshape_and_cache"
    nb, bs, hkv, d = _check_cache_pair(op, provider, key_cache, value_cache)
    _no_overlap(op, provider, "key_cache", key_cache)
    _no_overlap(op, provider, "value_cache", value_cache)
    key = _tensor(op, provider, "key", key)
    value = _tensor(op, provider, "value", value)
    slot_mapping = _tensor(op, provider, "slot_mapping", slot_mapping)
    _rank(op, provider, "key", key, 3, "[T, Hkv, D]")
    if tuple(key.shape[1:]) != (hkv, d):
        raise input_error(op, provider, "key", f"[T, {hkv}, {d}] (the cache's Hkv and D)",
                          _shape(key))
    if value.shape != key.shape:
        raise input_error(op, provider, "value", f"key's shape {list(key.shape)}", _shape(value))
    for name, t in (("key", key), ("value", value)):
        if t.dtype != key_cache.dtype:
            raise input_error(op, provider, name, f"the cache's dtype {key_cache.dtype}",
                              t.dtype)
    _dtype(op, provider, "slot_mapping", slot_mapping, (torch.int64,))
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise input_error(op, provider, "slot_mapping", f"shape [{key.shape[0]}] (one slot "
                          f"per token)", _shape(slot_mapping))
    _same_device(op, provider, key_cache, key=key, value=value, slot_mapping=slot_mapping)
    if read_data and slot_mapping.numel() > 0 and has_data(slot_mapping):
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= nb * bs:
            raise input_error(op, provider, "slot_mapping",
                              f"-1 (skip) or slots in [0, {nb * bs}) (num_blocks*block_size)",
                              f"values in [{lo}, {hi}]")


def check_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                          block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                          scale: float, sliding_window: int | None = None,
                          soft_cap: float | None = None, *, provider: str = "native",
                          read_data: bool = True) -> None:
    """Validate ``paged_attention``; reads the index tensors when ``read_data``.

    Value checks: ``query_start_loc`` starts at 0, never decreases and ends at most at T;
    ``q_len <= kv_len``; ``kv_len > 0`` when ``q_len > 0``; ``kv_len`` fits the block table;
    every block a sequence reads lies in ``[0, num_blocks)``.
    """
    op = "paged_attention"
    nb, bs, hkv, d = _check_cache_pair(op, provider, key_cache, value_cache)
    query = _tensor(op, provider, "query", query)
    _rank(op, provider, "query", query, 3, "[T, H, D]")
    if query.dtype != key_cache.dtype:
        raise input_error(op, provider, "query", f"the cache's dtype {key_cache.dtype}",
                          query.dtype)
    # sizes stay symbolic under torch.compile: int() would specialise them (#11 item 6)
    num_tokens, heads, head_size = query.shape
    if head_size != d:
        raise input_error(op, provider, "query", f"head size {d} (the cache's D) in dim 2",
                          _shape(query))
    if heads % hkv != 0:
        raise input_error(op, provider, "query", f"a head count divisible by the cache's "
                          f"Hkv={hkv}", f"H={heads}")
    block_tables = _tensor(op, provider, "block_tables", block_tables)
    seq_lens = _tensor(op, provider, "seq_lens", seq_lens)
    query_start_loc = _tensor(op, provider, "query_start_loc", query_start_loc)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        _dtype(op, provider, name, t, INDEX_DTYPES)
    _rank(op, provider, "block_tables", block_tables, 2, "[S, max_blocks]")
    num_seqs, max_blocks = block_tables.shape
    if seq_lens.dim() != 1 or seq_lens.shape[0] != num_seqs:
        raise input_error(op, provider, "seq_lens", f"shape [{num_seqs}] (block_tables' S)",
                          _shape(seq_lens))
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1:
        raise input_error(op, provider, "query_start_loc", f"shape [{num_seqs + 1}] (S + 1)",
                          _shape(query_start_loc))
    if sliding_window is not None and sliding_window <= 0:
        raise input_error(op, provider, "sliding_window", "None or a positive int",
                          sliding_window)
    if soft_cap is not None and not soft_cap > 0:
        raise input_error(op, provider, "soft_cap", "None or a positive float", soft_cap)
    _same_device(op, provider, query, key_cache=key_cache, block_tables=block_tables,
                 seq_lens=seq_lens, query_start_loc=query_start_loc)
    if not (read_data and has_data(block_tables, seq_lens, query_start_loc)):
        return
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if qsl[0] != 0 or any(b < a for a, b in itertools.pairwise(qsl)) or qsl[-1] > num_tokens:
        raise input_error(op, provider, "query_start_loc",
                          f"non-decreasing offsets from 0 to at most T={num_tokens}", qsl)
    for i, kv_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        if kv_len < 0 or kv_len > max_blocks * bs:
            raise input_error(op, provider, "seq_lens", f"values in [0, {max_blocks * bs}] "
                              f"(max_blocks*block_size) for sequence {i}", kv_len)
        if q_len > 0 and kv_len < q_len:
            raise input_error(op, provider, "seq_lens", f"kv_len >= q_len={q_len} (the "
                              f"queries are the last tokens of the sequence) for sequence {i}",
                              kv_len)
    needed = [(n + bs - 1) // bs for n in lens]
    if num_seqs and max(needed) > 0:
        cols = torch.arange(max_blocks, device=block_tables.device)
        used = cols.unsqueeze(0) < torch.tensor(needed, device=block_tables.device).unsqueeze(1)
        ids = block_tables[used]
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= nb:
            raise input_error(op, provider, "block_tables",
                              f"block ids in [0, {nb}) (num_blocks) for the blocks in use",
                              f"ids in [{lo}, {hi}]")


def check_advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                                 input_tokens: Tensor, sampled_token_ids: Tensor,
                                 input_positions: Tensor, seq_lens: Tensor,
                                 slot_mapping: Tensor, block_tables: Tensor, *,
                                 provider: str = "native", read_data: bool = True) -> None:
    """Validate ``advance_step_flashattn``; reads ``seq_lens``/``block_tables`` when asked."""
    op = "advance_step_flashattn"
    if num_seqs < 0:
        raise input_error(op, provider, "num_seqs", "a non-negative int", num_seqs)
    if not 0 <= num_queries <= num_seqs:
        raise input_error(op, provider, "num_queries", f"an int in [0, num_seqs={num_seqs}]",
                          num_queries)
    if block_size <= 0:
        raise input_error(op, provider, "block_size", "a positive int", block_size)
    vectors = (("input_tokens", input_tokens, torch.int64),
               ("input_positions", input_positions, torch.int64),
               ("seq_lens", seq_lens, torch.int32),
               ("slot_mapping", slot_mapping, torch.int64))
    for name, t, dtype in vectors:
        t = _tensor(op, provider, name, t)
        _dtype(op, provider, name, t, (dtype,))
        if t.dim() != 1 or t.shape[0] != num_seqs:
            raise input_error(op, provider, name, f"shape [{num_seqs}] (num_seqs)", _shape(t))
        _contiguous(op, provider, name, t)
    sampled_token_ids = _tensor(op, provider, "sampled_token_ids", sampled_token_ids)
    _dtype(op, provider, "sampled_token_ids", sampled_token_ids, (torch.int64,))
    shape = tuple(sampled_token_ids.shape)
    if shape not in ((num_queries, 1), (num_queries,)) and not (
            sampled_token_ids.dim() == 2 and shape[0] >= num_queries and shape[1] == 1):
        raise input_error(op, provider, "sampled_token_ids",
                          f"shape [{num_queries}, 1] (num_queries)", _shape(sampled_token_ids))
    block_tables = _tensor(op, provider, "block_tables", block_tables)
    _dtype(op, provider, "block_tables", block_tables, (torch.int32,))
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise input_error(op, provider, "block_tables", f"shape [{num_seqs}, max_blocks] "
                          f"(num_seqs rows)", _shape(block_tables))
    _same_device(op, provider, input_tokens, sampled_token_ids=sampled_token_ids,
                 input_positions=input_positions, seq_lens=seq_lens,
                 slot_mapping=slot_mapping, block_tables=block_tables)
    if num_queries == 0 or not (read_data and has_data(seq_lens, block_tables)):
        return
    lens = seq_lens[:num_queries]
    lo, hi = int(lens.min()), int(lens.max())
    capacity = int(block_tables.shape[1]) * block_size
    if lo < 0 or hi >= capacity:
        raise input_error(op, provider, "seq_lens", f"values in [0, {capacity}) (the next "
                          f"position must fit max_blocks*block_size) for the first "
                          f"{num_queries} sequences", f"values in [{lo}, {hi}]")
    blocks = block_tables[:num_queries].gather(1, (lens.long() // block_size).unsqueeze(1))
    if int(blocks.min()) < 0:
        raise input_error(op, provider, "block_tables", "non-negative block ids at the next "
                          "position of each sequence", blocks.flatten().tolist())
