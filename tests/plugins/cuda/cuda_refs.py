"""Random inputs for the CUDA plugin tests (references are the catalog natives)."""

from __future__ import annotations

import torch
from torch import Tensor

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
"""(atol, rtol) per dtype. bf16 is loose by one ulp more than usual: Triton 3.9's interpreter
truncates fp32 -> bf16 conversions where a GPU rounds to nearest even."""

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol)


def paged_case(q_lens: list[int], kv_lens: list[int], heads: int, kv_heads: int, head_size: int,
               block_size: int, dtype: torch.dtype, device: torch.device, pad_rows: int = 0,
               seed: int = 0) -> dict[str, Tensor]:
    """A ragged batch with a shuffled block table (blocks of different sequences interleave).

    :param pad_rows: extra query rows after the last sequence (graph padding).
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, -(-n // block_size)) for n in kv_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = perm[used:used + n]
        used += n
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(qsl[-1]) + pad_rows
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return {
        "query": mk(tokens, heads, head_size).to(device),
        "key_cache": mk(num_blocks, block_size, kv_heads, head_size).to(device),
        "value_cache": mk(num_blocks, block_size, kv_heads, head_size).to(device),
        "block_tables": table.to(device),
        "seq_lens": torch.tensor(kv_lens, dtype=torch.int32, device=device),
        "query_start_loc": qsl.to(device),
    }
