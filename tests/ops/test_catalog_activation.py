"""Catalog semantics of vLLM's other activation rows: formulas (fp64 references written out
here), result dtypes, input errors and torch.library conformance."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import opmux
import opmux.ops
from opmux.testing import conformance
from opmux.testing.cases import cases_for

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
OPS = ("fatrelu_and_mul", "mul_and_silu", "gelu_and_mul_sparse", "swigluoai_and_mul",
       "gelu_new", "gelu_fast", "quick_gelu", "relu2", "xielu")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def _sigmoid(v: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-v))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_formulas(dtype: torch.dtype) -> None:
    x = (torch.randn(3, 4, 2 * 20) * 2).to(dtype)
    v = x.double()
    a, b = v[..., :20], v[..., 20:]
    _close(opmux.ops.mul_and_silu(x), a * b * _sigmoid(b), dtype)
    _close(opmux.ops.fatrelu_and_mul(x, 0.3), torch.where(a > 0.3, a, 0.0) * b, dtype)
    g, u = v[..., 0::2].clamp(max=1.5), v[..., 1::2].clamp(-1.5, 1.5)
    _close(opmux.ops.swigluoai_and_mul(x, 1.2, 1.5), (u + 1) * g * _sigmoid(1.2 * g), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_formulas(dtype: torch.dtype) -> None:
    x = (torch.randn(5, 33) * 3).to(dtype)
    v = x.double()
    c = math.sqrt(2 / math.pi)
    _close(opmux.ops.gelu_new(x), 0.5 * v * (1 + torch.tanh(c * (v + 0.044715 * v ** 3))), dtype)
    _close(opmux.ops.gelu_fast(x), 0.5 * v * (1 + torch.tanh(c * v * (1 + 0.044715 * v * v))),
           dtype)
    _close(opmux.ops.quick_gelu(x), v * _sigmoid(1.702 * v), dtype)
    _close(opmux.ops.relu2(x), v.clamp(min=0) ** 2, dtype)


def test_gelu_and_mul_sparse_formula() -> None:
    x = torch.randn(4, 2 * 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    m = statistics.NormalDist().inv_cdf(0.9)
    gate, up = x[:, :64], x[:, 64:]
    cutoff = gate.mean(-1, keepdim=True) + gate.std(-1, keepdim=True, unbiased=False) * m
    s = (gate - cutoff).clamp(min=0)
    want = 0.5 * s * (1 + torch.erf(s / math.sqrt(2))) * up
    torch.testing.assert_close(opmux.ops.gelu_and_mul_sparse(x, 0.9, "none"), want)
    # about 10% of the gate values survive a 0.9 target
    kept = (s > 0).double().mean().item()
    assert 0.03 < kept < 0.2
    assert opmux.ops.activation.sparsity_std_multiplier(0.95) == pytest.approx(1.6448536, 1e-6)


@pytest.mark.parametrize(("x_dtype", "p_dtype", "out_dtype"), [
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16, torch.float32),  # as vLLM: shape-[1] params promote
])
def test_xielu_formula_and_dtype(x_dtype: torch.dtype, p_dtype: torch.dtype,
                                 out_dtype: torch.dtype) -> None:
    x = (torch.randn(6, 40) * 2).to(x_dtype)
    ap = torch.tensor([0.4], dtype=p_dtype)
    an = torch.tensor([-0.2], dtype=p_dtype)
    got = opmux.ops.xielu(x, ap, an, 0.5, -1e-6)
    v = x.double()
    a_p = math.log1p(math.exp(ap.double().item()))
    a_n = 0.5 + math.log1p(math.exp(an.double().item()))
    want = torch.where(v > 0, a_p * v * v + 0.5 * v,
                       (torch.expm1(v.clamp(max=-1e-6)) - v) * a_n + 0.5 * v)
    assert got.dtype == out_dtype
    tol = max(TOL[x_dtype], TOL[p_dtype]) * 2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: opmux.ops.mul_and_silu(torch.randn(3, 5)), r"mul_and_silu.*'x'.*even"),
    (lambda: opmux.ops.fatrelu_and_mul(torch.randn(2, 4), math.inf), r"'threshold'.*finite"),
    (lambda: opmux.ops.gelu_and_mul_sparse(torch.randn(2, 4), 0.0), r"'activation_sparsity'"),
    (lambda: opmux.ops.gelu_and_mul_sparse(torch.randn(2, 4), 1.0), r"in \(0, 1\)"),
    (lambda: opmux.ops.gelu_and_mul_sparse(torch.randn(2, 4), 0.5, "erf"), r"'approximate'"),
    (lambda: opmux.ops.swigluoai_and_mul(torch.randn(2, 4), 1.0, -2.0), r"'limit'"),
    (lambda: opmux.ops.relu2(torch.ones(3, dtype=torch.int64)), r"relu2.*'x'.*floating"),
    (lambda: opmux.ops.xielu(torch.randn(3), torch.zeros(2), torch.zeros(1), 0.5, -1e-6),
     r"xielu.*'alpha_p'.*one value"),
])
def test_input_errors(call: object, message: str) -> None:
    with pytest.raises(opmux.OpInputError, match=message):
        call()  # type: ignore[operator]


@pytest.mark.parametrize("name", OPS)
def test_torch_library_opcheck(name: str) -> None:
    cases = [c for c in cases_for(name) if c.name.startswith(("fp32-basic", "bf16-basic"))]
    assert cases
    conformance.run_opcheck(name, cases=cases[:2])


def test_ops_are_in_the_catalog() -> None:
    for name in OPS:
        op = getattr(opmux.ops, name)
        assert opmux.get_op(name) is op and op.mutates_args == ()
