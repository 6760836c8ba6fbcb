"""The catalog op ``linear``: ``F.linear``'s values and gradients, whichever provider runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opmux


@pytest.mark.parametrize(("x_shape", "with_bias"), [((2, 8), True), ((8,), False),
                                                    ((2, 3, 8), True), ((1, 8), True)])
def test_gradients_pass_gradcheck(x_shape: tuple[int, ...], with_bias: bool) -> None:
    g = torch.Generator().manual_seed(len(x_shape))
    x = torch.randn(x_shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True) \
        if with_bias else None
    assert torch.autograd.gradcheck(opmux.ops.linear, (x, w, b))


@pytest.mark.parametrize("rows", [1, 5])  # the cpp provider's one row, and native's five
def test_gradients_equal_f_linears(rows: int) -> None:
    opmux.load_plugins()
    g = torch.Generator().manual_seed(rows)
    leaves = [torch.randn(rows, 16, generator=g), torch.randn(6, 16, generator=g),
              torch.randn(6, generator=g)]
    for t in leaves:
        t.requires_grad_(True)
    expected = "cpp" if rows == 1 and "cpp" in opmux.get_op("linear").impls else "native"
    assert opmux.get_op("linear").dispatch(*leaves).provider == expected
    opmux.ops.linear(*leaves).pow(2).sum().backward()
    got = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    F.linear(*leaves).pow(2).sum().backward()
    for a, t in zip(got, leaves, strict=True):
        assert a is not None and t.grad is not None
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-5)
    # no bias: no gradient asked of it
    x, w = leaves[0].detach().requires_grad_(True), leaves[1].detach()
    opmux.ops.linear(x, w).sum().backward()
    assert x.grad is not None and w.grad is None


def test_compiled_graph_holds_one_linear_node() -> None:
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    w = torch.randn(6, 16)
    fn = torch.compile(lambda x: opmux.ops.linear(x, w) * 2, backend=backend, fullgraph=True)
    x = torch.randn(1, 16)
    torch.testing.assert_close(fn(x), F.linear(x, w) * 2, rtol=1e-5, atol=1e-5)
    assert sum("opmux.linear" in t for t in seen) == 1, seen
