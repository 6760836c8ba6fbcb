"""Input checks of the cache ops (:mod:`opmux.ops.cache`): ``reshape_and_cache`` and
``advance_step_flashattn``, and the paged-cache layout checks the attention checks share.

Same contract as every module of :mod:`opmux.ops.checks`: static properties always, index
values only when ``read_data`` and the tensors hold data; every failure is an
:class:`opmux.OpInputError` raised before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import torch
from torch import Tensor

from opmux.ops.checks.input_errors import input_error, shape_text
from opmux.ops.checks.single_arguments import (
    check_dtype,
    check_floating,
    check_int,
    check_rank,
    check_same_device,
    check_tensor,
)
from opmux.ops.checks.symbolic import has_data, is_concrete, require

__all__ = [
    "check_advance_step_flashattn",
    "check_advance_step_flashattn_values",
    "check_cache_pair",
    "check_no_overlap",
    "check_reshape_and_cache",
    "check_slot_values",
    "checked_advance_step",
]

# ---------------------------------------------------------------------------------- cache
_CACHE_LAYOUT: Final = "[num_blocks, block_size, Hkv, D]"


def check_no_overlap(op: str, provider: str, name: str, t: Tensor) -> None:
    """``t`` (written in place) must not alias itself: an expanded, stride-0 view would make
    the writes race, their result depending on the order. Symbolic layouts are checked when
    the compiled graph runs the op on real tensors."""
    if not is_concrete(*t.shape, *t.stride()):
        return
    if torch._debug_has_internal_overlap(t) == 1:
        raise input_error(op, provider, name, "a tensor whose elements do not overlap "
                              "(no stride-0 dimension of size > 1)",
                              f"strides {list(t.stride())} for {shape_text(t)}")


def check_cache_pair(op: str, provider: str, key_cache: Tensor,
                      value_cache: Tensor) -> tuple[int, int, int, int]:
    """Shapes, dtypes and device of the paged caches of ``op``; returns ``(num_blocks,
    block_size, Hkv, D)`` (symbolic under ``torch.compile``, never ``int()``-ed).

    Any strides are accepted: NHD or permuted HND buffers, K and V as two views of one
    allocation (``kv[:, 0]``, ``kv[:, 1]``), block-sliced views.
    """
    key_cache = check_tensor(op, provider, "key_cache", key_cache)
    value_cache = check_tensor(op, provider, "value_cache", value_cache)
    check_rank(op, provider, "key_cache", key_cache, 4, _CACHE_LAYOUT)
    check_floating(op, provider, "key_cache", key_cache)
    check_rank(op, provider, "value_cache", value_cache, 4, _CACHE_LAYOUT)
    for a, b in zip(value_cache.shape, key_cache.shape, strict=True):
        require(a == b, op, provider, "value_cache",
                    lambda: f"key_cache's shape {list(key_cache.shape)}",
                    lambda: shape_text(value_cache))
    if value_cache.dtype != key_cache.dtype:
        raise input_error(op, provider, "value_cache", f"key_cache's dtype {key_cache.dtype}",
                              value_cache.dtype)
    check_same_device(op, provider, key_cache, value_cache=value_cache)
    nb, bs, hkv, d = key_cache.shape
    require(bs > 0, op, provider, "key_cache", f"{_CACHE_LAYOUT} with a positive block_size "
                "in dim 1", lambda: shape_text(key_cache))
    require(hkv > 0, op, provider, "key_cache", f"{_CACHE_LAYOUT} with a positive Hkv in "
                "dim 2", lambda: shape_text(key_cache))
    require(d > 0, op, provider, "key_cache", f"{_CACHE_LAYOUT} with a positive D in dim 3",
                lambda: shape_text(key_cache))
    return nb, bs, hkv, d


def check_reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                            slot_mapping: Tensor, *, provider: str = "native",
                            read_data: bool = True) -> None:
    """Validate ``reshape_and_cache``; reads ``slot_mapping`` (range) when ``read_data``.

    The caches may be any strided, non-overlapping view of ``[num_blocks, block_size, Hkv,
    D]`` with a positive block size, Hkv and D; ``key``/``value`` and ``slot_mapping`` any
    view of their shapes.
    """
    op = "reshape_and_cache"
    _static_reshape_and_cache(op, provider, key, value, key_cache, value_cache, slot_mapping)
    if read_data:
        check_slot_values(op, provider, slot_mapping, key_cache.shape[0] * key_cache.shape[1])


def _static_reshape_and_cache(op: str, provider: str, key: Tensor, value: Tensor,
                              key_cache: Tensor, value_cache: Tensor,
                              slot_mapping: Tensor) -> None:
    _, _, hkv, d = check_cache_pair(op, provider, key_cache, value_cache)
    check_no_overlap(op, provider, "key_cache", key_cache)
    check_no_overlap(op, provider, "value_cache", value_cache)
    key = check_tensor(op, provider, "key", key)
    value = check_tensor(op, provider, "value", value)
    slot_mapping = check_tensor(op, provider, "slot_mapping", slot_mapping)
    check_rank(op, provider, "key", key, 3, "[T, Hkv, D]")
    require(key.shape[1] == hkv, op, provider, "key",
                lambda: f"[T, {hkv}, {d}] (the cache's Hkv and D)", lambda: shape_text(key))
    require(key.shape[2] == d, op, provider, "key",
                lambda: f"[T, {hkv}, {d}] (the cache's Hkv and D)", lambda: shape_text(key))
    check_rank(op, provider, "value", value, 3, "[T, Hkv, D] (key's shape)")
    for a, b in zip(value.shape, key.shape, strict=True):
        require(a == b, op, provider, "value", lambda: f"key's shape {list(key.shape)}",
                    lambda: shape_text(value))
    for name, t in (("key", key), ("value", value)):
        if t.dtype != key_cache.dtype:
            raise input_error(op, provider, name, f"the cache's dtype {key_cache.dtype}",
                                  t.dtype)
    check_dtype(op, provider, "slot_mapping", slot_mapping, (torch.int64,))
    check_rank(op, provider, "slot_mapping", slot_mapping, 1, "[T] (one slot per token)")
    require(slot_mapping.shape[0] == key.shape[0], op, provider, "slot_mapping",
                lambda: f"shape [{key.shape[0]}] (one slot per token)",
                lambda: shape_text(slot_mapping))
    check_same_device(op, provider, key_cache, key=key, value=value, slot_mapping=slot_mapping)


_FEW_SLOTS: Final = 256
"""Up to this many tokens the slot values are checked in Python, which is quicker than the
tensor ops' fixed cost for a decode batch."""


