"""Norm layers of vLLM's CustomOp table: :class:`RMSNorm`, :class:`GemmaRMSNorm`,
:class:`RMSNormGated`.

Class names, constructor arguments, parameter names and forward results are vLLM 0.32's.
``forward_native`` is plain PyTorch with vLLM's arithmetic (dtype by dtype); the platform
paths call the catalog ops (``rms_norm`` / ``fused_add_rms_norm``, ``gemma_rms_norm`` /
``gemma_fused_add_rms_norm``, ``rms_norm_gated``), so every provider serves the layers.

Inputs are never modified: with a residual the layers return a new ``(out, residual)`` pair
(vLLM's ``maybe_inplace`` lets a kernel reuse the inputs' storage; callers use the returned
pair either way). A residual whose dtype differs from ``x``'s (vLLM accepts it; the new
residual is rounded to ``x.dtype``) takes ``forward_native`` on every path, as does
``RMSNorm(var_hidden_size=...)``.

>>> import torch
>>> from opmux.layers import RMSNorm
>>> norm = RMSNorm(8)
>>> out, residual = norm(torch.ones(2, 8), torch.ones(2, 8))
>>> out[0, 0].item(), residual[0, 0].item()
(1.0, 2.0)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.layers._argument_checks import check_eps, check_size
from opmux.layers.custom_op import CustomOp
from opmux.ops.checks import GATE_ACTIVATIONS
from opmux.ops.layernorm import (
    fused_add_rms_norm,
    gemma_fused_add_rms_norm,
    gemma_rms_norm,
    rms_norm,
    rms_norm_gated,
)

__all__ = ["GemmaRMSNorm", "RMSNorm", "RMSNormGated"]


def _rms_normalize(xf: Tensor, eps: float, variance_size: int | None) -> Tensor:
    x_var = xf if variance_size is None else xf[..., :variance_size]
    return xf * torch.rsqrt(x_var.pow(2).mean(dim=-1, keepdim=True) + eps)


def _scaled(normed: Tensor, weight: Tensor | None, dtype: torch.dtype) -> Tensor:
    # vLLM: the fp32 result goes to the weight's dtype before the multiply
    if weight is not None:
        normed = normed.to(weight.dtype) * weight
    return normed.to(dtype)


def rms_norm_reference(x: Tensor, weight: Tensor | None, eps: float,
                       variance_size: int | None = None) -> Tensor:
    """vLLM 0.32's ``rms_norm``: fp32 statistics over the first ``variance_size`` elements."""
    return _scaled(_rms_normalize(x.float(), eps, variance_size), weight, x.dtype)


def fused_add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float,
                                 variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    """vLLM 0.32's ``fused_add_rms_norm``: fp32 sum, rounded for the residual only."""
    s = x.float() + residual.float()
    return _scaled(_rms_normalize(s, eps, variance_size), weight, x.dtype), s.to(x.dtype)


