"""The ``cpp`` linear kernels against ``F.linear``: ``linear_blocked_out`` (a few rows of x
against a weight laid out in blocks of 8 rows by one cache line) and ``linear_out`` (the plain
weight, the ``cpp`` provider of the catalog op ``linear``): odd sizes, strided rows, bias or
none, float32 and bfloat16, views; bad arguments refused before anything is written."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow  # the session fixture compiles the extension on first use


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` as ``[N/8, K/C, 8, C]``, C elements in 64 bytes, zero-padded."""
    n, k = w.shape
    line = 64 // w.element_size()
    p = F.pad(w, (0, -k % line, 0, -n % 8))
    return p.view(p.shape[0] // 8, 8, p.shape[1] // line, line).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(37, 5), (1000, 333), (129, 17), (32, 8), (16, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(cpp: Any, dtype: torch.dtype, k: int, n: int, rows: int,
                          with_bias: bool) -> None:
    g = torch.Generator().manual_seed(k * 1000 + n + rows)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k + 5, generator=g).to(dtype)[:, 2:k + 2]  # strided rows
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    torch.ops.opmux_cpu.linear_blocked_out(out, x, _blocks(w), bias)
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    native = F.linear(x, w, bias)
    # one rounding per output, like native: no further from the exact result than native
    # (float32: the sum order differs, so within a few ulps of the dot product's size)
    slack = 1e-6 * (x.double().abs() @ w.double().abs().t()).max().item()
    err = (out.double() - exact).abs().max().item()
    assert err <= 2 * (native.double() - exact).abs().max().item() + slack


def test_bad_arguments_are_refused_before_writing(cpp: Any) -> None:
    w = _blocks(torch.randn(16, 32))
    out = torch.zeros(1, 16)
    with pytest.raises(ValueError, match=r"opmux::linear \(provider 'cpp'\).*packed weight"):
        torch.ops.opmux_cpu.linear_blocked_out(out, torch.randn(1, 64), w, None)
    with pytest.raises(ValueError, match=r"opmux::linear \(provider 'cpp'\).*float32 or bf"):
        torch.ops.opmux_cpu.linear_blocked_out(out, torch.randn(1, 32).double(), w, None)
    with pytest.raises(ValueError, match=r"opmux::linear \(provider 'cpp'\).*bias"):
        torch.ops.opmux_cpu.linear_blocked_out(out, torch.randn(1, 32), w, torch.randn(3))
    assert not out.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(37, 5), (1000, 333), (129, 17), (32, 8), (16, 1),
                                      (31, 9), (33, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_plain_kernel_matches_f_linear(cpp: Any, dtype: torch.dtype, k: int, n: int, rows: int,
                                       with_bias: bool) -> None:
    g = torch.Generator().manual_seed(k * 1000 + n + rows)
    w = torch.randn(n, k + 3, generator=g).to(dtype)[:, 1:k + 1]  # rows apart by k + 3
    x = torch.randn(rows, k + 5, generator=g).to(dtype)[:, 2:k + 2]  # strided rows
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    torch.ops.opmux_cpu.linear_out(out, x, w, bias)
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    native = F.linear(x, w, bias)
    slack = 1e-6 * (x.double().abs() @ w.double().abs().t()).max().item()
    err = (out.double() - exact).abs().max().item()
    assert err <= 2 * (native.double() - exact).abs().max().item() + slack


def test_plain_kernel_with_two_threads(cpp: Any, two_threads: None) -> None:
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(4100, 300, generator=g), torch.randn(2, 300, generator=g)
    out = torch.empty(2, 4100)
    torch.ops.opmux_cpu.linear_out(out, x, w, None)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)


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
def test_provider_agrees_with_native_on_views(cpp: Any, view: str) -> None:
    import opmux

    g = torch.Generator().manual_seed(len(view))
    x, w = torch.randn(2, 48, generator=g), torch.randn(20, 48, generator=g)
    b = torch.randn(20, generator=g)
    if view == "expanded-x":
        x = torch.randn(1, 48, generator=g).expand(2, 48)
    elif view == "offset-x":
        x = torch.randn(3, 50, generator=g)[1:, 2:]
    elif view == "column-x":
        x = torch.randn(48, 2, generator=g).t()  # strides (1, 2): copied to rows
    elif view == "expanded-weight":
        w = torch.randn(1, 48, generator=g).expand(20, 48)
    elif view == "expanded-bias":
        b = torch.randn(1, generator=g).expand(20)
    elif view == "strided-bias":
        b = torch.randn(40, generator=g)[::2]
    elif view == "vector-x":
        x = x[0]
    op = opmux.get_op("linear")
    assert op.dispatch(x, w, b).provider == "cpp"
    torch.testing.assert_close(op.impls["cpp"].fn(x, w, b), op.native(x, w, b),
                               rtol=1e-5, atol=1e-5)
