"""The linear layers' GEMM: the catalog op ``linear`` for a decode step's rows, oneDNN where
it wins, ``F.linear`` everywhere else, same values."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from opmux.layers import ColumnParallelLinear, dense_linear

OUT, IN = 1024, 1024  # 2**20 elements: the smallest weight the oneDNN path takes

#: ``onednn_calls(fn)`` of tests/conftest.py: ``fn()`` and the oneDNN matmuls it ran
Count = Callable[[Callable[[], Any]], tuple[Any, int]]


def _inputs(gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    return {
        "three rows": lambda: torch.randn(3, IN, generator=gen),
        "decode batch": lambda: torch.randn(16, IN, generator=gen),
        "3-D": lambda: torch.randn(2, 8, IN, generator=gen),
        "transposed": lambda: torch.randn(IN, 8, generator=gen).t(),
        "strided": lambda: torch.randn(4, 2 * IN, generator=gen)[:, ::2],
        "stride 0": lambda: torch.randn(1, IN, generator=gen).expand(5, IN),
        "offset view": lambda: torch.randn(9, IN, generator=gen)[3:7],
    }


@pytest.mark.parametrize("case", list(_inputs(torch.Generator())))
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_path_equals_f_linear(two_threads: None, onednn_calls: Count, case: str,
                                     with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = _inputs(gen)[case]()
    w = torch.randn(OUT, IN, generator=gen)
    b = torch.randn(OUT, generator=gen) if with_bias else None
    with torch.inference_mode():
        got, calls = onednn_calls(lambda: dense_linear(x, w, b))
    assert calls == 1
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def _declined() -> dict[str, tuple[torch.Tensor, torch.Tensor, Callable[[], Any]]]:
    w = torch.randn(OUT, IN)
    return {
        "small weight": (torch.randn(4, 256), torch.randn(512, 256), torch.no_grad),
        "65 rows": (torch.randn(65, IN), w, torch.no_grad),
        "no rows": (torch.randn(0, IN), w, torch.no_grad),
        "bfloat16": (torch.randn(4, IN, dtype=torch.bfloat16), w.bfloat16(), torch.no_grad),
        "autograd": (torch.randn(4, IN, requires_grad=True), w, torch.enable_grad),
    }


@pytest.mark.parametrize("case", list(_declined()))
def test_other_calls_run_f_linear(two_threads: None, onednn_calls: Count, case: str) -> None:
    x, w, mode = _declined()[case]
    with mode():
        got, calls = onednn_calls(lambda: dense_linear(x, w, None))
    assert calls == 0
    torch.testing.assert_close(got, F.linear(x, w), rtol=0, atol=0)
    if case == "autograd":
        got.sum().backward()
        assert x.grad is not None


def _f_linear_only() -> dict[str, tuple[torch.Tensor, torch.Tensor, Any]]:
    """(x, weight, bias) that F.linear accepts in layouts oneDNN's matmul does not read."""
    x, w = torch.randn(4, IN), torch.randn(OUT, IN)
    return {
        "strided bias": (x, w, torch.randn(2 * OUT)[::2]),
        "stride-0 bias": (x, w, torch.randn(1).expand(OUT)),
        "0-d bias": (x, w, torch.tensor(0.5)),
        "one-element bias": (x, w, torch.randn(1)),
        "1-D weight": (x, torch.randn(IN * 1024)[:IN], None),
        "overlapping weight": (x, torch.randn(1, IN).expand(OUT, IN), None),
        "transposed weight": (x, torch.randn(IN, OUT).t(), torch.randn(OUT)),
    }


@pytest.mark.parametrize("case", list(_f_linear_only()))
def test_layouts_onednn_does_not_read_run_f_linear(two_threads: None, onednn_calls: Count,
                                                   case: str) -> None:
    x, w, b = _f_linear_only()[case]
    with torch.inference_mode():
        got, calls = onednn_calls(lambda: dense_linear(x, w, b))
        want = F.linear(x, w, b)
    assert calls == 0
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(("x", "w", "b"), [
    (torch.randn(4, IN + 1), torch.randn(OUT, IN), None),
    (torch.randn(4, IN), torch.randn(OUT, IN), torch.randn(OUT + 1)),
    (torch.randn(4, IN), torch.randn(OUT, IN), torch.randn(2, OUT)),
], ids=["input width", "bias length", "2-D bias"])
def test_bad_shapes_raise_f_linears_error(two_threads: None, x: torch.Tensor, w: torch.Tensor,
                                          b: torch.Tensor | None) -> None:
    with torch.inference_mode():
        with pytest.raises(RuntimeError) as want:
            F.linear(x, w, b)
        with pytest.raises(RuntimeError) as got:
            dense_linear(x, w, b)
    assert str(got.value) == str(want.value)


