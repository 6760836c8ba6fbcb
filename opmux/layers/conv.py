"""Patch-embedding convolutions: vLLM 0.32's ``Conv2dLayer`` (``conv2d``) and
``Conv3dLayer`` (``conv3d``).

Same constructor, parameters (``weight [out, in/groups, *kernel]``, ``bias``) and forward as
vLLM's. When the kernel equals the stride, there is no padding and one group (the
patch embedding of vision encoders), the convolution is an unfold into non-overlapping
patches and one matmul (``enable_linear``); vLLM takes that path in ``forward_native`` and
opmux's platform paths take it too (a GEMM the BLAS of every platform serves well; CUDA's
cuDNN 3-D convolution is slow since torch 2.9), and ``F.conv*d`` otherwise.

>>> import torch
>>> from opmux.layers import Conv2dLayer
>>> layer = Conv2dLayer(3, 8, kernel_size=4, stride=4)
>>> layer.enable_linear, tuple(layer(torch.randn(1, 3, 8, 12)).shape)
(True, (1, 8, 2, 3))
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from opmux.layers.custom_op import CustomOp

__all__ = ["Conv2dLayer", "Conv3dLayer", "ConvLayerBase"]

_PADDING_STRINGS = ("same", "valid")


def _tuple(value: int | tuple[int, ...], n: int, name: str) -> tuple[int, ...]:
    out = (value,) * n if isinstance(value, int) else tuple(value)
    if len(out) != n:
        raise ValueError(f"{name} must be an int or a tuple of {n} ints, got {value!r}")
    return out


class ConvLayerBase(CustomOp):
    """What the convolution layers share: vLLM's constructor and parameters.

    :raises ValueError: an unknown padding string, or ``padding='same'`` with a stride.
    """

    num_dim: int

    def __init__(self, in_channels: int, out_channels: int,
                 kernel_size: int | tuple[int, ...], stride: int | tuple[int, ...] = 1,
                 padding: int | tuple[int, ...] | Literal["same", "valid"] = 0,
                 dilation: int | tuple[int, ...] = 1, groups: int = 1, bias: bool = True,
                 padding_mode: Literal["zeros", "reflect", "replicate", "circular"] = "zeros",
                 *, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if params_dtype is None:
            params_dtype = torch.get_default_dtype()
        if isinstance(padding, str) and padding not in _PADDING_STRINGS:
            raise ValueError(f"Invalid padding string {padding!r}. Expected one of "
                             f"{sorted(_PADDING_STRINGS)}.")
        n = self.num_dim
        kernel = _tuple(kernel_size, n, "kernel_size")
        strides = _tuple(stride, n, "stride")
        if padding == "same":
            if any(s != 1 for s in strides):
                raise ValueError("padding='same' is not supported for strided convolutions")
            pads = tuple(k // 2 for k in kernel)
        elif padding == "valid":
            pads = (0,) * n
        else:
            pads = _tuple(padding, n, "padding")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel
        self.stride = strides
        self.padding = pads
        self.dilation = _tuple(dilation, n, "dilation")
        self.groups = groups
        self.padding_mode = padding_mode
        self.enable_linear = kernel == strides and not any(pads) and groups == 1
        self.input_size = in_channels * math.prod(kernel)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *kernel,
                                               dtype=params_dtype))
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels, dtype=params_dtype))
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={self.bias is not None}")

    def _check(self, x: Tensor) -> None:
        if x.dim() != self.num_dim + 2:
            raise ValueError(f"{type(self).__name__} expects a {self.num_dim + 2}-d input "
                             f"(batch, channels, {self.num_dim} spatial dims), got shape "
                             f"{list(x.shape)}")

    def _forward_mulmat(self, x: Tensor) -> Tensor:
        """Non-overlapping patches (kernel == stride) as one matmul."""
        n = self.num_dim
        batch = x.shape[0]
        grid = [x.shape[2 + i] // k for i, k in enumerate(self.kernel_size)]
        for i, k in enumerate(self.kernel_size):
            x = x.unfold(2 + i, k, k)
        # [B, C, g1..gn, k1..kn] -> [B, g1..gn, C, k1..kn]
        perm = [0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n)]
        x = x.permute(*perm).reshape(-1, self.input_size)
        y = F.linear(x, self.weight.view(self.out_channels, self.input_size), self.bias)
        return y.view(batch, *grid, self.out_channels).permute(0, n + 1, *range(1, n + 1))

    def _forward_conv(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward_native(self, x: Tensor) -> Tensor:
        self._check(x)
        return self._forward_mulmat(x) if self.enable_linear else self._forward_conv(x)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, x: Tensor) -> Tensor:
        self._check(x)
        return self._forward_mulmat(x) if self.enable_linear else self._forward_conv(x)


@CustomOp.register("conv2d")
class Conv2dLayer(ConvLayerBase):
    """2-D convolution; input ``(batch, in_channels, height, width)``."""

    num_dim = 2

    def forward_cuda(self, x: Tensor) -> Tensor:
        # as vLLM: cuDNN's 2-D convolution serves every configuration well
        self._check(x)
        return self._forward_conv(x)

    def _forward_conv(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding,
                        dilation=self.dilation, groups=self.groups)


@CustomOp.register("conv3d")
class Conv3dLayer(ConvLayerBase):
    """3-D convolution; input ``(batch, in_channels, time, height, width)``."""

    num_dim = 3

    def _forward_conv(self, x: Tensor) -> Tensor:
        return F.conv3d(x, self.weight, self.bias, stride=self.stride, padding=self.padding,
                        dilation=self.dilation, groups=self.groups)
