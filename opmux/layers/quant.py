"""The quantisation layer of vLLM's CustomOp table: :class:`QuantFP8` (and :class:`GroupShape`).

``QuantFP8(static, group_shape, ...)`` quantises activations to ``float8_e4m3fn`` with
vLLM 0.32's arithmetic: static scales (per-tensor, per-token, per-channel, 2-d groups) or
dynamic ones (per-tensor, per-token with an optional ``scale_ub``, per-group with optional
power-of-two ``use_ue8m0`` scales and column-major scale layout). ``forward_native`` is
plain PyTorch; the platform paths call the catalog op ``quant_fp8``.

Choices where vLLM depends on CUDA-only machinery: ``use_ue8m0=None`` means ``False``
(DeepGEMM's E8M0 oracle is a CUDA library); ``tma_aligned_scales`` and ``compile_native``
are accepted and recorded but change nothing (TMA layouts are a Hopper GEMM detail; the
native path is compiled by whoever compiles the model). vLLM's ``assert`` checks are
``ValueError`` here.

>>> import torch
>>> from opmux.layers import GroupShape, QuantFP8
>>> q, scale = QuantFP8(False, GroupShape.PER_TOKEN)(torch.tensor([[1.0, -448.0]]))
>>> q.dtype, scale.tolist()
(torch.float8_e4m3fn, [[1.0]])
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.layers.custom_op import CustomOp
from opmux.ops.quant import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, group_broadcast, quant_fp8

__all__ = ["GroupShape", "QuantFP8"]


class _GroupShape(NamedTuple):
    row: int
    col: int


class GroupShape(_GroupShape):
    """A quantisation group shape ``(row, col)``; ``-1`` means the full extent.

    ``GroupShape.PER_TENSOR`` is ``(-1, -1)``, ``PER_TOKEN`` ``(1, -1)``, ``PER_CHANNEL``
    ``(-1, 1)``; ``(1, 128)`` is per-token groups of 128 (vLLM's tuple, compared by value).
    """

    PER_TENSOR: ClassVar[GroupShape]
    PER_TOKEN: ClassVar[GroupShape]
    PER_CHANNEL: ClassVar[GroupShape]

    def is_per_tensor(self) -> bool:
        return self.row == -1 and self.col == -1

    def is_per_token(self) -> bool:
        return self.row == 1 and self.col == -1

    def is_per_channel(self) -> bool:
        return self.row == -1 and self.col == 1

    def is_per_group(self) -> bool:
        return self.row == 1 and self.col >= 1


GroupShape.PER_TENSOR = GroupShape(-1, -1)
GroupShape.PER_TOKEN = GroupShape(1, -1)
GroupShape.PER_CHANNEL = GroupShape(-1, 1)


def _prep_static_scale(scale: Tensor, x: Tensor, group_shape: GroupShape) -> Tensor:
    """vLLM's ``prep_scale_for_group_broadcast``: a one-element scale stays as given for
    per-tensor shapes (else ``[1, 1]``); a 1-d scale becomes ``[1, N]`` or ``[M, 1]``."""
    if scale.numel() == 1:
        return scale if group_shape.is_per_tensor() else scale.reshape(1, 1)
    if scale.dim() != 1:
        return scale
    rows = group_shape.row if group_shape.row > 0 else x.shape[-2]
    cols = group_shape.col if group_shape.col > 0 else x.shape[-1]
    if rows == x.shape[-2]:
        return scale.unsqueeze(-2)
    if cols == x.shape[-1]:
        return scale.unsqueeze(-1)
    raise ValueError(f"QuantFP8: a 1-d scale of shape {list(scale.shape)} cannot be broadcast "
                     f"to x of shape {list(x.shape)} with group shape {(rows, cols)}")


@CustomOp.register("quant_fp8")
class QuantFP8(CustomOp):
    """Quantise to ``float8_e4m3fn``: static or dynamic, per-tensor, per-token or per-group.

    :param static: the scale is given to ``forward`` (else computed from ``x``).
    :param group_shape: a :class:`GroupShape` or ``(row, col)`` tuple.
    :param num_token_padding: pad the quantised rows with zeros to at least this many
        (non-group modes, as vLLM).
    :param column_major_scales: dynamic per-group scales in column-major layout.
    :param tma_aligned_scales: accepted for vLLM compatibility; no effect.
    :param use_ue8m0: round dynamic per-group scales up to powers of two (``None``: no).
    :param compile_native: accepted for vLLM compatibility; no effect.
    :raises ValueError: for a dynamic non-group shape other than per-token or per-tensor.
    """

    def __init__(self, static: bool, group_shape: GroupShape | tuple[int, int],
                 num_token_padding: int | None = None, column_major_scales: bool = False,
                 tma_aligned_scales: bool = False, use_ue8m0: bool | None = None,
                 compile_native: bool = True) -> None:
        group_shape = GroupShape(*group_shape)
        is_group = group_shape.is_per_group()
        if not static and not is_group and group_shape not in (GroupShape.PER_TOKEN,
                                                               GroupShape.PER_TENSOR):
            raise ValueError(f"QuantFP8: dynamic quantisation takes per-token, per-tensor or "
                             f"per-group (1, n) shapes, got {tuple(group_shape)}")
        super().__init__()
        self.static = static
        self.group_shape = group_shape
        self.use_per_token_if_dynamic = group_shape == GroupShape.PER_TOKEN
        self.num_token_padding = num_token_padding
        self.column_major_scales = column_major_scales
        self.tma_aligned_scales = tma_aligned_scales
        self.use_ue8m0 = bool(use_ue8m0)
        self.compile_native = compile_native
        self.is_group_quant = is_group
        if is_group:
            self.group_size = group_shape.col

    # --------------------------------------------------------------------------- checks
    def _check_call(self, scale: Tensor | None, scale_ub: Tensor | None) -> bool:
        """Validate the call as vLLM's asserts do; returns whether it is dynamic per-group."""
        if self.is_group_quant and not self.static:
            if scale is not None:
                raise ValueError("QuantFP8: dynamic per-group quantisation computes its "
                                 "scales; got a scale")
            return True
        if (scale is not None) != self.static:
            raise ValueError(f"QuantFP8(static={self.static}): "
                             f"{'a scale is required' if self.static else 'got a scale'}")
        if scale_ub is not None and (self.static or not self.use_per_token_if_dynamic
                                     or scale_ub.numel() != 1):
            raise ValueError("QuantFP8: scale_ub applies to dynamic per-token quantisation "
                             "only and must hold one element")
        return False

    def _finish_group(self, q: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
        if self.column_major_scales:
            scales = scales.transpose(-2, -1).contiguous().transpose(-1, -2)
        return q, scales

    def _pad(self, q: Tensor) -> Tensor:
        if self.num_token_padding is None:
            return q
        return F.pad(q, (0, 0, 0, max(self.num_token_padding - q.shape[0], 0)), "constant", 0.0)

    # ---------------------------------------------------------------------------- paths
    def forward_native(self, x: Tensor, scale: Tensor | None = None,
                       scale_ub: Tensor | None = None, use_triton: bool = False
                       ) -> tuple[Tensor, Tensor]:
        if self._check_call(scale, scale_ub):
            return self._finish_group(*self._group_native(x))
        if scale is None:
            if self.use_per_token_if_dynamic:
                x_max = x.abs().amax(dim=-1).unsqueeze(-1).to(torch.float32)
                if scale_ub is not None:
                    x_max = x_max.clamp(max=scale_ub)
            else:
                x_max = x.abs().max().unsqueeze(-1).to(torch.float32)
            scale = (x_max / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        else:
            scale = _prep_static_scale(scale, x, self.group_shape)
        inv = group_broadcast(scale.to(torch.float32), tuple(x.shape[-2:])).reciprocal()
        out = (x.to(torch.float32) * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return self._pad(out), scale

    def _group_native(self, x: Tensor) -> tuple[Tensor, Tensor]:
        shape, n, g = x.shape, x.shape[-1], self.group_size
        groups = (n + g - 1) // g
        if groups * g != n:
            x = F.pad(x, (0, groups * g - n), mode="constant", value=0.0)
        xg = x.reshape(-1, groups, g)
        raw = xg.abs().max(dim=-1, keepdim=True)[0].float() / FP8_MAX
        if self.use_ue8m0:
            raw = torch.exp2(torch.ceil(torch.log2(raw)))
        scales = raw.clamp(min=FP8_MIN_SCALE)
        q = (xg / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(-1, groups * g)
        return q[..., :n].reshape(shape), scales.squeeze(-1).reshape(*shape[:-1], groups)

    def _forward_ops(self, x: Tensor, scale: Tensor | None = None,
                     scale_ub: Tensor | None = None, use_triton: bool = False
                     ) -> tuple[Tensor, Tensor]:
        if self._check_call(scale, scale_ub):
            return self._finish_group(*quant_fp8(x, None, False, None, self.group_size,
                                                 self.use_ue8m0))
        if scale is None:
            q, scale = quant_fp8(x, None, self.use_per_token_if_dynamic, scale_ub)
        else:
            scale = _prep_static_scale(scale, x, self.group_shape)
            q, _ = quant_fp8(x, scale)
        return self._pad(q), scale

    forward_cpu = forward_cuda = forward_hip = forward_xla = forward_npu = _forward_ops

    def extra_repr(self) -> str:
        return (f"static={self.static}, group_shape={tuple(self.group_shape)}, "
                f"column_major_scales={self.column_major_scales}")
