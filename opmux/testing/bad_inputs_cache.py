"""Bad inputs of the KV-cache ops: ``reshape_and_cache``, ``paged_attention`` and
``advance_step_flashattn``.

Registered by :func:`register_cache_bad_inputs` (called by :mod:`opmux.testing.bad_inputs`).
Every row is refused by native and by every provider with an :class:`opmux.OpInputError` naming
the argument in the row, before anything is written."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from opmux.testing.bad_input_table import BadInput, register_bad_inputs, row_randn, variants

__all__ = [
    "advance_step_bad_inputs", "paged_attention_bad_inputs", "register_cache_bad_inputs",
    "reshape_and_cache_bad_inputs",
]

_META = torch.device("meta")


# ------------------------------------------------------------------- reshape_and_cache
def reshape_and_cache_bad_inputs() -> Iterator[BadInput]:
    """Rows of ``reshape_and_cache`` (T=3, Hkv=2, D=8, caches [4, 4, 2, 8])."""
    key, value = row_randn(1, 3, 2, 8), row_randn(2, 3, 2, 8)

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        return row_randn(3, 4, 4, 2, 8), row_randn(4, 4, 4, 2, 8)

    kc, vc = caches()
    base = {"key": key, "value": value, "key_cache": kc, "value_cache": vc,
            "slot_mapping": torch.tensor([0, 5, -1])}
    cache = row_randn(5, 4, 4, 2, 8)
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("key-none", "key", {"key": None}),
        ("value-none", "value", {"value": None}),
        ("key_cache-none", "key_cache", {"key_cache": None}),
        ("value_cache-none", "value_cache", {"value_cache": None}),
        ("key_cache-3d", "key_cache", {"key_cache": cache[0], "value_cache": cache[1]}),
        ("key_cache-int", "key_cache", {"key_cache": cache.long(),
                                        "value_cache": cache.long()}),
        ("value_cache-shape", "value_cache", {"value_cache": row_randn(6, 4, 8, 2, 8)}),
        ("value_cache-dtype", "value_cache", {"value_cache": cache.half()}),
        ("value_cache-meta", "value_cache", {"value_cache": cache.to(_META)}),
        ("key_cache-block-size-0", "key_cache", {"key_cache": cache[:, :0],
                                                 "value_cache": cache[:, :0].clone()}),
        ("key_cache-expanded", "key_cache", {"key_cache": cache[:1].expand(4, 4, 2, 8)}),
        ("value_cache-expanded", "value_cache",
         {"value_cache": cache[:, :1].expand(4, 4, 2, 8)}),
        ("key-2d", "key", {"key": key.reshape(3, 16)}),
        ("key-wrong-heads", "key", {"key": row_randn(7, 3, 1, 8), "value": row_randn(8, 3, 1, 8)}),
        ("key-wrong-head-size", "key", {"key": row_randn(9, 3, 2, 4),
                                        "value": row_randn(10, 3, 2, 4)}),
        ("value-shape", "value", {"value": row_randn(11, 2, 2, 8)}),
        ("key-dtype", "key", {"key": key.half(), "value": value.half()}),
        ("value-dtype", "value", {"value": value.double()}),
        ("key-meta", "key", {"key": key.to(_META)}),
        ("slot_mapping-int32", "slot_mapping",
         {"slot_mapping": torch.tensor([0, 5, -1], dtype=torch.int32)}),
        ("slot_mapping-float", "slot_mapping", {"slot_mapping": torch.tensor([0.0, 5, -1])}),
        ("slot_mapping-2d", "slot_mapping", {"slot_mapping": torch.tensor([[0, 5, -1]])}),
        ("slot_mapping-short", "slot_mapping", {"slot_mapping": torch.tensor([0, 5])}),
        ("slot_mapping-past-end", "slot_mapping", {"slot_mapping": torch.tensor([0, 16, -1])}),
        ("slot_mapping-below-minus-one", "slot_mapping",
         {"slot_mapping": torch.tensor([0, -2, 1])}),
        ("slot_mapping-repeated", "slot_mapping", {"slot_mapping": torch.tensor([3, 3, -1])}),
        ("slot_mapping-meta", "slot_mapping",
         {"slot_mapping": torch.tensor([0, 5, -1], device=_META)}),
    ]
    yield from variants(base, rows)


# --------------------------------------------------------------------- paged_attention
def paged_attention_bad_inputs() -> Iterator[BadInput]:
    """Rows of ``paged_attention`` (3 sequences, q_lens [2, 1, 0], kv_lens [5, 9, 3], 8/2
    heads, D=8, block size 4, 8 blocks)."""
    kc, vc = row_randn(21, 8, 4, 2, 8), row_randn(22, 8, 4, 2, 8)
    tables = torch.tensor([[0, 1, 7], [2, 3, 4], [5, 6, 6]], dtype=torch.int32)
    lens = torch.tensor([5, 9, 3], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3, 3], dtype=torch.int32)
    query = row_randn(23, 3, 8, 8)
    base: dict[str, Any] = {
        "query": query, "key_cache": kc, "value_cache": vc, "block_tables": tables,
        "seq_lens": lens, "query_start_loc": qsl, "scale": 8 ** -0.5,
        "sliding_window": None, "soft_cap": None}

    def i32(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    bad_table = tables.clone()
    bad_table[1, 2] = 8  # the third block of sequence 1 (kv_len 9) is read
    neg_table = tables.clone()
    neg_table[0, 1] = -1
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("query-none", "query", {"query": None}),
        ("query-2d", "query", {"query": query.reshape(3, 64)}),
        ("query-dtype", "query", {"query": query.half()}),
        ("query-head-size", "query", {"query": row_randn(24, 3, 8, 4)}),
        ("query-heads-not-multiple", "query", {"query": row_randn(25, 3, 3, 8)}),
        ("query-meta", "query", {"query": query.to(_META)}),
        ("key_cache-none", "key_cache", {"key_cache": None}),
        ("key_cache-3d", "key_cache", {"key_cache": kc[0], "value_cache": vc[0]}),
        ("key_cache-int", "key_cache", {"key_cache": kc.long(), "value_cache": vc.long()}),
        ("value_cache-shape", "value_cache", {"value_cache": vc[:4]}),
        ("value_cache-dtype", "value_cache", {"value_cache": vc.double()}),
        ("key_cache-hkv-0", "key_cache", {"key_cache": kc[:, :, :0],
                                          "value_cache": vc[:, :, :0]}),
        ("key_cache-block-size-0", "key_cache", {"key_cache": kc[:, :0],
                                                 "value_cache": vc[:, :0]}),
        ("value_cache-meta", "value_cache", {"value_cache": vc.to(_META)}),
        ("block_tables-none", "block_tables", {"block_tables": None}),
        ("block_tables-float", "block_tables", {"block_tables": tables.float()}),
        ("block_tables-1d", "block_tables", {"block_tables": tables.reshape(-1)}),
        ("block_tables-meta", "block_tables", {"block_tables": tables.to(_META)}),
        ("block_tables-id-past-end", "block_tables", {"block_tables": bad_table}),
        ("block_tables-negative-id", "block_tables", {"block_tables": neg_table}),
        ("seq_lens-short", "seq_lens", {"seq_lens": i32(5, 9)}),
        ("seq_lens-float", "seq_lens", {"seq_lens": lens.float()}),
        ("seq_lens-negative", "seq_lens", {"seq_lens": i32(5, -1, 3)}),
        ("seq_lens-past-table", "seq_lens", {"seq_lens": i32(5, 13, 3)}),
        ("seq_lens-below-q-len", "seq_lens", {"seq_lens": i32(1, 9, 3)}),
        ("query_start_loc-short", "query_start_loc", {"query_start_loc": i32(0, 2, 3)}),
        ("query_start_loc-starts-at-1", "query_start_loc",
         {"query_start_loc": i32(1, 2, 3, 3)}),
        ("query_start_loc-decreasing", "query_start_loc",
         {"query_start_loc": i32(0, 2, 1, 3)}),
        ("query_start_loc-past-rows", "query_start_loc",
         {"query_start_loc": i32(0, 2, 3, 4)}),
        ("query_start_loc-bool", "query_start_loc",
         {"query_start_loc": torch.tensor([False, True, True, True])}),
        ("scale-nan", "scale", {"scale": float("nan")}),
        ("sliding_window-zero", "sliding_window", {"sliding_window": 0}),
        ("sliding_window-negative", "sliding_window", {"sliding_window": -4}),
        ("soft_cap-zero", "soft_cap", {"soft_cap": 0.0}),
        ("soft_cap-negative", "soft_cap", {"soft_cap": -30.0}),
        ("soft_cap-nan", "soft_cap", {"soft_cap": float("nan")}),
    ]
    yield from variants(base, rows)


# -------------------------------------------------------------- advance_step_flashattn
def advance_step_bad_inputs() -> Iterator[BadInput]:
    """Rows of ``advance_step_flashattn`` (4 sequences, 3 queries, block size 4)."""
    def state() -> dict[str, Any]:
        return {
            "num_seqs": 4, "num_queries": 3, "block_size": 4,
            "input_tokens": torch.full((4,), 7, dtype=torch.int64),
            "sampled_token_ids": torch.tensor([[11], [12], [13]]),
            "input_positions": torch.full((4,), 7, dtype=torch.int64),
            "seq_lens": torch.tensor([5, 2, 7, 3], dtype=torch.int32),
            "slot_mapping": torch.full((4,), 7, dtype=torch.int64),
            "block_tables": torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32),
        }

    base = state()
    tables = base["block_tables"]
    hole = tables.clone()
    hole[0, 1] = -1  # sequence 0's next position (5) is in block column 1
    int32, int64 = torch.int32, torch.int64
    make: Callable[..., torch.Tensor] = torch.zeros
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("num_seqs-negative", "num_seqs", {"num_seqs": -1}),
        ("num_queries-above-num_seqs", "num_queries", {"num_queries": 5}),
        ("num_queries-negative", "num_queries", {"num_queries": -1}),
        ("block_size-zero", "block_size", {"block_size": 0}),
        ("block_size-negative", "block_size", {"block_size": -4}),
        ("input_tokens-none", "input_tokens", {"input_tokens": None}),
        ("input_tokens-int32", "input_tokens", {"input_tokens": make(4, dtype=int32)}),
        ("input_tokens-2d", "input_tokens", {"input_tokens": make(4, 1, dtype=int64)}),
        ("input_tokens-short", "input_tokens", {"input_tokens": make(3, dtype=int64)}),
        ("input_tokens-expanded", "input_tokens",
         {"input_tokens": make(1, dtype=int64).expand(4)}),
        ("input_positions-int32", "input_positions",
         {"input_positions": make(4, dtype=int32)}),
        ("input_positions-long", "input_positions", {"input_positions": make(5, dtype=int64)}),
        ("seq_lens-int64", "seq_lens", {"seq_lens": base["seq_lens"].long()}),
        ("seq_lens-short", "seq_lens", {"seq_lens": base["seq_lens"][:3].clone()}),
        ("seq_lens-past-table", "seq_lens",
         {"seq_lens": torch.tensor([5, 8, 7, 3], dtype=int32)}),
        ("seq_lens-negative", "seq_lens", {"seq_lens": torch.tensor([5, -1, 7, 3],
                                                                     dtype=int32)}),
        ("slot_mapping-int32", "slot_mapping", {"slot_mapping": make(4, dtype=int32)}),
        ("slot_mapping-expanded", "slot_mapping",
         {"slot_mapping": make(1, dtype=int64).expand(4)}),
        ("sampled-int32", "sampled_token_ids",
         {"sampled_token_ids": torch.tensor([[11], [12], [13]], dtype=int32)}),
        ("sampled-too-few-rows", "sampled_token_ids",
         {"sampled_token_ids": torch.tensor([[11], [12]])}),
        ("sampled-two-columns", "sampled_token_ids",
         {"sampled_token_ids": torch.tensor([[11, 0], [12, 0], [13, 0]])}),
        ("sampled-1d-long", "sampled_token_ids",
         {"sampled_token_ids": torch.tensor([11, 12, 13, 14])}),
        ("sampled-3d", "sampled_token_ids",
         {"sampled_token_ids": torch.tensor([[[11]], [[12]], [[13]]])}),
        ("sampled-meta", "sampled_token_ids",
         {"sampled_token_ids": torch.tensor([[11], [12], [13]], device=_META)}),
        ("block_tables-int64", "block_tables", {"block_tables": tables.long()}),
        ("block_tables-1d", "block_tables", {"block_tables": tables.reshape(-1)}),
        ("block_tables-rows", "block_tables", {"block_tables": tables[:3].clone()}),
        ("block_tables-negative-next-block", "block_tables", {"block_tables": hole}),
        ("block_tables-meta", "block_tables", {"block_tables": tables.to(_META)}),
    ]
    yield from variants(base, rows)


def register_cache_bad_inputs() -> None:
    """Register the generators above."""
    register_bad_inputs("reshape_and_cache", reshape_and_cache_bad_inputs)
    register_bad_inputs("paged_attention", paged_attention_bad_inputs)
    register_bad_inputs("advance_step_flashattn", advance_step_bad_inputs)
