"""Argument checks shared by the ``triton`` and ``cuda_c`` providers (no Triton import).

The mutating ops validate every argument before launching anything, so a bad call writes
nothing. Errors are :class:`~opmux.core.errors.OpInputError` naming op, provider, argument,
expected and got.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opmux.ops._checks import input_error

if TYPE_CHECKING:
    import torch

__all__ = ["check", "validate_advance_step", "validate_reshape_and_cache"]


def check(ok: bool, op: str, argument: str, expected: str, got: object, *,
          provider: str = "triton") -> None:
    """Raise :class:`~opmux.core.errors.OpInputError` unless ``ok`` (built by
    :func:`opmux.ops._checks.input_error`: one message format, ``op``/``provider``/``argument``
    set).

    :param ok: the condition that must hold.
    :param op: op name, e.g. ``"rms_norm"``.
    :param argument: the argument at fault.
    :param expected: what the provider needs.
    :param got: what it received.
    :param provider: the provider raising.
    """
    if not ok:
        raise input_error(op, provider, argument, expected, got)


def validate_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                               provider: str = "triton") -> None:
    """Shapes, dtypes and devices of a ``reshape_and_cache`` call."""
    import torch

    op = "reshape_and_cache"

    def need(ok: bool, argument: str, expected: str, got: object) -> None:
        check(ok, op, argument, expected, got, provider=provider)

    floats = (torch.float32, torch.float16, torch.bfloat16)
    need(key.dim() == 3, "key", "3-D [T, Hkv, D]", tuple(key.shape))
    need(value.shape == key.shape, "value", f"shape {tuple(key.shape)}", tuple(value.shape))
    need(key_cache.dim() == 4, "key_cache", "4-D [blocks, block_size, Hkv, D]",
         tuple(key_cache.shape))
    need(value_cache.shape == key_cache.shape, "value_cache", f"shape {tuple(key_cache.shape)}",
         tuple(value_cache.shape))
    tokens, hkv, d = key.shape
    need(tuple(key_cache.shape[2:]) == (hkv, d), "key_cache",
         f"trailing dims ({hkv}, {d}) matching key", tuple(key_cache.shape))
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        need(t.dtype in floats, name, "float32/float16/bfloat16", t.dtype)
        need(t.device == key.device, name, f"device {key.device}", t.device)
    need(slot_mapping.dtype in (torch.int64, torch.int32), "slot_mapping", "int64 or int32",
         slot_mapping.dtype)
    need(slot_mapping.dim() == 1 and slot_mapping.shape[0] == tokens, "slot_mapping",
         f"shape ({tokens},)", tuple(slot_mapping.shape))
    need(slot_mapping.device == key.device, "slot_mapping", f"device {key.device}",
         slot_mapping.device)


def validate_advance_step(num_seqs: int, num_queries: int, block_size: int,
                          input_tokens: torch.Tensor, sampled_token_ids: torch.Tensor,
                          input_positions: torch.Tensor, seq_lens: torch.Tensor,
                          slot_mapping: torch.Tensor, block_tables: torch.Tensor, *,
                          provider: str = "triton") -> None:
    """Dtypes, first dimensions and contiguity of an ``advance_step_flashattn`` call."""
    import torch

    op = "advance_step_flashattn"

    def need(ok: bool, argument: str, expected: str, got: object) -> None:
        check(ok, op, argument, expected, got, provider=provider)

    need(0 <= num_queries <= num_seqs, "num_queries", f"in [0, num_seqs={num_seqs}]",
         num_queries)
    need(block_size > 0, "block_size", "> 0", block_size)
    for name, t, dtype in (("input_tokens", input_tokens, torch.int64),
                           ("input_positions", input_positions, torch.int64),
                           ("seq_lens", seq_lens, torch.int32),
                           ("slot_mapping", slot_mapping, torch.int64)):
        need(t.dtype == dtype, name, f"dtype {dtype}", t.dtype)
        need(t.dim() >= 1 and t.shape[0] == num_seqs, name,
             f"first dimension num_seqs={num_seqs}", tuple(t.shape))
        need(t.is_contiguous(), name, "a contiguous tensor", f"strides {t.stride()}")
        need(t.device == block_tables.device, name, f"device {block_tables.device}", t.device)
    need(sampled_token_ids.dtype == torch.int64, "sampled_token_ids", "dtype torch.int64",
         sampled_token_ids.dtype)
    need(sampled_token_ids.dim() == 2 and sampled_token_ids.shape[0] >= num_queries,
         "sampled_token_ids", f"2-D with at least num_queries={num_queries} rows",
         tuple(sampled_token_ids.shape))
    need(block_tables.dtype == torch.int32, "block_tables", "dtype torch.int32",
         block_tables.dtype)
    need(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, "block_tables",
         f"2-D with first dimension num_seqs={num_seqs}", tuple(block_tables.shape))
    need(block_tables.stride(1) == 1, "block_tables", "contiguous rows",
         f"strides {block_tables.stride()}")