def check_slot_values(op: str, provider: str, slot_mapping: Tensor, num_slots: int) -> None:
    """The values of ``slot_mapping`` (checked statically before): ``-1`` (skip) or a slot
    in ``[0, num_slots)``, each slot at most once. Skipped when the values cannot be read
    (meta, fake, tracing)."""
    if slot_mapping.numel() == 0 or not has_data(slot_mapping):
        return
    if slot_mapping.numel() <= _FEW_SLOTS:
        values = slot_mapping.tolist()
        lo, hi = min(values), max(values)
        used = [v for v in values if v >= 0]
        repeated = len(used) - len(set(used))
    else:
        # no boolean-mask indexing: it runs nonzero and copies, slow at thousands of tokens
        lo, hi = (int(v) for v in torch.aminmax(slot_mapping))
        ordered = torch.sort(slot_mapping.reshape(-1)).values
        repeated = int(((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).sum())
    if lo < -1 or hi >= num_slots:
        raise input_error(op, provider, "slot_mapping",
                              f"-1 (skip) or slots in [0, {num_slots}) (num_blocks*block_size)",
                          f"values in [{lo}, {hi}]")
    if repeated:
        # two tokens writing one slot would leave a provider-dependent winner
        raise input_error(op, provider, "slot_mapping", "distinct slots (each slot written "
                              "at most once per call; -1 may repeat)",
                          f"{repeated} repeated slot(s)")


def check_advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                                 input_tokens: Tensor, sampled_token_ids: Tensor,
                                 input_positions: Tensor, seq_lens: Tensor,
                                 slot_mapping: Tensor, block_tables: Tensor, *,
                                 provider: str = "native", read_data: bool = True) -> None:
    """Validate ``advance_step_flashattn``; reads ``seq_lens``/``block_tables`` when asked.

    The four state tensors are ``[num_seqs]`` vectors, any non-overlapping view (they are
    written in place; every op takes strided views, so providers whose kernels need
    contiguous state decline);
    ``sampled_token_ids`` is ``[num_queries]`` or ``[rows >= num_queries, 1]`` and
    ``block_tables`` ``[num_seqs, max_blocks]``, both any view. Value checks: each next
    position fits the block table and its block id is not negative.
    """
    op = "advance_step_flashattn"
    check_int(op, provider, "num_seqs", num_seqs, minimum=0)
    check_int(op, provider, "num_queries", num_queries, minimum=0)
    require(num_queries <= num_seqs, op, provider, "num_queries",
                lambda: f"an int in [0, num_seqs={num_seqs}]", num_queries)
    check_int(op, provider, "block_size", block_size, minimum=1)
    vectors = (("input_tokens", input_tokens, torch.int64),
               ("input_positions", input_positions, torch.int64),
               ("seq_lens", seq_lens, torch.int32),
               ("slot_mapping", slot_mapping, torch.int64))
    for name, t, dtype in vectors:
        t = check_tensor(op, provider, name, t)
        check_dtype(op, provider, name, t, (dtype,))
        check_rank(op, provider, name, t, 1, "[num_seqs]")
        require(t.shape[0] == num_seqs, op, provider, name,
                    lambda: f"shape [{num_seqs}] (num_seqs)", lambda t=t: shape_text(t))
        check_no_overlap(op, provider, name, t)
    sampled = check_tensor(op, provider, "sampled_token_ids", sampled_token_ids)
    check_dtype(op, provider, "sampled_token_ids", sampled, (torch.int64,))
    if sampled.dim() == 1:
        require(sampled.shape[0] == num_queries, op, provider, "sampled_token_ids",
                    lambda: f"shape [{num_queries}, 1] or [{num_queries}] (num_queries)",
                    lambda: shape_text(sampled))
    elif sampled.dim() == 2:
        require(sampled.shape[0] >= num_queries, op, provider, "sampled_token_ids",
                    lambda: f"shape [{num_queries}, 1] (num_queries; extra rows are ignored)",
                    lambda: shape_text(sampled))
        require(sampled.shape[1] == 1, op, provider, "sampled_token_ids",
                    lambda: f"shape [{num_queries}, 1] (num_queries)",
                    lambda: shape_text(sampled))
    else:
        raise input_error(op, provider, "sampled_token_ids",
                              f"shape [{num_queries}, 1] (num_queries)", shape_text(sampled))
    block_tables = check_tensor(op, provider, "block_tables", block_tables)
    check_dtype(op, provider, "block_tables", block_tables, (torch.int32,))
    check_rank(op, provider, "block_tables", block_tables, 2, "[num_seqs, max_blocks]")
    require(block_tables.shape[0] == num_seqs, op, provider, "block_tables",
                lambda: f"shape [{num_seqs}, max_blocks] (num_seqs rows)",
                lambda: shape_text(block_tables))
    check_same_device(op, provider, input_tokens, sampled_token_ids=sampled,
                          input_positions=input_positions, seq_lens=seq_lens,
                          slot_mapping=slot_mapping, block_tables=block_tables)
    if read_data:
        check_advance_step_flashattn_values(num_queries, block_size, seq_lens, block_tables,
                                            provider=provider)


