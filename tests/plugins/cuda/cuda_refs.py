"""Random inputs for the CUDA plugin tests (references are the catalog natives)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

import opmux
from opmux.testing import paged_batch

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
"""(atol, rtol) per dtype. bf16 is loose by one ulp more than usual: Triton 3.9's interpreter
truncates fp32 -> bf16 conversions where a GPU rounds to nearest even."""

OpsFactory = Callable[[Iterable[str]], dict[str, opmux.Op]]
"""The ``triton_ops_in`` fixture (conftest): registers the named ops with ``triton`` first."""

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
    return paged_batch(q_lens, kv_lens, heads=heads, kv_heads=kv_heads, head_size=head_size,
                       block_size=block_size, dtype=dtype, device=device, pad_rows=pad_rows,
                       unused=0, seed=seed).as_dict()


def case_id(value: object) -> str:
    """Test id of a parameter that is a name or a conformance case (the case's name)."""
    return value if isinstance(value, str) else value.name  # type: ignore[attr-defined]


def close_outputs(got: object, want: object, dtype: torch.dtype) -> None:
    """:func:`close` over every output (a tensor or a tuple of them), same shapes and dtypes."""
    gots = got if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    for g, w in zip(gots, wants, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        close(g, w, dtype)
