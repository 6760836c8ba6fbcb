"""The ``cpp`` kernel ``linear_blocked_out`` (a few rows of x against a weight laid out in
blocks of 8 rows by one cache line) against ``F.linear``: odd sizes, strided rows, bias or
none, float32 and bfloat16; bad arguments refused before anything is written."""

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
