"""Catalog semantics and input errors: gemma_rms_norm, gemma_fused_add_rms_norm,
rms_norm_gated and quant_fp8 (native), plus torch.library.opcheck on their cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opmux
from opmux.ops import gemma_fused_add_rms_norm, gemma_rms_norm, quant_fp8, rms_norm_gated
from opmux.testing import cases_for, run_opcheck

OPS = ["gemma_rms_norm", "gemma_fused_add_rms_norm", "rms_norm_gated", "quant_fp8"]


def test_ops_are_registered() -> None:
    for name in OPS:
        op = getattr(opmux.ops, name)
        assert opmux.get_op(name) is op and op.mutates_args == ()
        assert op.torch_op is getattr(torch.ops.opmux, name).default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemma_rms_norm_scales_by_one_plus_weight_in_fp32(dtype: torch.dtype) -> None:
    x, w = torch.randn(4, 64).to(dtype), torch.randn(64).to(dtype)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.float() + 1)).to(dtype)
    assert torch.equal(gemma_rms_norm.native(x, w), want)


def test_gemma_fused_add_returns_new_tensors() -> None:
    x, r, w = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(3, 32, dtype=torch.bfloat16), \
        torch.zeros(32)
    xc, rc = x.clone(), r.clone()
    out, new_r = gemma_fused_add_rms_norm.native(x, r, w, 1e-6)
    assert torch.equal(x, xc) and torch.equal(r, rc)
    assert torch.equal(new_r, (x.float() + r.float()).bfloat16())
    assert out.data_ptr() not in (x.data_ptr(), r.data_ptr())


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_rms_norm_gated_formula(before: bool, activation: str) -> None:
    x, z, w = torch.randn(2, 3, 48), torch.randn(2, 3, 48), torch.randn(48)
    act = torch.sigmoid if activation == "sigmoid" else F.silu
    v = x if before else x * act(z)
    g = v.view(2, 3, 4, 12)
    out = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)).view(2, 3, 48) * w
    if before:
        out = out * act(z)
    torch.testing.assert_close(rms_norm_gated.native(x, w, z, 1e-5, 12, before, activation), out)


def test_quant_fp8_modes_shapes_and_dtypes() -> None:
    x = torch.randn(2, 6, 100, dtype=torch.bfloat16)
    q, s = quant_fp8.native(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (1,)
    assert quant_fp8.native(x, None, True)[1].shape == (2, 6, 1)
    assert quant_fp8.native(x, None, False, None, 32)[1].shape == (2, 6, 4)
    scale = torch.rand(3, 5) + 0.1
    q, s = quant_fp8.native(x, scale)
    assert torch.equal(s, scale) and s.data_ptr() != scale.data_ptr()
    big = torch.tensor([[1e6, -1e6, 0.0]])
    assert quant_fp8.native(big, torch.tensor(1.0))[0].float().tolist() == [[448, -448, 0]]


def test_quant_fp8_ue8m0_scales_are_powers_of_two() -> None:
    x = torch.randn(4, 256)
    raw = quant_fp8.native(x, None, False, None, 128)[1]
    pow2 = quant_fp8.native(x, None, False, None, 128, True)[1]
    assert torch.equal(torch.log2(pow2), torch.log2(pow2).round())
    assert bool((pow2 >= raw).all()) and bool((pow2 < 2 * raw).all())


@pytest.mark.parametrize(("args", "argument", "expected"), [
    ((torch.randn(2, 8), torch.randn(7)), "weight", r"shape \[8\]"),
    ((torch.randn(2, 8).int(), torch.randn(8)), "x", "a floating tensor"),
    ((torch.randn(2, 8), torch.randn(8), -1.0), "eps", "non-negative"),
])
def test_gemma_errors(args: tuple[object, ...], argument: str, expected: str) -> None:
    with pytest.raises(opmux.OpInputError, match=rf"opmux::gemma_rms_norm \(provider 'native'\):"
                       rf" argument '{argument}' expected .*{expected}") as info:
        gemma_rms_norm.native(*args)
    assert info.value.argument == argument and isinstance(info.value, ValueError)


def test_gemma_fused_add_and_gated_errors() -> None:
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(opmux.OpInputError, match="'residual' expected x's dtype"):
        gemma_fused_add_rms_norm.native(x, x.double(), w)
    with pytest.raises(opmux.OpInputError, match="'residual' expected x's shape"):
        gemma_fused_add_rms_norm.native(x, x[:1], w)
    with pytest.raises(opmux.OpInputError, match="'group_size' expected None or a positive "
                       "divisor of x's last dimension 8, got 3"):
        rms_norm_gated.native(x, w, None, 1e-5, 3)
    with pytest.raises(opmux.OpInputError, match="'z' expected None or x's shape"):
        rms_norm_gated.native(x, w, x[:, :4])
    with pytest.raises(opmux.OpInputError, match=r"'activation' expected one of \['sigmoid', "
                       r"'silu', 'swish'\], got 'relu'"):
        rms_norm_gated.native(x, w, x, 1e-5, None, False, "relu")


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"scale": torch.tensor(1.0), "per_token": True}, "per_token"),
    ({"scale": torch.tensor(1.0), "group_size": 4}, "group_size"),
    ({"scale": torch.rand(3, 3)}, "scale"),
    ({"scale": torch.rand(8)}, "scale"),
    ({"scale_ub": torch.tensor([1.0])}, "scale_ub"),
    ({"per_token": True, "scale_ub": torch.tensor([1.0, 2.0])}, "scale_ub"),
    ({"per_token": True, "scale_ub": torch.tensor([1.0], dtype=torch.float64)}, "scale_ub"),
    ({"group_size": 0}, "group_size"),
    ({"group_size": 4, "per_token": True}, "per_token"),
    ({"use_ue8m0": True}, "use_ue8m0"),
])
def test_quant_fp8_errors(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(opmux.OpInputError, match=rf"opmux::quant_fp8 \(provider 'native'\): "
                       rf"argument '{argument}' expected") as info:
        quant_fp8.native(torch.randn(4, 8), **kwargs)
    assert info.value.argument == argument


def test_quant_fp8_dynamic_needs_data() -> None:
    with pytest.raises(opmux.OpInputError, match="'x' expected a non-empty last dimension"):
        quant_fp8.native(torch.randn(0, 8))
    assert quant_fp8.native(torch.randn(0, 8), None, True)[1].shape == (0, 1)


@pytest.mark.parametrize("name", OPS)
def test_opcheck_on_conformance_cases(name: str) -> None:
    cases = cases_for(name)[:4]
    results = run_opcheck(name, cases=cases,
                          test_utils=["test_schema", "test_faketensor", "test_aot_dispatch_static"])
    assert len(results) == len(cases)
