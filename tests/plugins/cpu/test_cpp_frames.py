"""A catalog op served by a C++ kernel costs few Python frames: the op, the torch overload,
the kernel, the predicate, the impl and the C++ op's overload; through its layer, torch's
two Module call frames and the layer's path besides."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch

import opmux
from opmux.layers import GemmaRMSNorm, RMSNorm, SiluAndMul
from opmux.testing import paged_batch


def _frames(call: Callable[[], Any]) -> list[str]:
    call()  # warm: start-up, first-use lookups
    seen: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            seen.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen[1:]  # below the caller (the lambda)


@pytest.fixture(autouse=True)
def _plain(cpp: Any, fresh_plugins: None) -> None:
    opmux.load_plugins()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_op_call_is_six_frames(dtype: torch.dtype) -> None:
    x, w = torch.randn(4, 64, dtype=dtype), torch.rand(64, dtype=dtype)
    res = torch.randn(4, 64, dtype=dtype)
    for name, args in (("rms_norm", (x, w, 1e-6)), ("fused_add_rms_norm", (x, res, w, 1e-6)),
                       ("silu_and_mul", (x,))):
        op = opmux.get_op(name)
        assert op.dispatch(*args).provider == "cpp"
        frames = _frames(lambda op=op, args=args: op(*args))
        assert len(frames) <= 6, frames


def test_attention_and_rotary_calls_are_six_frames() -> None:
    batch = paged_batch([3, 1], [7, 9], heads=4, kv_heads=2, head_size=16, block_size=4,
                        dtype=torch.float32, unused=-1, seed=0).as_dict()
    attention = (*batch.values(), 0.25, None, None)
    q, k = torch.randn(5, 4 * 16), torch.randn(5, 2 * 16)
    rotary = (torch.arange(5), q, k, torch.randn(32, 16), 16, True)
    for name, args in (("paged_attention", attention), ("rotary_embedding", rotary)):
        op = opmux.get_op(name)
        assert op.dispatch(*args).provider == "cpp", name
        frames = _frames(lambda op=op, args=args: op(*args))
        assert len(frames) <= 6, (name, frames)


def test_a_layer_call_is_nine_frames() -> None:
    x = torch.randn(4, 64)
    for layer, args in ((RMSNorm(64), (x,)), (RMSNorm(64), (x, torch.randn(4, 64))),
                        (GemmaRMSNorm(64), (x,)), (SiluAndMul(), (x,))):
        frames = _frames(lambda layer=layer, args=args: layer(*args))
        assert len(frames) <= 9, (type(layer).__name__, frames)
