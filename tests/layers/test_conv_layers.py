"""Conv2dLayer and Conv3dLayer: vLLM 0.32's constructor and parameters, the unfold-and-matmul
path when kernel == stride, enabled and disabled against ``F.conv2d`` / ``F.conv3d``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import opmux
from opmux.layers import Conv2dLayer, Conv3dLayer


@pytest.fixture(autouse=True)
def _setup(fresh_custom_ops: None) -> Iterator[None]:
    with torch.no_grad():
        yield


def _init(layer: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))


CASES = [
    # (cls, kwargs, input shape, takes the matmul path)
    (Conv2dLayer, {"kernel_size": 4, "stride": 4}, (2, 3, 8, 12), True),
    (Conv2dLayer, {"kernel_size": (2, 3), "stride": (2, 3), "bias": False}, (1, 3, 5, 9), True),
    (Conv2dLayer, {"kernel_size": 3, "padding": "same"}, (1, 3, 7, 6), False),
    (Conv2dLayer, {"kernel_size": 3, "stride": 2, "padding": 1, "dilation": 1}, (2, 3, 9, 9),
     False),
    (Conv3dLayer, {"kernel_size": (2, 4, 4), "stride": (2, 4, 4)}, (1, 3, 4, 8, 8), True),
    (Conv3dLayer, {"kernel_size": 2, "stride": 2, "padding": "valid"}, (2, 3, 4, 6, 5), True),
    (Conv3dLayer, {"kernel_size": 3, "padding": 1}, (1, 3, 3, 5, 5), False),
]


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cls,kwargs,shape,linear", CASES,
                         ids=[f"{c.__name__}-{i}" for i, (c, *_) in enumerate(CASES)])
def test_conv_layer_matches_conv(cls: type, kwargs: dict[str, object], shape: tuple[int, ...],
                                 linear: bool, enabled: bool, dtype: torch.dtype) -> None:
    opmux.set_custom_ops("all" if enabled else "none")
    layer = cls(3, 8, params_dtype=dtype, **kwargs)
    _init(layer)
    assert layer.enable_linear is linear
    assert tuple(layer.weight.shape) == (8, 3, *layer.kernel_size)
    x = torch.randn(shape).to(dtype)
    conv = F.conv2d if cls is Conv2dLayer else F.conv3d
    want = conv(x.float(), layer.weight.float(),
                None if layer.bias is None else layer.bias.float(), stride=layer.stride,
                padding=layer.padding, dilation=layer.dilation)
    got = layer(x)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want, atol=tol * 10, rtol=tol)
    assert opmux.custom_op_counts()["enabled" if enabled else "disabled"][cls.name] == 1


def test_conv_layer_state_dict_and_errors() -> None:
    layer = Conv2dLayer(3, 8, kernel_size=2, stride=2)
    assert sorted(layer.state_dict()) == ["bias", "weight"]
    assert layer.input_size == 12
    with pytest.raises(ValueError, match=r"Invalid padding string 'full'"):
        Conv2dLayer(3, 8, kernel_size=3, padding="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="padding='same' is not supported for strided"):
        Conv3dLayer(3, 8, kernel_size=3, stride=2, padding="same")
    with pytest.raises(ValueError, match=r"Conv2dLayer expects a 4-d input"):
        layer(torch.randn(3, 8, 8))
