"""Conformance cases of the communication ops.

The kit runs in one process, where the group ``"tp"`` has size 1 (nothing initialised):
the cases pin what a provider must do there (a contiguous copy, every dtype and layout,
any ``dim``). Multi-rank behaviour is tested with real process groups
(tests/layers/test_tensor_parallel_tp2.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from opmux.testing.case_table import Case, register_cases

__all__ = ["register_communication_cases"]

_GROUP = "tp"


def _inputs() -> Iterator[tuple[str, torch.Tensor]]:
    def gen(name: str) -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(name.encode()))

    yield "fp32-2d", torch.randn(6, 8, generator=gen("fp32-2d"))
    yield "bf16-3d", torch.randn(2, 4, 6, generator=gen("bf16-3d")).to(torch.bfloat16)
    yield "fp16-2d", torch.randn(4, 6, generator=gen("fp16-2d")).to(torch.float16)
    yield "fp32-transposed", torch.randn(8, 4, generator=gen("fp32-transposed")).t()
    yield "fp32-empty", torch.zeros(0, 4)


def all_reduce_cases() -> Iterator[Case]:
    """Cases of ``all_reduce``."""
    for name, x in _inputs():
        yield Case(name, (x, _GROUP))


def all_reduce_inplace_cases() -> Iterator[Case]:
    """Cases of ``all_reduce_`` (contiguous inputs: it reduces in place)."""
    for name, x in _inputs():
        yield Case(name, (x.contiguous(), _GROUP))


def all_gather_cases() -> Iterator[Case]:
    """Cases of ``all_gather`` (first, last and negative dims)."""
    for name, x in _inputs():
        yield Case(f"{name}-dim0", (x, 0, _GROUP))
        yield Case(f"{name}-dim-1", (x, -1, _GROUP))


def reduce_scatter_cases() -> Iterator[Case]:
    """Cases of ``reduce_scatter``."""
    for name, x in _inputs():
        yield Case(f"{name}-dim0", (x, 0, _GROUP))
        yield Case(f"{name}-dim1", (x, 1, _GROUP))


def register_communication_cases() -> None:
    """Register the generators above, ``<op>_cases`` for op ``<op>`` (replacing earlier
    ones)."""
    register_cases("all_reduce_", all_reduce_inplace_cases, replace=True)
    for generator in (all_reduce_cases, all_gather_cases, reduce_scatter_cases):
        register_cases(generator.__name__.removesuffix("_cases"), generator, replace=True)
