"""The example vendor's kernels: two catalog providers and an op of its own.

``silu_and_mul`` and ``rms_norm`` serve the catalog ops on the ``CPU`` key as provider
``example_vendor``; ``example_vendor::softcap`` is an op this plugin defines, with its own
native reference and provider. Each provider computes in float32 and rounds once, as its
native does. Each checks once: its ``supports_args`` is its whole acceptance test, on
metadata only (the conditions of the catalog's static check, :mod:`opmux.ops.checks`, and
its own: no float64, CPU tensors), so it never accepts what the native reference refuses; a
call it declines runs the next provider, finally native, whose check gives the error. The
impls then compute without checking again.
"""

from __future__ import annotations

from typing import Any

import torch

PROVIDER = "example_vendor"
NAMESPACE = "example_vendor"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    gate = x[..., :d].to(torch.float32, copy=True)  # a scratch copy: x is not ours to write
    torch.nn.functional.silu(gate, inplace=True)
    return gate.mul_(x[..., d:]).to(x.dtype)


def silu_and_mul_supports(x: torch.Tensor) -> bool:
    # a CPU x[..., 2*d] of a float dtype other than float64
    return (isinstance(x, torch.Tensor) and x.dtype in _FLOATS and x.is_cpu and x.dim() >= 1
            and x.shape[-1] % 2 == 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    out = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return out.to(x.dtype)


def rms_norm_supports(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> bool:
    # a CPU x[..., d] and weight [d] of float dtypes other than float64, a real eps >= 0
    # (NaN fails the comparison)
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and x.dtype in _FLOATS and weight.dtype in _FLOATS and x.is_cpu and weight.is_cpu
            and x.dim() >= 1 and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
            and type(eps) in (float, int) and eps >= 0)


def softcap_native(x: torch.Tensor, cap: float = 30.0) -> torch.Tensor:
    """``cap * tanh(x / cap)``, computed in float32 and returned in ``x.dtype``."""
    if not x.is_floating_point():
        raise TypeError(f"example_vendor::softcap: x must be a floating tensor, got {x.dtype}")
    if not cap > 0:
        raise ValueError(f"example_vendor::softcap: cap must be > 0, got {cap!r}")
    xf = x.float()
    return (cap * torch.tanh(xf / cap)).to(x.dtype)


def softcap(x: torch.Tensor, cap: float = 30.0) -> torch.Tensor:
    out = x.to(torch.float32, copy=True)
    return out.div_(cap).tanh_().mul_(cap).to(x.dtype)


def softcap_supports(x: torch.Tensor, cap: float = 30.0) -> bool:
    return x.dtype in _FLOATS and cap > 0


def register(registry: Any) -> None:
    """Register the providers, the op of its own and that op's conformance cases."""
    from opmux.testing import register_cases
    from opmux_example_vendor.cases import softcap_cases

    registry.get_op("silu_and_mul").register_impl(
        PROVIDER, dispatch_key="CPU", supports_args=silu_and_mul_supports)(silu_and_mul)
    registry.get_op("rms_norm").register_impl(
        PROVIDER, dispatch_key="CPU", supports_args=rms_norm_supports)(rms_norm)
    op = registry.register_op(softcap_native, name="softcap", namespace=NAMESPACE)
    op.register_impl(PROVIDER, dispatch_key="CPU", supports_args=softcap_supports)(softcap)
    register_cases(op.qualname, softcap_cases, replace=True)
