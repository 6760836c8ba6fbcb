"""opmux providers for vLLM's IR ops ``rms_norm`` and ``fused_add_rms_norm``.

vLLM runs an IR provider only when the user puts it in ``ir_op_priority``, e.g.
``LLM(..., kernel_config={"ir_op_priority": {"rms_norm": ["opmux"]}})``; the provider then
calls the opmux catalog op, so the winning opmux provider serves the IR op. Calls opmux does
not cover (no weight, ``variance_size``, a weight in another dtype) are declined through
``supports_args`` and go to vLLM's next provider.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from opmux.ops.layernorm import fused_add_rms_norm, rms_norm

__all__ = ["PROVIDER", "install"]

PROVIDER = "opmux"
"""The provider name under which the IR ops know opmux."""


def _rms_norm_ok(x: Tensor, weight: Optional[Tensor], epsilon: float,
                 variance_size: Optional[int] = None) -> bool:
    return variance_size is None and weight is not None and weight.dtype == x.dtype


def _fused_add_ok(x: Tensor, x_residual: Tensor, weight: Optional[Tensor], epsilon: float,
                  variance_size: Optional[int] = None) -> bool:
    return (variance_size is None and weight is not None and weight.dtype == x.dtype
            and x_residual.dtype == x.dtype)


def _rms_norm(x: Tensor, weight: Optional[Tensor], epsilon: float,
              variance_size: Optional[int] = None) -> Tensor:
    return rms_norm(x, weight, epsilon)  # type: ignore[no-any-return]


def _fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Optional[Tensor], epsilon: float,
                        variance_size: Optional[int] = None) -> tuple[Tensor, Tensor]:
    return fused_add_rms_norm(x, x_residual, weight, epsilon)  # type: ignore[no-any-return]


def install() -> list[str]:
    """Register the ``opmux`` provider on vLLM's IR ops that lack it; return those ops."""
    from vllm import ir

    done = []
    for op, fn, ok in ((ir.ops.rms_norm, _rms_norm, _rms_norm_ok),
                       (ir.ops.fused_add_rms_norm, _fused_add_rms_norm, _fused_add_ok)):
        if PROVIDER in op.impls:
            continue
        op.register_impl(PROVIDER, supports_args=ok)(fn)
        done.append(op.name)
    return done
