"""FP8 quantisation: ``quant_fp8`` (native reference).

The arithmetic is vLLM 0.32's ``QuantFP8.forward_native`` (static and dynamic, per-tensor,
per-token, per-group), so every provider reproduces vLLM's bits:

- dynamic scales are ``max(|x|) / 448`` (after ``min(., scale_ub)`` for per-token scales),
  clamped below at ``1 / (448 * 512)``; ``use_ue8m0`` rounds per-group scales up to a power
  of two first;
- per-tensor and per-token values are ``x * (1 / scale)`` (the reciprocal first, as vLLM);
  per-group values are ``x / scale``;
- values are clamped to ``[-448, 448]`` and rounded to nearest even ``float8_e4m3fn``.
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
from typing import Final, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks import check_quant_fp8

__all__ = ["FP8_DTYPE", "FP8_MAX", "FP8_MIN_SCALE", "group_broadcast", "quant_fp8"]

FP8_DTYPE: Final = torch.float8_e4m3fn
"""The quantised dtype."""

FP8_MAX: Final = float(torch.finfo(torch.float8_e4m3fn).max)
"""Largest finite ``float8_e4m3fn`` (448); quantised values are clamped to ``±FP8_MAX``."""

FP8_MIN_SCALE: Final = 1.0 / (FP8_MAX * 512.0)
"""Lower bound of dynamic scales (keeps ``1 / scale`` finite for all-zero rows)."""


def group_broadcast(scale: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Expand a 2-d ``[a, b]`` scale over the last two dims ``shape = (rows, cols)`` of ``x``:
    each scale entry covers a ``rows/a x cols/b`` tile. Other scales are returned unchanged
    (they broadcast)."""
    if scale.dim() != 2 or len(shape) != 2:
        return scale
    rows, cols = shape
    if scale.shape[0] not in (1, rows):
        scale = scale.repeat_interleave(rows // scale.shape[0], dim=0)
    if scale.shape[1] not in (1, cols):
        scale = scale.repeat_interleave(cols // scale.shape[1], dim=1)
    return scale


def _to_fp8(xf: Tensor) -> Tensor:
    return xf.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _group_quant(x: Tensor, group_size: int, use_ue8m0: bool) -> tuple[Tensor, Tensor]:
    n = x.shape[-1]
    groups = (n + group_size - 1) // group_size
    padded = x if groups * group_size == n else F.pad(x, (0, groups * group_size - n))
    xg = padded.reshape(-1, groups, group_size)
    raw = xg.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX
    if use_ue8m0:
        raw = torch.exp2(torch.ceil(torch.log2(raw)))
    scales = raw.clamp(min=FP8_MIN_SCALE)
    q = _to_fp8(xg / scales).reshape(-1, groups * group_size)[:, :n].reshape(x.shape)
    return q.contiguous(), scales.reshape(*x.shape[:-1], groups)


@register_op
def quant_fp8(x: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
              scale_ub: Optional[Tensor] = None, group_size: Optional[int] = None,
              use_ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """Quantise ``x`` to ``float8_e4m3fn``; returns ``(q, scale)`` with ``x ≈ q * scale``.

    Modes (exactly one):

    - **static**: ``scale`` given, one element (per-tensor) or 2-d ``[a, b]`` with ``a``
      dividing ``x.shape[-2]`` and ``b`` dividing ``x.shape[-1]`` (per-token ``[M, 1]``,
      per-channel ``[1, N]``, per-group/block ``[M/gm, N/gn]``). The returned scale is a copy
      of ``scale`` (an op's outputs cannot alias its inputs).
    - **dynamic per-tensor** (the default): one fp32 scale, shape ``[1]``.
    - **dynamic per-token** (``per_token``): fp32 scales ``[..., 1]``, each first bounded by
      ``scale_ub`` (a one-element fp32 tensor) when given.
    - **dynamic per-group** (``group_size``): fp32 scales ``[..., ceil(N / group_size)]``,
      one per ``group_size`` consecutive elements of a row (the last group may be short);
      ``use_ue8m0`` rounds each scale up to a power of two.

    :param x: floating tensor ``[..., N]``.
    :returns: ``(q, scale)``: ``q`` has ``x``'s shape (contiguous), dtype ``float8_e4m3fn``.
    :raises opmux.OpInputError: for bad shapes, dtypes, devices or mixed modes.
    """
    check_quant_fp8(x, scale, per_token, scale_ub, group_size, use_ue8m0)
    if group_size is not None:
        return _group_quant(x, group_size, use_ue8m0)
    if scale is not None:
        s = scale.float()
        inv = group_broadcast(s, tuple(x.shape[-2:])).reciprocal()
        return _to_fp8(x.float() * inv), scale.clone()
    if per_token:
        x_max = x.abs().amax(dim=-1, keepdim=True).float()
        if scale_ub is not None:
            x_max = x_max.clamp(max=scale_ub)
    else:
        x_max = x.abs().max().unsqueeze(-1).float()
    dyn = (x_max / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return _to_fp8(x.float() * dyn.reciprocal()), dyn
