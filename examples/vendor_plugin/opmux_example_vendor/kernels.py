"""The example vendor's provider: ``silu_and_mul`` on the CPU key.

It computes the gate in place on a scratch copy (one fewer temporary than the reference)
and is correct for every float dtype; it declines float64 to show ``supports_args``. It runs
the catalog's own input check first (:mod:`opmux.ops.checks`, with its provider name), so it
refuses exactly what the native reference refuses, with the same error.
"""

from __future__ import annotations

from typing import Any

import torch

from opmux.ops.checks import check_silu_and_mul

PROVIDER = "example_vendor"


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    check_silu_and_mul(x, provider=PROVIDER, read_data=False)
    d = x.shape[-1] // 2
    gate = x[..., :d].to(torch.float32, copy=True)  # a scratch copy: x is not ours to write
    torch.nn.functional.silu(gate, inplace=True)
    return gate.mul_(x[..., d:]).to(x.dtype)


def silu_and_mul_supports(x: torch.Tensor) -> bool:
    return x.dtype in (torch.float32, torch.float16, torch.bfloat16) and x.shape[-1] % 2 == 0


def register(registry: Any) -> None:
    op = registry.get_op("silu_and_mul")
    op.register_impl(PROVIDER, dispatch_key="CPU",
                     supports_args=silu_and_mul_supports)(silu_and_mul)
