"""Bad inputs of the dense linear op ``linear``.

Registered by :func:`register_linear_bad_inputs` (called by :mod:`opmux.testing.bad_inputs`).
Every row is refused by native and by every provider with an :class:`opmux.OpInputError`
naming the argument in the row."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.testing.bad_input_table import BadInput, register_bad_inputs

__all__ = ["linear_bad_inputs", "register_linear_bad_inputs"]

_META = torch.device("meta")


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + 11)
    return torch.randn(shape, generator=g).to(dtype)


def linear_bad_inputs() -> Iterator[BadInput]:
    """Rows of ``linear``: one row of x (what the ``cpp`` kernel takes) unless the row is
    about x."""
    x, w, b = _t(1, 16), _t(8, 16), _t(8)

    def row(label: str, argument: str, x: object = x, weight: object = w,
            bias: object = b) -> BadInput:
        return BadInput(label, (x, weight, bias), {}, argument)

    yield row("x-none", "x", x=None)
    yield row("x-0d", "x", x=torch.tensor(1.0))
    yield row("x-int64", "x", x=torch.arange(16).reshape(1, 16))
    yield row("x-bool", "x", x=torch.ones(1, 16, dtype=torch.bool))
    yield row("x-complex", "x", x=torch.ones(1, 16, dtype=torch.complex64))
    yield row("x-on-meta", "x", x=torch.empty(1, 16, device=_META))
    yield row("weight-none", "weight", weight=None)
    yield row("weight-1d", "weight", weight=_t(16))
    yield row("weight-3d", "weight", weight=_t(1, 8, 16))
    yield row("weight-in-short", "weight", weight=_t(8, 15))
    yield row("weight-in-long", "weight", weight=_t(8, 17))
    yield row("weight-transposed-shape", "weight", weight=_t(16, 8))
    yield row("weight-int32", "weight", weight=torch.ones(8, 16, dtype=torch.int32))
    yield row("weight-bf16", "weight", weight=w.to(torch.bfloat16))
    yield row("weight-float64", "weight", weight=w.double())
    yield row("weight-on-meta", "weight", weight=torch.empty(8, 16, device=_META))
    yield row("bias-0d", "bias", bias=torch.tensor(0.5))
    yield row("bias-2d", "bias", bias=b.reshape(1, 8))
    yield row("bias-short", "bias", bias=_t(7))
    yield row("bias-long", "bias", bias=_t(9))
    yield row("bias-int64", "bias", bias=torch.arange(8))
    yield row("bias-bf16", "bias", bias=b.to(torch.bfloat16))
    yield row("bias-on-meta", "bias", bias=torch.empty(8, device=_META))
    yield row("x-two-rows-weight-short", "weight", x=_t(2, 16), weight=_t(8, 12))
    yield row("x-bf16-weight-fp32", "weight", x=x.to(torch.bfloat16))


def register_linear_bad_inputs() -> None:
    """Register the generator above."""
    register_bad_inputs("linear", linear_bad_inputs)
