"""Random ragged batches for ``paged_attention`` and the layouts built on it.

One builder for the conformance cases, the kernel tests of every plugin and the benchmarks:
sequence ``i`` has ``q_lens[i]`` query rows and ``kv_lens[i]`` cached tokens, its blocks are
taken from a shuffled pool (so the blocks of different sequences interleave, as in a real
cache), and the table slots past a sequence's blocks hold ``unused`` (random valid block ids by
default: a kernel that reads past ``seq_lens`` reads real, wrong data).

>>> from opmux.testing import paged_batch
>>> b = paged_batch([1, 3], [5, 3], heads=4, kv_heads=2, head_size=8, block_size=4, seed=0)
>>> b.query.shape, b.key_cache.shape, b.block_tables.shape
(torch.Size([4, 4, 8]), torch.Size([6, 4, 2, 8]), torch.Size([2, 3]))
>>> b.seq_lens.tolist(), b.query_start_loc.tolist()
([5, 3], [0, 1, 4])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

__all__ = ["PagedBatch", "paged_batch"]


@dataclass(frozen=True)
class PagedBatch:
    """The tensors of one batch, named as the catalog ``paged_attention`` arguments."""

    #: ``[T, H, D]`` query rows of every sequence, back to back (then ``pad_rows``).
    query: Tensor
    #: ``[num_blocks, block_size, Hkv, D]``.
    key_cache: Tensor
    #: ``[num_blocks, block_size, Hkv, D]``.
    value_cache: Tensor
    #: ``[S, max_blocks]`` int32.
    block_tables: Tensor
    #: ``[S]`` int32 cached tokens per sequence.
    seq_lens: Tensor
    #: ``[S + 1]`` int32 row offsets.
    query_start_loc: Tensor

    def as_dict(self) -> dict[str, Tensor]:
        """The six tensors by argument name (``op(**batch.as_dict(), scale=...)``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def args(self, scale: float | None = None, sliding_window: int | None = None,
             soft_cap: float | None = None) -> tuple[Any, ...]:
        """The catalog op's positional arguments; ``scale`` defaults to ``D ** -0.5``."""
        if scale is None:
            scale = self.query.shape[-1] ** -0.5
        return (*self.as_dict().values(), scale, sliding_window, soft_cap)


def paged_batch(q_lens: Sequence[int], kv_lens: Sequence[int], *, heads: int = 8,
                kv_heads: int = 2, head_size: int = 32, block_size: int = 16,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                pad_rows: int = 0, spare_blocks: int = 3, extra_columns: int = 1,
                unused: int | None = None, seed: int | None = None,
                generator: torch.Generator | None = None) -> PagedBatch:
    """A random ragged batch with a shuffled block table.

    :param q_lens: query rows per sequence (0 allowed).
    :param kv_lens: cached tokens per sequence (``>= q_lens[i]`` for the catalog op).
    :param pad_rows: extra query rows after the last sequence (graph padding).
    :param spare_blocks: cache blocks no sequence owns.
    :param extra_columns: table columns beyond the longest sequence's blocks.
    :param unused: the value of table slots past a sequence's blocks; ``None``: random ids
        of real blocks.
    :param seed: seeds a fresh generator (default 0) when ``generator`` is not given.
    :param generator: the random source, for callers that draw more from it.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(seed or 0)
    per_seq = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(per_seq) + spare_blocks
    max_blocks = max(per_seq, default=0) + extra_columns
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    if unused is None:
        tables = torch.randint(0, max(num_blocks, 1), (len(kv_lens), max_blocks), generator=g,
                               dtype=torch.int32)
    else:
        tables = torch.full((len(kv_lens), max_blocks), unused, dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[start:start + n]
        start += n
    cache_shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=g).to(dtype)
    value_cache = torch.randn(cache_shape, generator=g).to(dtype)
    query = torch.randn(sum(q_lens) + pad_rows, heads, head_size, generator=g).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(list(q_lens), dtype=torch.int32).cumsum(0)
    seq_lens = torch.tensor(list(kv_lens), dtype=torch.int32)
    return PagedBatch(*(t.to(device) for t in (query, key_cache, value_cache, tables,
                                               seq_lens, qsl)))
