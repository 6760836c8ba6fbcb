"""Conformance cases of ``example_vendor::softcap`` for the opmux conformance kit."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.testing import Case


def softcap_cases() -> Iterator[Case]:
    """Seeded inputs: each float dtype, a strided view, an empty tensor, large values."""
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (torch.randn(4, 33, generator=gen) * 40).to(dtype)
        yield Case(f"{str(dtype).removeprefix('torch.')}", (x,))
        yield Case(f"{str(dtype).removeprefix('torch.')}-cap5", (x, 5.0))
    wide = torch.randn(8, 64, generator=gen) * 40
    yield Case("fp32-strided", (wide[:, ::2],))
    yield Case("fp32-empty", (torch.empty(0, 16),))
