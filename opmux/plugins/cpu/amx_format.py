"""``amx_bf16``: a tile-packed KV-cache format, laid out the way AMX bf16 tile products take
their second operand (``TDPBF16PS`` multiplies ``A[M, 2K]`` by ``B`` stored as ``K`` rows of
``N`` pairs: row ``r`` holds ``(B[2r, n], B[2r + 1, n])`` for every column ``n``).

Per block and kv head:

- keys ``[D / 2, block_size, 2]``: the ``B`` operand of the scores ``q . k`` (``B = K^T``,
  pairs along the head dim): element ``(r, t, j)`` is ``K[t, 2r + j]``; 16 tokens x 2 dims
  of one pair-row are one 64-byte tile row;
- values ``[block_size / 2, D, 2]``: the ``B`` operand of ``p . V`` (pairs along the tokens):
  element ``(r, d, j)`` is ``V[2r + j, d]``.

Storage: key ``[num_blocks, Hkv, D / 2, block_size, 2]``, value ``[num_blocks, Hkv,
block_size / 2, D, 2]``; even ``D`` and ``block_size``. Any float dtype is packed alike (the
pairing is what AMX's bf16 products need). ``to_canonical`` copies (the pairs do not merge
into one stride), so the format has its own writer.

The ``cpp`` provider registers the format but does not read it yet: its kernels decline it
(``supports_args``) and the catalog's native reads it through ``to_canonical``.
"""

from __future__ import annotations

from typing import Final

import torch
from torch import Tensor

from opmux.ops.kv_formats import KVCacheFormat, slot_positions

__all__ = ["AMX_BF16", "AmxBf16Format"]


class AmxBf16Format(KVCacheFormat):
    """Keys pair-interleaved along D, values pair-interleaved along the tokens (see module)."""

    name = "amx_bf16"
    views = False
    description = ("key [blocks, Hkv, D/2, block_size, 2], value [blocks, Hkv, block_size/2, "
                   "D, 2] (AMX bf16 B-operand pairs)")

    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device | str | None = None
                 ) -> tuple[Tensor, Tensor]:
        if head_size % 2 or block_size % 2:
            raise ValueError(f"KV-cache format 'amx_bf16' packs pairs: head_size and "
                             f"block_size must be even, got {head_size} and {block_size}")
        key = torch.zeros((num_blocks, num_kv_heads, head_size // 2, block_size, 2),
                          dtype=dtype, device=device)
        value = torch.zeros((num_blocks, num_kv_heads, block_size // 2, head_size, 2),
                            dtype=dtype, device=device)
        return key, value

    @staticmethod
    def _key_view(key_cache: Tensor) -> Tensor:
        """``[blocks, bs, Hkv, D/2, 2]`` view of the packed keys."""
        return key_cache.permute(0, 3, 1, 2, 4)

    @staticmethod
    def _value_view(value_cache: Tensor) -> Tensor:
        """``[blocks, bs/2, 2, Hkv, D]`` view of the packed values."""
        return value_cache.permute(0, 2, 4, 1, 3)

    def to_canonical(self, key_cache: Tensor, value_cache: Tensor) -> tuple[Tensor, Tensor]:
        shapes_ok = key_cache.dim() == 5 and key_cache.shape[4] == 2
        if shapes_ok:
            nb, hkv, half_d, bs, _ = key_cache.shape
            shapes_ok = bs % 2 == 0 and tuple(value_cache.shape) == (nb, hkv, bs // 2,
                                                                     2 * half_d, 2)
        if not shapes_ok:
            raise ValueError(f"'amx_bf16' caches are key [blocks, Hkv, D/2, bs, 2] and value "
                             f"[blocks, Hkv, bs/2, D, 2] (even bs), got "
                             f"{list(key_cache.shape)} and {list(value_cache.shape)}")
        key = self._key_view(key_cache).reshape(nb, bs, hkv, 2 * half_d)
        value = self._value_view(value_cache).reshape(nb, bs, hkv, 2 * half_d)
        return key, value

    def write(self, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
              slot_mapping: Tensor) -> None:
        valid, blocks, offsets = slot_positions(slot_mapping, key_cache.shape[3])
        k, v = key[valid], value[valid]
        self._key_view(key_cache).index_put_(
            (blocks, offsets), k.reshape(k.shape[0], k.shape[1], -1, 2))
        self._value_view(value_cache).index_put_(
            (blocks, torch.div(offsets, 2, rounding_mode="floor"), offsets % 2), v)


AMX_BF16: Final = AmxBf16Format()
"""The format object the ``cpp`` provider registers."""
