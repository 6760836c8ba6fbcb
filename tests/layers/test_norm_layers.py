"""RMSNorm, GemmaRMSNorm and RMSNormGated: both paths against float64 references of ours,
vLLM's dtype handling, parameter names, inputs untouched, fullgraph compile."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import opmux
from opmux.layers import GemmaRMSNorm, RMSNorm, RMSNormGated
from opmux.testing import TOLERANCES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: enablement strings: the layer on its platform path (catalog ops) / on forward_native
MODES = {"enabled": "none,+{name}", "disabled": "all,-{name}"}


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def _build(fresh: None, mode: str, cls: type[opmux.CustomOp], *args: Any,
           **kwargs: Any) -> Any:
    opmux.set_custom_ops(MODES[mode].format(name=cls.name))
    layer = cls(*args, **kwargs)
    on_ops = layer.forward.__func__ is type(layer)._forward_ops  # type: ignore[attr-defined]
    assert on_ops == (mode == "enabled")
    return layer


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol)


def _rms64(x: torch.Tensor, eps: float, var: int | None = None) -> torch.Tensor:
    xd = x.double()
    stats = xd if var is None else xd[..., :var]
    return xd / torch.sqrt(stats.pow(2).mean(-1, keepdim=True) + eps)


def _snapshot(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone() for t in ts]


# -------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_layer(fresh_custom_ops: None, mode: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = _build(fresh_custom_ops, mode, RMSNorm, 96, eps=1e-5, dtype=dtype)
    assert [n for n, _ in layer.named_parameters()] == ["weight"]
    layer.weight.copy_(torch.randn(96) * 0.3 + 1)
    x, res = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    before = _snapshot(x, res)
    _close(layer(x), (_rms64(x, 1e-5) * layer.weight.double()).to(dtype), dtype)
    out, new_res = layer(x, res)
    s = x.double() + res.double()
    _close(new_res, s.to(dtype), dtype)
    _close(out, (_rms64(s, 1e-5) * layer.weight.double()).to(dtype), dtype)
    assert all(torch.equal(a, b) for a, b in zip((x, res), before, strict=True))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_weight_and_var_hidden_size(fresh_custom_ops: None, mode: str,
                                                     dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    plain = _build(fresh_custom_ops, mode, RMSNorm, 64, has_weight=False)
    assert list(plain.state_dict()) == [] and not list(plain.parameters())
    x = (torch.randn(3, 64) * 4).to(dtype)
    _close(plain(x), _rms64(x, 1e-6).to(dtype), dtype)
    partial = _build(fresh_custom_ops, mode, RMSNorm, 64, var_hidden_size=16, dtype=dtype)
    assert partial.variance_size_override == 16
    _close(partial(x), _rms64(x, 1e-6, 16).to(dtype), dtype)
    res = torch.randn(3, 64).to(dtype)
    out, new_res = partial(x, res)
    _close(out, _rms64(x.double() + res.double(), 1e-6, 16).to(dtype), dtype)
    _close(new_res, (x.double() + res.double()).to(dtype), dtype)
    assert RMSNorm(64, var_hidden_size=64).variance_size_override is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_residual_of_another_dtype(fresh_custom_ops: None, mode: str,
                                   cls: type[opmux.CustomOp]) -> None:
    layer = _build(fresh_custom_ops, mode, cls, 32)
    x, res = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(3, 32)
    out, new_res = layer(x, res)
    assert out.dtype == new_res.dtype == torch.bfloat16
    _close(new_res, (x.double() + res.double()).bfloat16(), torch.bfloat16)


def test_rms_norm_follows_vllm_weight_dtype_rounding(fresh_custom_ops: None) -> None:
    # vLLM rounds the normalised fp32 row to the weight's dtype before the multiply
    opmux.set_custom_ops("none")
    layer = RMSNorm(32, dtype=torch.bfloat16)
    layer.weight.fill_(3.0)
    x = torch.randn(4, 32)
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(layer(x), (normed * layer.weight).float())


# --------------------------------------------------------------------------- GemmaRMSNorm
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_layer(fresh_custom_ops: None, mode: str, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    layer = _build(fresh_custom_ops, mode, GemmaRMSNorm, 80, eps=1e-6)
    assert torch.equal(layer.weight, torch.zeros(80)) and layer.weight.dtype == torch.float32
    layer.weight.copy_(torch.randn(80) * 0.2)
    layer.to(dtype)
    w1 = layer.weight.double() + 1
    x, res = torch.randn(2, 3, 80).to(dtype), torch.randn(2, 3, 80).to(dtype)
    before = _snapshot(x, res)
    _close(layer(x), (_rms64(x, 1e-6) * w1).to(dtype), dtype)
    out, new_res = layer(x, res)
    s = x.double() + res.double()
    _close(new_res, s.to(dtype), dtype)
    _close(out, (_rms64(s, 1e-6) * w1).to(dtype), dtype)
    assert all(torch.equal(a, b) for a, b in zip((x, res), before, strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_gemma_normalises_the_unrounded_sum(fresh_custom_ops: None, mode: str) -> None:
    # fp16 sums that round: the output follows the fp32 sum, not the stored residual
    layer = _build(fresh_custom_ops, mode, GemmaRMSNorm, 4)
    x = torch.tensor([[1000.0, 1.0, 1.0, 1.0]], dtype=torch.float16)
    res = torch.tensor([[0.3, 0.0, 0.0, 0.0]], dtype=torch.float16)
    out, new_res = layer(x, res)
    s = x.float() + res.float()
    want = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).half()
    assert torch.equal(new_res, s.half()) and torch.equal(out, want)


# --------------------------------------------------------------------------- RMSNormGated
def _gated64(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor | None, eps: float,
             group: int | None, before: bool, act: Callable[[torch.Tensor], torch.Tensor]
             ) -> torch.Tensor:
    xd = x.double()
    if z is not None and not before:
        xd = xd * act(z.double())
    g = group or xd.shape[-1]
    xg = xd.reshape(*xd.shape[:-1], -1, g)
    out = (xg / torch.sqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).reshape(xd.shape)
    out = out * w.double()
    if z is not None and before:
        out = out * act(z.double())
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "before", "activation"),
                         [(None, False, "swish"), (32, True, "sigmoid"), (64, False, "silu")])
def test_rms_norm_gated_layer(fresh_custom_ops: None, mode: str, dtype: torch.dtype,
                              group: int | None, before: bool, activation: str) -> None:
    torch.manual_seed(3)
    layer = _build(fresh_custom_ops, mode, RMSNormGated, 128, eps=1e-5, group_size=group,
                   norm_before_gate=before, dtype=dtype, activation=activation)
    assert [n for n, _ in layer.named_parameters()] == ["weight"] and layer.bias is None
    assert torch.equal(layer.weight, torch.ones(128, dtype=dtype))
    layer.weight.copy_(torch.randn(128) * 0.3 + 1)
    act = torch.sigmoid if activation == "sigmoid" else torch.nn.functional.silu
    x, z = torch.randn(6, 128).to(dtype), (2 * torch.randn(6, 128)).to(dtype)
    before_xz = _snapshot(x, z)
    _close(layer(x, z), _gated64(x, layer.weight, z, 1e-5, group, before, act).to(dtype), dtype)
    _close(layer(x), _gated64(x, layer.weight, None, 1e-5, group, before, act).to(dtype), dtype)
    assert all(torch.equal(a, b) for a, b in zip((x, z), before_xz, strict=True))


def test_rms_norm_gated_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="activation must be one of"):
        RMSNormGated(64, activation="gelu")
    with pytest.raises(ValueError, match="group_size must be None or a positive divisor"):
        RMSNormGated(64, group_size=48)


def test_forward_static_matches_layer(fresh_custom_ops: None) -> None:
    layer = RMSNormGated(32, group_size=16, norm_before_gate=True)
    x, z = torch.randn(3, 32), torch.randn(3, 32)
    want = RMSNormGated.forward_static(x, z, layer.weight, layer.eps, x.dtype, 16, True)
    torch.testing.assert_close(layer(x, z), want)


# ------------------------------------------------------------------------------- compile
def _layers() -> list[tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]:
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    return [(RMSNorm(64), (x,)), (RMSNorm(64), (x, r)), (RMSNorm(64, var_hidden_size=8), (x,)),
            (GemmaRMSNorm(64), (x,)), (GemmaRMSNorm(64), (x, r)),
            (RMSNormGated(64, group_size=16), (x, r)), (RMSNormGated(64), (x,))]


@pytest.mark.parametrize("spec", ["all", "none"])
def test_layers_compile_fullgraph_without_breaks(fresh_custom_ops: None, spec: str) -> None:
    opmux.set_custom_ops(spec)
    for layer, args in _layers():
        explanation = torch._dynamo.explain(layer)(*args)
        assert explanation.graph_break_count == 0, (type(layer).__name__, explanation)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        got, want = compiled(*args), layer(*args)
        for g, w in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(g, w)


@pytest.mark.slow
def test_layers_compile_with_inductor(fresh_custom_ops: None) -> None:
    opmux.set_custom_ops("all")
    for layer, args in _layers()[::3]:
        compiled = torch.compile(layer, fullgraph=True, backend="inductor")
        got, want = compiled(*args), layer(*args)
        for g, w in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf"), 0.0, True, "1e-6"])
def test_norm_eps_is_checked_at_construction(eps: object) -> None:
    from opmux.layers.norm import GemmaRMSNorm, RMSNorm

    for cls in (RMSNorm, GemmaRMSNorm):
        with pytest.raises(opmux.OpInputError, match=f"{cls.__name__}: eps must be a finite "
                                                     f"number > 0") as info:
            cls(8, eps=eps)  # type: ignore[arg-type]
        assert info.value.argument == "eps"
