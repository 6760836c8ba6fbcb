"""QuantFP8: every mode on both paths against a reference of ours, vLLM's shapes and layouts,
padding, errors, fullgraph compile."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import opmux
from opmux.layers import GroupShape, QuantFP8

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = {"enabled": "none,+quant_fp8", "disabled": "all,-quant_fp8"}
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def _layer(mode: str, *args: object, **kwargs: object) -> QuantFP8:
    opmux.set_custom_ops(MODES[mode])
    layer = QuantFP8(*args, **kwargs)  # type: ignore[arg-type]
    assert (layer.forward.__func__ is QuantFP8._forward_ops) == (mode == "enabled")
    return layer


def _fp8(v: torch.Tensor) -> torch.Tensor:
    """Our reference of the cast: clamp to the e4m3 range, round to nearest even."""
    return v.clamp(-448.0, 448.0).to(E4M3)


def _x(dtype: torch.dtype, shape: tuple[int, ...] = (6, 256)) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[-1])
    x[1] = 0
    return x.to(dtype)


def _same(got: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, scale: torch.Tensor) -> None:
    assert got[0].dtype == E4M3 and got[0].shape == q.shape
    assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8))
    assert got[1].shape == scale.shape and got[1].dtype == scale.dtype
    torch.testing.assert_close(got[1], scale, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_per_tensor_and_per_token(fresh_custom_ops: None, mode: str,
                                          dtype: torch.dtype) -> None:
    x = _x(dtype)
    before = x.clone()
    amax = x.float().abs().max().reshape(1)
    scale = torch.clamp(amax / 448.0, min=1 / (448 * 512))
    _same(_layer(mode, False, GroupShape.PER_TENSOR)(x), _fp8(x.float() * (1 / scale)), scale)
    rows = x.float().abs().amax(-1, keepdim=True)
    tok = torch.clamp(rows / 448.0, min=1 / (448 * 512))
    assert float(tok[1]) == pytest.approx(1 / (448 * 512))  # the all-zero row
    _same(_layer(mode, False, GroupShape.PER_TOKEN)(x), _fp8(x.float() * (1 / tok)), tok)
    ub = torch.tensor([0.01])
    bounded = torch.clamp(torch.minimum(rows, ub) / 448.0, min=1 / (448 * 512))
    _same(_layer(mode, False, (1, -1))(x, None, ub), _fp8(x.float() * (1 / bounded)), bounded)
    assert torch.equal(x, before)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [128, 96])
def test_dynamic_per_group(fresh_custom_ops: None, mode: str, dtype: torch.dtype,
                           group: int) -> None:
    x = _x(dtype, (5, 256))
    groups = -(-256 // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - 256))
    blocks = padded.view(5, groups, group)
    scale = torch.clamp(blocks.abs().amax(-1) / 448.0, min=1 / (448 * 512))
    q = _fp8(blocks / scale.unsqueeze(-1)).view(5, -1)[:, :256]
    _same(_layer(mode, False, GroupShape(1, group))(x), q, scale)
    col = _layer(mode, False, GroupShape(1, group), column_major_scales=True)(x)
    assert col[1].stride() == (1, 5) and torch.equal(col[1], scale)
    pow2 = _layer(mode, False, GroupShape(1, group), use_ue8m0=True)(x)[1]
    want = torch.clamp(torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1) / 448.0))),
                       min=1 / (448 * 512))
    assert torch.equal(pow2, want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_static_scales(fresh_custom_ops: None, mode: str, dtype: torch.dtype) -> None:
    x = _x(dtype, (8, 128))
    xf = x.float()
    s = torch.tensor(0.05)
    q, scale = _layer(mode, True, GroupShape.PER_TENSOR)(x, s)
    _same((q, scale), _fp8(xf * (1 / s)), s)
    assert scale.data_ptr() == s.data_ptr()  # returned as given, as vLLM does
    tok = torch.rand(8) * 0.1 + 0.01
    _same(_layer(mode, True, GroupShape.PER_TOKEN)(x, tok), _fp8(xf * (1 / tok[:, None])),
          tok.unsqueeze(-1))
    ch = torch.rand(128) * 0.1 + 0.01
    _same(_layer(mode, True, GroupShape.PER_CHANNEL)(x, ch),
          _fp8(xf * (1 / ch)[None, :]), ch.unsqueeze(0))
    block = torch.rand(2, 4) * 0.1 + 0.01
    full = block.repeat_interleave(4, 0).repeat_interleave(32, 1)
    _same(_layer(mode, True, GroupShape(4, 32))(x, block), _fp8(xf * (1 / full)), block)


@pytest.mark.parametrize("mode", MODES)
def test_token_padding(fresh_custom_ops: None, mode: str) -> None:
    x = _x(torch.bfloat16, (3, 64))
    q, _ = _layer(mode, False, GroupShape.PER_TOKEN, num_token_padding=8)(x)
    assert q.shape == (8, 64) and not q[3:].float().any()


@pytest.mark.parametrize("mode", MODES)
def test_call_errors(fresh_custom_ops: None, mode: str) -> None:
    x = _x(torch.float32)
    with pytest.raises(ValueError, match="a scale is required"):
        _layer(mode, True, GroupShape.PER_TENSOR)(x)
    with pytest.raises(ValueError, match="got a scale"):
        _layer(mode, False, GroupShape.PER_TOKEN)(x, torch.tensor(1.0))
    with pytest.raises(ValueError, match="scale_ub applies to dynamic per-token"):
        _layer(mode, False, GroupShape.PER_TENSOR)(x, None, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="computes its scales"):
        _layer(mode, False, GroupShape(1, 64))(x, torch.tensor(1.0))
    with pytest.raises(ValueError, match="per-token, per-tensor or per-group"):
        QuantFP8(False, GroupShape.PER_CHANNEL)


@pytest.mark.parametrize("spec", ["all", "none"])
def test_compile_fullgraph_without_breaks(fresh_custom_ops: None, spec: str) -> None:
    opmux.set_custom_ops(spec)
    x = _x(torch.bfloat16, (4, 128))
    cases: list[tuple[QuantFP8, tuple[torch.Tensor, ...]]] = [
        (QuantFP8(False, GroupShape.PER_TOKEN), (x,)),
        (QuantFP8(False, GroupShape.PER_TENSOR), (x,)),
        (QuantFP8(False, GroupShape(1, 64), column_major_scales=True), (x,)),
        (QuantFP8(True, GroupShape.PER_TENSOR), (x, torch.tensor(0.1))),
    ]
    for layer, args in cases:
        explanation = torch._dynamo.explain(layer)(*args)
        assert explanation.graph_break_count == 0, explanation
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(*args)
        want = layer(*args)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        torch.testing.assert_close(got[1], want[1])