class _RMSNormOps(CustomOp):
    """The platform path of the RMS norm layers: ``_ops`` (the norm and the fused-add norm
    catalog ops) unless ``_native_only`` or the residual's dtype differs from ``x``'s (the
    catalog ops take one dtype; vLLM allows a mix)."""

    _ops: ClassVar[tuple[Any, Any]] = (rms_norm, fused_add_rms_norm)
    #: the layer has no catalog op for its configuration (set by the constructor)
    _native_only: bool = False
    weight: Tensor
    variance_epsilon: float

    def forward_native(self, x: Tensor, residual: Tensor | None = None
                       ) -> Tensor | tuple[Tensor, Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement forward_native")

    def _forward_ops(self, x: Tensor, residual: Tensor | None = None
                     ) -> Tensor | tuple[Tensor, Tensor]:
        if self._native_only or (residual is not None and residual.dtype != x.dtype):
            return self.forward_native(x, residual)
        # the weight straight from the module's tables: ``self.weight`` would go through
        # Module.__getattr__, a frame per call (tests/layers/test_custom_op.py counts them)
        weight: Tensor | None = self._parameters.get("weight")
        if weight is None:
            weight = self._buffers["weight"]
        norm, fused_add_norm = self._ops
        if residual is None:
            out: Tensor = norm(x, weight, self.variance_epsilon)
            return out
        pair: tuple[Tensor, Tensor] = fused_add_norm(x, residual, weight, self.variance_epsilon)
        return pair

    forward_cpu = forward_cuda = forward_hip = forward_xla = forward_npu = _forward_ops

    def extra_repr(self) -> str:
        return f"hidden_size={self.weight.shape[0]}, eps={self.variance_epsilon}"


@CustomOp.register("rms_norm")
class RMSNorm(_RMSNormOps):
    """Root-mean-square norm: ``x / sqrt(mean(x**2) + eps) * weight``.

    :param hidden_size: d.
    :param eps: added to the mean square (``variance_epsilon``).
    :param var_hidden_size: take the mean square over the first ``var_hidden_size``
        elements only (``None`` or ``hidden_size``: all). The platform paths have no catalog
        op for this and run ``forward_native``.
    :param has_weight: learn ``weight``; without it ``weight`` is a non-persistent buffer of
        ones (so ``state_dict`` matches vLLM's and the layer still moves with ``.to()``).
    :param dtype: the weight's dtype (default: torch's default dtype).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, var_hidden_size: int | None = None,
                 has_weight: bool = True, dtype: torch.dtype | None = None) -> None:
        check_size("RMSNorm", "hidden_size", hidden_size)
        check_eps("RMSNorm", eps)
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.variance_size_override = (
            None if var_hidden_size == hidden_size else var_hidden_size)
        self._native_only = self.variance_size_override is not None
        self.has_weight = has_weight
        ones = torch.ones(hidden_size, dtype=dtype or torch.get_default_dtype())
        self.weight: Tensor
        if has_weight:
            self.weight = torch.nn.Parameter(ones)
        else:
            self.register_buffer("weight", ones, persistent=False)

    def forward_native(self, x: Tensor, residual: Tensor | None = None
                       ) -> Tensor | tuple[Tensor, Tensor]:
        weight = self.weight.data if self.has_weight else None
        if residual is None:
            return rms_norm_reference(x, weight, self.variance_epsilon,
                                      self.variance_size_override)
        return fused_add_rms_norm_reference(x, residual, weight, self.variance_epsilon,
                                            self.variance_size_override)



@CustomOp.register("gemma_rms_norm")
class GemmaRMSNorm(_RMSNormOps):
    """Gemma's RMS norm: ``x / sqrt(mean(x**2) + eps) * (1 + weight)``, all in fp32.

    ``weight`` starts at zeros (the identity scale), in torch's default dtype.

    :param hidden_size: d.
    :param eps: added to the mean square (``variance_epsilon``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        check_size("GemmaRMSNorm", "hidden_size", hidden_size)
        check_eps("GemmaRMSNorm", eps)
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    _ops = (gemma_rms_norm, gemma_fused_add_rms_norm)

    def forward_native(self, x: Tensor, residual: Tensor | None = None
                       ) -> Tensor | tuple[Tensor, Tensor]:
        weight = self.weight.float() + 1.0
        if residual is None:
            return rms_norm_reference(x, weight, self.variance_epsilon)
        return fused_add_rms_norm_reference(x, residual, weight, self.variance_epsilon)



@CustomOp.register("rms_norm_gated")
class RMSNormGated(CustomOp):
    """RMS norm with an optional SiLU (or sigmoid) gate and optional groups.

    With a gate ``z``: ``norm(x) * act(z)`` when ``norm_before_gate``, else
    ``norm(x * act(z))``; statistics per group of ``group_size`` elements (``None``: one
    group). fp32 throughout, rounded once to ``x.dtype``.

    :param hidden_size: d.
    :param eps: added to the mean square.
    :param group_size: ``None`` or a divisor of ``hidden_size``.
    :param norm_before_gate: normalise first, then gate.
    :param device: where ``weight`` is created.
    :param dtype: ``weight``'s dtype.
    :param activation: ``"swish"``/``"silu"`` or ``"sigmoid"``.
    :raises ValueError: for an unknown activation or a group size that does not divide d.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, activation: str = "swish") -> None:
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"RMSNormGated: activation must be one of "
                             f"{sorted(GATE_ACTIVATIONS)}, got {activation!r}")
        if group_size is not None and (group_size <= 0 or hidden_size % group_size != 0):
            raise ValueError(f"RMSNormGated: group_size must be None or a positive divisor of "
                             f"hidden_size={hidden_size}, got {group_size}")
        super().__init__()
        self.eps = eps
        self.activation = activation
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    @staticmethod
    def forward_static(x: Tensor, z: Tensor | None, weight: Tensor, epsilon: float,
                       orig_dtype: torch.dtype, group_size: int | None = None,
                       norm_before_gate: bool = True, activation: str = "swish") -> Tensor:
        """The plain-PyTorch computation (vLLM exposes it under this name too)."""
        xf, wf = x.float(), weight.float()
        act: Any = torch.sigmoid if activation == "sigmoid" else F.silu
        zf = z.float() if z is not None else None
        if zf is not None and not norm_before_gate:
            xf = xf * act(zf)
        if group_size is None:
            out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + epsilon) * wf
        else:
            xg = xf.unflatten(-1, (-1, group_size))
            normed = xg * torch.rsqrt(xg.pow(2).mean(dim=-1, keepdim=True) + epsilon)
            out = normed.flatten(-2) * wf
        if zf is not None and norm_before_gate:
            out = out * act(zf)
        return out.to(orig_dtype)

    def forward_native(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        return self.forward_static(x, z, self.weight, self.eps, x.dtype, self.group_size,
                                   self.norm_before_gate, self.activation)

    def _forward_ops(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        out: Tensor = rms_norm_gated(x, self.weight, z, self.eps, self.group_size,
                                     self.norm_before_gate, self.activation)
        return out

    forward_cpu = forward_cuda = forward_hip = forward_xla = forward_npu = _forward_ops
