"""Provider ``cpp`` for gemma_rms_norm, gemma_fused_add_rms_norm, rms_norm_gated, quant_fp8:
the conformance kit, LLM-sized rows, dispatch and declines, kernel-level errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import opmux
from opmux.core.errors import OpInputError
from opmux.testing import check_provider

pytestmark = pytest.mark.slow  # the session fixture compiles the extension on first use

OPS = ["gemma_rms_norm", "gemma_fused_add_rms_norm", "rms_norm_gated", "quant_fp8"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("name", OPS)
def test_conformance_kit(cpp: Any, name: str) -> None:
    report = check_provider(name, "cpp")
    assert report.ok, report.format()
    assert report.counts["pass"] >= len(report.cases) - 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_llm_sized_rows_match_native(cpp: Any, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, r = torch.randn(67, 4096).to(dtype), torch.randn(67, 4096).to(dtype)
    w, z = (torch.randn(4096) * 0.1).to(dtype), torch.randn(67, 4096).to(dtype)
    atol, rtol = opmux.testing.TOLERANCES[dtype]
    for name, args in (("gemma_rms_norm", (x, w, 1e-6)),
                       ("gemma_fused_add_rms_norm", (x, r, w, 1e-6)),
                       ("gemma_rms_norm", (x, w.float(), 1e-6)),
                       ("rms_norm_gated", (x, w, z, 1e-5, 512, False, "swish")),
                       ("rms_norm_gated", (x, w, z, 1e-5, None, True, "sigmoid"))):
        got, want = cpp.OPS[name][0](*args), opmux.get_op(name).native(*args)
        for g, v in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(g.double(), v.double(), atol=atol, rtol=rtol)
    native = opmux.ops.quant_fp8.native
    for args in ((x,), (x, None, True), (x, None, False, None, 128, True),
                 (x, torch.rand(67, 32) + 0.01)):
        got, want = cpp.quant_fp8(*args), native(*args)
        assert torch.equal(_u8(got[0]), _u8(want[0])) and torch.equal(got[1], want[1])


def test_quant_fp8_special_values(cpp: Any) -> None:
    x = torch.tensor([[float("nan"), float("inf"), -1e30, 3.0, -0.0, 1e-12, 460.0, 0.5]])
    for args in ((x, torch.tensor(1.0)), (x, None, False, None, 4)):
        got, want = cpp.quant_fp8(*args), opmux.ops.quant_fp8.native(*args)
        assert torch.equal(_u8(got[0]), _u8(want[0])), (got[0], want[0])
        torch.testing.assert_close(got[1], want[1], equal_nan=True)


def test_dispatch_reaches_cpp_and_declines_what_it_cannot_read(cpp: Any) -> None:
    x, w = torch.randn(4, 64), torch.randn(64)
    assert opmux.ops.gemma_rms_norm.dispatch(x, w, 1e-6).provider == "cpp"
    assert opmux.ops.quant_fp8.dispatch(x).provider == "cpp"
    assert opmux.ops.rms_norm_gated.dispatch(x, w, x).provider == "cpp"
    strided = torch.randn(64, 4).t()
    assert opmux.ops.gemma_rms_norm.dispatch(strided, w, 1e-6).provider == "native"
    assert opmux.ops.quant_fp8.dispatch(strided, None, True).provider == "native"
    assert opmux.ops.rms_norm_gated.dispatch(x, w, x.double()).provider == "native"
    assert opmux.ops.gemma_rms_norm.dispatch(x.bfloat16(), w.half(), 1e-6).provider == "native"
    got = opmux.ops.quant_fp8(strided, None, True)
    want = opmux.ops.quant_fp8.native(strided.contiguous(), None, True)
    assert torch.equal(_u8(got[0]), _u8(want[0]))


def test_provider_rejects_what_native_rejects(cpp: Any) -> None:
    # the predicate declines what native rejects; through the op, native says why
    assert not cpp.gemma_rms_norm_supports(torch.randn(2, 8), torch.randn(8), -1.0)
    with pytest.raises(OpInputError, match=r"opmux::gemma_rms_norm \(provider 'native'\): "
                       r"argument 'eps' expected a non-negative float"):
        opmux.ops.gemma_rms_norm(torch.randn(2, 8), torch.randn(8), -1.0)
    args = (torch.randn(2, 8), None, False, torch.tensor([1.0]))
    assert not cpp.quant_fp8_supports(*args)
    with pytest.raises(OpInputError, match=r"quant_fp8 \(provider 'native'\): argument "
                       r"'scale_ub' expected None unless per_token"):
        opmux.ops.quant_fp8(*args)


def test_kernel_checks_raise_before_writing(cpp: Any) -> None:
    k = torch.ops.opmux_cpu
    x, out = torch.randn(4, 8), torch.full((4, 8), 7.0)
    with pytest.raises(ValueError, match=r"gemma_rms_norm \(provider 'cpp'\): weight must be"):
        k.gemma_rms_norm_out(out, x, torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="group_size must divide"):
        k.rms_norm_gated_out(out, x, torch.randn(8), None, 1e-6, 3, False, False)
    q = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale \[3, 1\] must tile"):
        k.quant_fp8_static_out(q, x, torch.ones(3, 1))
    with pytest.raises(ValueError, match="scale_out must be a contiguous float32"):
        k.quant_fp8_dynamic_out(q, torch.empty(3), x, True, None)
    assert bool((out == 7.0).all()) and not q.float().any()
