"""Seeded inputs of the conformance cases: the same tensors in every run, on every machine.

A case draws its tensors from a generator seeded by the case's name, on the CPU; the kit
moves them to the device under test.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Final

import torch

__all__ = ["DTYPES", "seeded_generator", "seeded_randn"]

DTYPES: Final[tuple[tuple[str, torch.dtype], ...]] = (
    ("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))
"""Dtypes every op is checked in, with their case-name prefixes."""


def seeded_generator(name: str) -> torch.Generator:
    """A CPU generator seeded by ``name`` (its CRC-32)."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def seeded_randn(g: torch.Generator, shape: Sequence[int], dtype: torch.dtype,
                 scale: float = 1.0) -> torch.Tensor:
    """Standard-normal values times ``scale`` drawn from ``g``, in ``dtype``."""
    return (torch.randn(tuple(shape), generator=g) * scale).to(dtype)
