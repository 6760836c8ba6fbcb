"""Catalog semantics and input errors: gated activations and RMS norms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opmux
from opmux.ops import fused_add_rms_norm, gelu_and_mul, rms_norm, silu_and_mul

CATALOG = ["advance_step_flashattn", "fused_add_rms_norm", "gelu_and_mul", "paged_attention",
           "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul"]


def test_catalog_ops_are_registered_in_the_opmux_namespace() -> None:
    names = {op.name for op in opmux.list_ops() if op.namespace == "opmux"}
    assert set(CATALOG) <= names
    for name in CATALOG:
        op = getattr(opmux.ops, name)
        assert isinstance(op, opmux.Op)
        assert opmux.get_op(name) is op
        assert op.torch_op is getattr(torch.ops.opmux, name).default
    assert rms_norm.mutates_args == ()
    assert opmux.ops.reshape_and_cache.mutates_args == ("key_cache", "value_cache")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_matches_formula(dtype: torch.dtype) -> None:
    x = torch.randn(3, 5, 2 * 24).to(dtype)
    want = (F.silu(x[..., :24].float()) * x[..., 24:].float()).to(dtype)
    got = silu_and_mul.native(x)
    assert got.shape == (3, 5, 24) and got.dtype == dtype
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(silu_and_mul(x), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul_matches_formula(approximate: str) -> None:
    x = torch.randn(7, 2 * 16)
    want = F.gelu(x[:, :16], approximate=approximate) * x[:, 16:]
    torch.testing.assert_close(gelu_and_mul.native(x, approximate), want)
    other = "tanh" if approximate == "none" else "none"
    assert not torch.allclose(gelu_and_mul.native(x, other), want, atol=1e-6, rtol=0)


def test_activation_errors_name_op_argument_expected_and_got() -> None:
    with pytest.raises(opmux.OpInputError,
                       match=r"opmux::silu_and_mul \(provider 'native'\): argument 'x' "
                             r"expected .*even last dimension, got shape \[4, 7\]"):
        silu_and_mul.native(torch.randn(4, 7))
    with pytest.raises(opmux.OpInputError) as info:
        silu_and_mul.native(torch.randn(4, 7))
    assert (info.value.op, info.value.provider, info.value.argument) == (
        "opmux::silu_and_mul", "native", "x")
    with pytest.raises(opmux.OpInputError, match=r"'x' expected a floating tensor.*int64"):
        silu_and_mul.native(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(opmux.OpInputError,
                       match=r"gelu_and_mul.*'approximate' expected one of \['none', 'tanh'\], "
                             r"got 'erf'"):
        gelu_and_mul.native(torch.randn(2, 4), "erf")
    with pytest.raises(opmux.OpInputError, match="gelu_and_mul"):
        gelu_and_mul(torch.randn(2, 4), "erf")  # through the dispatcher too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_computed_in_fp32_and_returned_in_x_dtype(dtype: torch.dtype) -> None:
    x = (torch.randn(6, 64) * 3).to(dtype)
    w = torch.randn(64).to(dtype)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(dtype)
    got = rms_norm.native(x, w, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_fused_add_rms_norm_returns_new_tensors_and_leaves_inputs() -> None:
    x, res, w = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    x0, res0 = x.clone(), res.clone()
    out, new_res = fused_add_rms_norm.native(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, x0 + res0)
    torch.testing.assert_close(out, rms_norm.native(x0 + res0, w, 1e-6))
    assert torch.equal(x, x0) and torch.equal(res, res0)
    assert out.data_ptr() not in (x.data_ptr(), res.data_ptr())


def test_norm_errors() -> None:
    with pytest.raises(opmux.OpInputError,
                       match=r"rms_norm.*'weight' expected shape \[64\] .*got shape \[32\]"):
        rms_norm.native(torch.randn(2, 64), torch.randn(32))
    with pytest.raises(opmux.OpInputError, match=r"rms_norm.*'eps' expected a non-negative"):
        rms_norm.native(torch.randn(2, 8), torch.randn(8), -1.0)
    with pytest.raises(opmux.OpInputError,
                       match=r"fused_add_rms_norm.*'residual' expected x's shape \[2, 8\], "
                             r"got shape \[3, 8\]"):
        fused_add_rms_norm.native(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8))
    with pytest.raises(opmux.OpInputError, match=r"'residual' expected x's dtype"):
        fused_add_rms_norm.native(torch.randn(2, 8), torch.randn(2, 8).half(), torch.randn(8))