def test_cpu_autocast_runs_f_linear(two_threads: None, onednn_calls: Count) -> None:
    """Under CPU autocast the call follows autocast's dtype, as F.linear does."""
    x, w = torch.randn(4, IN), torch.randn(OUT, IN)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, calls = onednn_calls(lambda: dense_linear(x, w, None))
        want = F.linear(x, w)
    assert calls == 0
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_one_thread_runs_f_linear(onednn_calls: Count) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            _, calls = onednn_calls(
                lambda: dense_linear(torch.randn(4, IN), torch.randn(OUT, IN), None))
    finally:
        torch.set_num_threads(before)
    assert calls == 0


def test_compiled_layer_runs_f_linear(two_threads: None, onednn_calls: Count) -> None:
    layer = ColumnParallelLinear(IN, OUT, bias=True)
    layer.weight_loader(layer.weight, torch.randn(OUT, IN))
    assert layer.bias is not None
    layer.weight_loader(layer.bias, torch.randn(OUT))
    x = torch.randn(4, IN)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        (eager, _), calls = onednn_calls(lambda: layer(x))
        assert calls == 1
        (got, _), calls = onednn_calls(lambda: compiled(x))
    assert calls == 0  # the traced graph holds F.linear
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-4)


#: ``op_calls(name)`` of tests/conftest.py: the list receiving the arguments of every call
Calls = Callable[[str], list[dict[str, Any]]]


@pytest.mark.parametrize("case", ["one row", "two rows", "1-D input", "3-D one token",
                                  "stride-0 row", "bias"])
def test_decode_rows_run_the_catalog_op(op_calls: Calls, onednn_calls: Count,
                                        case: str) -> None:
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(OUT, IN, generator=gen), None
    x = {"one row": lambda: torch.randn(1, IN, generator=gen),
         "two rows": lambda: torch.randn(2, IN, generator=gen),
         "1-D input": lambda: torch.randn(IN, generator=gen),
         "3-D one token": lambda: torch.randn(1, 1, IN, generator=gen),
         "stride-0 row": lambda: torch.randn(1, generator=gen).expand(2, IN),
         "bias": lambda: torch.randn(1, IN, generator=gen)}[case]()
    if case == "bias":
        b = torch.randn(OUT, generator=gen)
    calls = op_calls("linear")
    with torch.no_grad():
        got, matmuls = onednn_calls(lambda: dense_linear(x, w, b))
    assert len(calls) == 1 and calls[0]["x"] is x and calls[0]["weight"] is w
    assert matmuls == 0
    assert got.shape == F.linear(x, w, b).shape
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def _not_for_the_op() -> dict[str, Callable[[], Any]]:
    """Calls of one or two rows that keep F.linear's own behaviour."""
    w = torch.randn(OUT, IN)

    def autocast() -> Any:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return dense_linear(torch.randn(1, IN), w, None)

    def autograd() -> Any:
        x = torch.randn(1, IN, requires_grad=True)
        dense_linear(x, w, None).sum().backward()
        assert x.grad is not None

    def no_grad(x: torch.Tensor, weight: torch.Tensor = w, bias: Any = None) -> Any:
        with torch.no_grad():
            return dense_linear(x, weight, bias)

    return {
        "autocast": autocast,
        "autograd": autograd,
        "bfloat16": lambda: no_grad(torch.randn(1, IN).bfloat16(), w.bfloat16()),
        "float64": lambda: no_grad(torch.randn(1, IN).double(), w.double()),
        "three rows": lambda: no_grad(torch.randn(3, IN)),
        "0-d bias": lambda: no_grad(torch.randn(1, IN), w, torch.tensor(0.5)),
        "1-D weight": lambda: no_grad(torch.randn(1, IN), torch.randn(IN)),
        "compiled": lambda: torch.compile(lambda x: dense_linear(x, w, None),
                                          fullgraph=True)(torch.randn(1, IN)),
    }


@pytest.mark.parametrize("case", list(_not_for_the_op()))
def test_other_calls_keep_f_linear(op_calls: Calls, case: str) -> None:
    calls = op_calls("linear")
    with torch.no_grad() if case == "compiled" else contextlib.nullcontext():
        _not_for_the_op()[case]()
    assert calls == []
