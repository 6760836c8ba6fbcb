"""Decode-step states for the MindSpore extension tests, and the native reference on them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def random_batch(num_seqs: int, num_queries: int, block_size: int, max_blocks: int,
                 seed: int) -> dict[str, np.ndarray]:
    """A decode-step state with shuffled block tables and garbage in the outputs.

    Every real sequence's next position fits its table (``seq_len < max_blocks*block_size``).
    """
    rng = np.random.default_rng(seed)
    return {
        "input_tokens": rng.integers(-5, 10_000, num_seqs, dtype=np.int64),
        "sampled_token_ids": rng.integers(0, 32_000, (num_queries, 1), dtype=np.int64),
        "input_positions": rng.integers(-5, 10_000, num_seqs, dtype=np.int64),
        "seq_lens": rng.integers(0, max_blocks * block_size, num_seqs, dtype=np.int32),
        "slot_mapping": rng.integers(-5, 10_000, num_seqs, dtype=np.int64),
        "block_tables": rng.permutation(num_seqs * max_blocks * 2)[: num_seqs * max_blocks]
        .astype(np.int32).reshape(num_seqs, max_blocks),
    }


def native_result(num_seqs: int, num_queries: int, block_size: int,
                  state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state after opmux's native reference ran on torch copies of ``state``."""
    import opmux

    native = opmux.get_op("advance_step_flashattn").impls["native"]
    tensors = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
    native(num_seqs, num_queries, block_size, tensors["input_tokens"],
           tensors["sampled_token_ids"], tensors["input_positions"], tensors["seq_lens"],
           tensors["slot_mapping"], tensors["block_tables"])
    return {k: t.numpy() for k, t in tensors.items()}


def to_ms(ms: Any, state: dict[str, np.ndarray]) -> dict[str, Any]:
    """MindSpore tensors holding copies of ``state``."""
    return {k: ms.Tensor(v.copy()) for k, v in state.items()}


def to_np(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v.asnumpy() for k, v in state.items()}
