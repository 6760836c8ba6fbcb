"""The ``cpp`` linear kernel ``linear_out`` (a few rows of x against the plain weight: the
``cpp`` provider of the catalog op ``linear`` and the Engine's row kernel) against
``F.linear``: odd sizes, strided rows, bias or none, float32 (8 rows at a time, or one at a
time for a single row said to lie on huge pages) and bfloat16 (one row at a time), views; bad
arguments refused before anything is written."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow  # the session fixture compiles the extension on first use


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(37, 5), (1000, 333), (129, 17), (32, 8), (16, 1),
                                      (31, 9), (33, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("huge_pages", [False, True])  # float32 single rows: the row loop
def test_plain_kernel_matches_f_linear(cpp: Any, dtype: torch.dtype, k: int, n: int, rows: int,
                                       with_bias: bool, huge_pages: bool) -> None:
    g = torch.Generator().manual_seed(k * 1000 + n + rows)
    w = torch.randn(n, k + 3, generator=g).to(dtype)[:, 1:k + 1]  # rows apart by k + 3
    x = torch.randn(rows, k + 5, generator=g).to(dtype)[:, 2:k + 2]  # strided rows
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    torch.ops.opmux_cpu.linear_out(out, x, w, bias, huge_pages)
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    native = F.linear(x, w, bias)
    slack = 1e-6 * (x.double().abs() @ w.double().abs().t()).max().item()
    err = (out.double() - exact).abs().max().item()
    assert err <= 2 * (native.double() - exact).abs().max().item() + slack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_kernel_with_two_threads(cpp: Any, two_threads: None, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(4100, 300, generator=g), torch.randn(2, 300, generator=g)
    w, x = w.to(dtype), x.to(dtype)
    out = torch.empty(2, 4100, dtype=dtype)
    torch.ops.opmux_cpu.linear_out(out, x, w, None)
    want = F.linear(x.float(), w.float()).to(dtype)
    torch.testing.assert_close(out, want, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-4 if dtype == torch.float32 else 1e-2)


def test_plain_kernel_refuses_bad_arguments_before_writing(cpp: Any) -> None:
    w, out = torch.randn(16, 32), torch.zeros(1, 16)
    kernel = torch.ops.opmux_cpu.linear_out
    for x, weight, bias, what in (
            (torch.randn(1, 31), w, None, "weight"), (torch.randn(1, 32).double(), w, None, "bf"),
            (torch.randn(1, 32), w.t().contiguous().t(), None, "unit inner"),
            (torch.randn(1, 32), w, torch.randn(3), "bias"),
            (torch.randn(1, 32), w.bfloat16(), None, "dtype")):
        with pytest.raises(ValueError, match=rf"opmux::linear \(provider 'cpp'\).*{what}"):
            kernel(out, x, weight, bias)
    assert not out.any()


def test_provider_takes_one_or_two_rows(cpp: Any) -> None:
    import opmux
    from opmux.testing import conformance

    report = conformance.check_provider("linear", "cpp")
    assert report.ok, report.format()
    skipped = {c.name for c in report.cases if c.status == "skip"}
    # declined: half dtypes other than bf16, and more than two rows (a GEMM's work)
    assert skipped and all(name.startswith("fp16-") or "prefill" in name for name in skipped), \
        report.format()
    op = opmux.get_op("linear")
    w = torch.randn(24, 64)
    assert op.dispatch(torch.randn(2, 64), w).provider == "cpp"
    assert op.dispatch(torch.randn(1, 1, 64), w, torch.randn(24)).provider == "cpp"
    assert op.dispatch(torch.randn(3, 64), w).provider == "native"
    assert op.dispatch(torch.randn(1, 64), torch.randn(64, 24).t()).provider == "native"
    assert op.dispatch(torch.randn(1, 64).half(), w.half()).provider == "native"


@pytest.mark.parametrize("view", ["expanded-x", "offset-x", "column-x", "expanded-weight",
                                  "expanded-bias", "strided-bias", "vector-x"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_provider_agrees_with_native_on_views(cpp: Any, view: str, dtype: torch.dtype) -> None:
    import opmux

    g = torch.Generator().manual_seed(len(view))

    def randn(*shape: int) -> torch.Tensor:  # in the dtype before any view is taken
        return torch.randn(*shape, generator=g).to(dtype)

    x, w, b = randn(2, 48), randn(20, 48), randn(20)
    if view == "expanded-x":
        x = randn(1, 48).expand(2, 48)
    elif view == "offset-x":
        x = randn(3, 50)[1:, 2:]
    elif view == "column-x":
        x = randn(48, 2).t()  # strides (1, 2): copied to rows
    elif view == "expanded-weight":
        w = randn(1, 48).expand(20, 48)
    elif view == "expanded-bias":
        b = randn(1).expand(20)
    elif view == "strided-bias":
        b = randn(40)[::2]
    elif view == "vector-x":
        x = x[0]
    op = opmux.get_op("linear")
    assert op.dispatch(x, w, b).provider == "cpp"
    # bfloat16: the same float32 sums in another order, one rounding each: an ulp apart at most
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(op.impls["cpp"].fn(x, w, b), op.native(x, w, b),
                               rtol=tol, atol=tol)