def check_advance_step_flashattn_values(num_queries: int, block_size: int, seq_lens: Tensor,
                                        block_tables: Tensor, *,
                                        provider: str = "native") -> None:
    """The value checks of :func:`check_advance_step_flashattn` alone (its static checks
    passed): each next position fits the block table and its block id is not negative.
    Nothing is read from tensors that hold no data."""
    op = "advance_step_flashattn"
    if not (is_concrete(num_queries) and num_queries > 0 and has_data(seq_lens, block_tables)):
        return
    lens = seq_lens[:num_queries]
    lo, hi = (int(v) for v in torch.aminmax(lens))
    capacity = int(block_tables.shape[1]) * block_size
    if lo < 0 or hi >= capacity:
        raise input_error(op, provider, "seq_lens", f"values in [0, {capacity}) (the next "
                              f"position must fit max_blocks*block_size) for the first "
                          f"{num_queries} sequences", f"values in [{lo}, {hi}]")
    blocks = block_tables[:num_queries].gather(1, (lens.long() // block_size).unsqueeze(1))
    if int(blocks.min()) < 0:
        raise input_error(op, provider, "block_tables", "non-negative block ids at the next "
                              "position of each sequence", blocks.flatten().tolist())


def checked_advance_step(provider: str, run: Callable[..., None]) -> Callable[..., None]:
    """A provider's ``advance_step_flashattn``: the catalog's checks, then ``run`` with the
    op's arguments in schema order. Index values (``seq_lens``, ``block_tables``) are read
    only from CPU tensors, where that costs no device sync."""

    def advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                               input_tokens: Tensor, sampled_token_ids: Tensor,
                               input_positions: Tensor, seq_lens: Tensor,
                               slot_mapping: Tensor, block_tables: Tensor) -> None:
        check_advance_step_flashattn(num_seqs, num_queries, block_size, input_tokens,
                                     sampled_token_ids, input_positions, seq_lens,
                                     slot_mapping, block_tables, provider=provider,
                                     read_data=getattr(input_tokens, "is_cpu", False))
        run(num_seqs, num_queries, block_size, input_tokens, sampled_token_ids,
            input_positions, seq_lens, slot_mapping, block_tables)

    return advance_step_flashattn
