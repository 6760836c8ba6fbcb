"""Seeded conformance cases of the quantisation op (:mod:`opmux.ops.quant`): ``quant_fp8``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.testing.case_table import Case, register_cases
from opmux.testing.seeded import DTYPES, seeded_generator, seeded_randn

__all__ = [
    "quant_fp8_cases",
    "register_quant_cases",
]


def quant_fp8_cases() -> Iterator[Case]:
    """Cases of ``quant_fp8``, compared exactly: every mode, zero rows, wide ranges."""
    def make(name: str, dt: torch.dtype, shape: tuple[int, ...], *args: object) -> Case:
        g = seeded_generator(name)
        x = seeded_randn(g, shape, dt, 4.0)
        if x.dim() >= 2 and x.shape[-2] > 2 and x.shape[-1] > 0:
            x[..., 1, :] = 0  # an all-zero row: the scale's lower bound
            x[..., 2, :] *= 1e3  # a wide row
        return Case(name, (x, *args), atol=0.0, rtol=0.0)

    for tag, dt in DTYPES:
        yield make(f"{tag}-dynamic-tensor", dt, (9, 256))
        yield make(f"{tag}-dynamic-token", dt, (9, 256), None, True)
        yield make(f"{tag}-dynamic-group128", dt, (6, 512), None, False, None, 128)
        yield make(f"{tag}-static-tensor", dt, (5, 64), torch.tensor(0.02))
    yield make("fp32-dynamic-token-ub", torch.float32, (8, 96), None, True,
               torch.tensor([0.5]))
    yield make("fp32-dynamic-group-ragged-3d", torch.float32, (2, 4, 200), None, False, None, 64)
    yield make("bf16-dynamic-group-ue8m0", torch.bfloat16, (5, 256), None, False, None, 128,
               True)
    yield make("fp32-dynamic-group1", torch.float32, (3, 16), None, False, None, 1)
    yield make("fp32-dynamic-3d-token", torch.float32, (2, 3, 40), None, True)
    yield make("fp32-dynamic-1d", torch.float32, (100,))
    def scales(name: str, shape: tuple[int, int], spread: float, low: float) -> torch.Tensor:
        return torch.rand(shape, generator=seeded_generator(name + "-scale")) * spread + low

    yield make("fp32-static-token", torch.float32, (6, 80),
               scales("token", (6, 1), 0.1, 1e-3))
    yield make("fp32-static-channel", torch.float32, (6, 80),
               scales("channel", (1, 80), 0.1, 1e-3))
    yield make("bf16-static-block", torch.bfloat16, (8, 256),
               scales("block", (4, 2), 0.05, 1e-3))
    yield make("fp32-static-3d-group", torch.float32, (2, 6, 64),
               scales("3d-group", (3, 4), 1.0, 0.01))
    yield make("fp32-static-1elem-2d", torch.float32, (4, 32), torch.tensor([[0.5]]))
    yield make("fp32-static-empty", torch.float32, (0, 32), torch.tensor([1.0]))
    yield make("fp32-dynamic-token-empty", torch.float32, (0, 32), None, True)


def register_quant_cases() -> None:
    """Register the generators above (replacing earlier ones)."""
    register_cases("quant_fp8", quant_fp8_cases, replace=True)
