"""Paged KV-cache bookkeeping: ``reshape_and_cache`` and ``advance_step_flashattn``."""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
import torch
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks import check_advance_step_flashattn, check_reshape_and_cache
from opmux.ops.kv_formats import canonical_caches, resolve_kv_cache_format, scatter_canonical

__all__ = ["advance_step_flashattn", "reshape_and_cache"]


@register_op(mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor, kv_cache_format: str = "canonical") -> None:
    """Write token ``t``'s key and value into slot ``slot_mapping[t]`` of the paged caches.

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; slot ``-1`` is
    skipped (padding token). Nothing is written when validation fails.

    :param key: ``[T, Hkv, D]``, the caches' dtype.
    :param value: ``[T, Hkv, D]``.
    :param key_cache: ``[num_blocks, block_size, Hkv, D]``, written in place. Any strided
        view of that logical shape is accepted: a permuted ``HND`` buffer, or K and V as two
        views of one ``[num_blocks, 2, block_size, Hkv, D]`` allocation (``kv[:, 0]``);
        only self-overlapping (expanded) views are refused.
    :param value_cache: same shape and dtype as ``key_cache`` (its strides may differ);
        written in place.
    :param slot_mapping: ``[T]`` int64, each ``-1`` or in ``[0, num_blocks*block_size)``;
        a slot other than ``-1`` appears at most once (two tokens in one slot would leave
        a provider-dependent winner, so it is refused).
    :param kv_cache_format: the registered :class:`opmux.KVCacheFormat` the caches are in
        (:func:`opmux.kv_cache_format` says which to allocate); the shapes above are those of
        its ``to_canonical`` form, and the write is the format's own.
    :raises opmux.OpInputError: bad shapes, dtypes or devices, an overlapping cache view, a
        zero block size, a slot out of range, or an unregistered ``kv_cache_format``.
    """
    if kv_cache_format == "canonical":
        check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        # (block, offset) indexing writes through any strided view of the caches in place
        scatter_canonical(key, value, key_cache, value_cache, slot_mapping)
        return
    fmt = resolve_kv_cache_format("reshape_and_cache", kv_cache_format)
    kc, vc = canonical_caches("reshape_and_cache", kv_cache_format, key_cache, value_cache)
    check_reshape_and_cache(key, value, kc, vc, slot_mapping)
    fmt.write(key, value, key_cache, value_cache, slot_mapping)


@reshape_and_cache.register_meta
def _reshape_and_cache_fake(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                            slot_mapping: Tensor, kv_cache_format: str = "canonical") -> None:
    kc, vc = canonical_caches("reshape_and_cache", kv_cache_format, key_cache, value_cache)
    check_reshape_and_cache(key, value, kc, vc, slot_mapping, read_data=False)


@register_op(mutates_args=("input_tokens", "input_positions", "seq_lens", "slot_mapping"))
def advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                           input_tokens: Tensor, sampled_token_ids: Tensor,
                           input_positions: Tensor, seq_lens: Tensor, slot_mapping: Tensor,
                           block_tables: Tensor) -> None:
    """Advance the decode state of ``num_seqs`` sequences by one sampled token, in place.

    For ``i < num_queries``: ``input_tokens[i] = sampled_token_ids[i, 0]``; with
    ``pos = seq_lens[i]``: ``input_positions[i] = pos``, ``seq_lens[i] = pos + 1`` and
    ``slot_mapping[i] = block_tables[i, pos // block_size] * block_size + pos % block_size``.
    Rows ``num_queries <= i < num_seqs`` are graph padding: token 0, position 0, slot -1,
    ``seq_lens`` untouched.

    >>> import torch, opmux
    >>> tokens, pos = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    >>> lens = torch.tensor([6, 8, 6, 6], dtype=torch.int32)
    >>> slots = torch.zeros(4, dtype=torch.int64)
    >>> tables = torch.arange(4, dtype=torch.int32).view(4, 1)
    >>> sampled = torch.tensor([[11], [12], [13], [14]])
    >>> opmux.ops.advance_step_flashattn(4, 4, 128, tokens, sampled, pos, lens, slots, tables)
    >>> pos.tolist(), lens.tolist(), slots.tolist()
    ([6, 8, 6, 6], [7, 9, 7, 7], [6, 136, 262, 390])

    The state vectors may be any non-overlapping strided views (written in place through
    their strides); ``sampled_token_ids`` may be ``[num_queries]`` or have extra rows.

    :raises opmux.OpInputError: wrong dtype, an overlapping (expanded) state view, wrong first
        dimension, a next position outside the block table or a negative block id there;
        nothing is written then.
    """
    check_advance_step_flashattn(num_seqs, num_queries, block_size, input_tokens,
                                 sampled_token_ids, input_positions, seq_lens, slot_mapping,
                                 block_tables)
    n = num_queries
    # compute everything first, then write
    sampled = sampled_token_ids.reshape(-1)[:n] if sampled_token_ids.dim() == 1 \
        else sampled_token_ids[:n, 0]
    pos = seq_lens[:n].to(torch.int64)
    block_idx = torch.div(pos, block_size, rounding_mode="floor")
    blocks = block_tables[:n].gather(1, block_idx.unsqueeze(1)).squeeze(1).to(torch.int64)
    slots = blocks * block_size + pos % block_size
    input_tokens[:n] = sampled
    input_positions[:n] = pos
    seq_lens[:n] += 1
    slot_mapping[:n] = slots
    input_tokens[n:] = 0
    input_positions[n:] = 0
    slot_mapping[n:] = -1


@advance_step_flashattn.register_meta
def _advance_step_flashattn_fake(num_seqs: int, num_queries: int, block_size: int,
                                 input_tokens: Tensor, sampled_token_ids: Tensor,
                                 input_positions: Tensor, seq_lens: Tensor,
                                 slot_mapping: Tensor, block_tables: Tensor) -> None:
    check_advance_step_flashattn(num_seqs, num_queries, block_size, input_tokens,
                                 sampled_token_ids, input_positions, seq_lens, slot_mapping,
                                 block_tables, read_data=False)
