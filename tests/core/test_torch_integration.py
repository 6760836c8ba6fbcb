"""torch integration: compile without graph breaks, opcheck, mutation, autograd, fakes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import opmux


@pytest.fixture
def three_ops(registry: opmux.OpRegistry, ns: str) -> tuple[opmux.Op, opmux.Op, opmux.Op]:
    @opmux.register_op(namespace=ns, registry=registry)
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @opmux.register_op(namespace=ns, registry=registry)
    def shift(x: torch.Tensor, by: float = 1.0) -> torch.Tensor:
        return x + by

    @opmux.register_op(namespace=ns, registry=registry)
    def split_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(-1), x.amax(-1)

    @double.register_impl("cpu_mark", dispatch_key="CPU")
    def _double_cpu(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 10

    return double, shift, split_sum


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_fullgraph_compile_has_no_graph_breaks(
        three_ops: tuple[opmux.Op, opmux.Op, opmux.Op], backend: str) -> None:
    double, shift, split_sum = three_ops

    def block(x: torch.Tensor) -> torch.Tensor:
        s, m = split_sum(shift(double(x), 0.5))
        return s + m

    x = torch.randn(4, 8)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), block(x))
    # the provider is chosen when the graph runs: the CPU provider served
    torch.testing.assert_close(compiled(x), (x * 2 + 10.5).sum(-1) + (x * 2 + 10.5).amax(-1))
    torch._dynamo.reset()


def test_priorities_are_set_outside_the_compiled_region(
        three_ops: tuple[opmux.Op, opmux.Op, opmux.Op]) -> None:
    double = three_ops[0]
    compiled = torch.compile(lambda x: double(x) + 1, fullgraph=True, backend="eager")
    x = torch.ones(2)
    assert compiled(x).tolist() == [13.0, 13.0]  # cpu_mark: 2 + 10, then + 1
    with double.set_priority(["native"]):  # around the compiled call: applies at run time
        assert compiled(x).tolist() == [3.0, 3.0]
    assert compiled(x).tolist() == [13.0, 13.0]

    def scoped_inside(x: torch.Tensor) -> torch.Tensor:
        with double.set_priority(["native"]):
            return double(x)

    # the documented rule: a priority scope inside a fullgraph region is not traceable
    # (torch's message varies by version: "Unsupported context manager", ...)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(scoped_inside, fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()


def test_opcheck_passes(three_ops: tuple[opmux.Op, opmux.Op, opmux.Op]) -> None:
    double, shift, split_sum = three_ops
    x = torch.randn(3, 5)
    torch.library.opcheck(double.torch_op, (x,))
    torch.library.opcheck(shift.torch_op, (x, 2.0))
    torch.library.opcheck(split_sum.torch_op, (x,))


def test_mutating_op_end_to_end(registry: opmux.OpRegistry, ns: str) -> None:
    @opmux.register_op(namespace=ns, registry=registry, mutates_args=["out"])
    def fill_plus(out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(x + 1)

    assert "Tensor(a0!) out" in fill_plus.schema

    @fill_plus.register_impl("cpu_mark", dispatch_key="CPU")
    def _fill(out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(x + 10)

    out = torch.zeros(3)
    assert fill_plus(out, torch.ones(3)) is None
    assert out.tolist() == [11.0] * 3
    torch.library.opcheck(fill_plus.torch_op, (torch.zeros(3), torch.ones(3)))

    def f(o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        fill_plus(o, x)
        return o * 2

    out2 = torch.zeros(3)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert compiled(out2, torch.ones(3)).tolist() == [22.0] * 3
    assert out2.tolist() == [11.0] * 3
    torch._dynamo.reset()


def test_register_autograd_gradcheck(registry: opmux.OpRegistry, ns: str) -> None:
    @opmux.register_op(namespace=ns, registry=registry)
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x.pow(3)

    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        (x,) = inputs
        ctx.save_for_backward(x)

    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return grad * 3 * x * x

    cube.register_autograd(backward, setup_context=setup_context)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(cube, (x,))
    torch.library.opcheck(cube.torch_op, (x,))


def test_register_fake_overrides_shapes(registry: opmux.OpRegistry, ns: str) -> None:
    @opmux.register_op(namespace=ns, registry=registry)
    def nonzero_count(x: torch.Tensor) -> torch.Tensor:
        return x.new_full((int((x != 0).sum().item()),), 1.0)

    @nonzero_count.register_fake
    def _fake(x: torch.Tensor) -> torch.Tensor:
        n = torch.library.get_ctx().new_dynamic_size()
        return x.new_empty((n,))

    assert nonzero_count(torch.tensor([0.0, 1.0, 2.0])).shape == (2,)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        out = nonzero_count(torch.empty(3))
        assert out.dim() == 1


def test_register_fake_is_torchs_registered_fake(ns: str) -> None:
    from torch._library.simple_registry import singleton
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    registry = opmux.OpRegistry()
    try:
        @opmux.register_op(namespace=ns, registry=registry)
        def head(x: torch.Tensor, n: int) -> torch.Tensor:
            return x[:n].clone()

        @head.register_fake
        def _fake(x: torch.Tensor, n: int) -> torch.Tensor:
            return x.new_empty((torch.library.get_ctx().new_dynamic_size(),))

        with FakeTensorMode(shape_env=ShapeEnv()):  # get_ctx: torch's registered fake ran
            assert head(torch.empty(5), 2).dim() == 1
        with pytest.raises(RuntimeError, match="get_ctx"):  # meta calls reach it too
            head(torch.empty(5, device="meta"), 2)

        @head.register_fake
        def _fake2(x: torch.Tensor, n: int) -> torch.Tensor:
            return x.new_empty((n,))

        assert head(torch.empty(5, device="meta"), 2).shape == (2,)
    finally:
        registry.destroy()
    assert singleton.find(head.qualname).fake_impl.kernel is None  # gone with the library


def test_register_meta_serves_fake_tensor_mode_without_a_torch_fake(ns: str) -> None:
    from torch._library.simple_registry import singleton
    from torch._subclasses.fake_tensor import FakeTensorMode

    registry = opmux.OpRegistry()
    try:
        @opmux.register_op(namespace=ns, registry=registry)
        def halve(x: torch.Tensor) -> torch.Tensor:
            return x[: x.shape[0] // 2].clone()

        calls: list[int] = []

        @halve.register_meta
        def _meta(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return x.new_empty((x.shape[0] // 2,))

        assert halve.fake is _meta
        assert singleton.find(halve.qualname).fake_impl.kernel is None  # no torch fake
        with FakeTensorMode():  # runs the op's Meta kernel, which runs _meta
            assert halve(torch.empty(6)).shape == (3,)
        assert halve(torch.empty(8, device="meta")).shape == (4,)
        assert len(calls) == 2
        compiled = torch.compile(lambda x: halve(x) * 2, fullgraph=True)
        torch.testing.assert_close(compiled(torch.arange(6.0)), torch.arange(3.0) * 2)
    finally:
        registry.destroy()


def test_direct_register_custom_op(ns: str) -> None:
    lib = torch.library.Library(ns, "FRAGMENT")
    try:
        def triple(x: torch.Tensor) -> torch.Tensor:
            return x * 3

        opmux.direct_register_custom_op("triple", triple, mutates_args=[],
                                        fake_impl=lambda x: torch.empty_like(x),
                                        target_lib=lib, dispatch_key="CPU")
        op = getattr(torch.ops, ns).triple
        assert op(torch.ones(2)).tolist() == [3.0, 3.0]
        assert op(torch.ones(2, device="meta")).device.type == "meta"
        compiled = torch.compile(lambda x: op(x) + 1, fullgraph=True, backend="eager")
        assert compiled(torch.ones(1)).item() == 4.0
        with pytest.raises(opmux.RegistrationError, match="already defined"):
            opmux.direct_register_custom_op("triple", triple, target_lib=lib)
        torch._dynamo.reset()
    finally:
        lib._destroy()


def test_direct_register_custom_op_default_key_is_the_platform_key(ns: str) -> None:
    # default library is opmux's own: use a unique name there
    name = f"plus_{ns}"

    def plus(x: torch.Tensor) -> torch.Tensor:
        return x + 5

    opmux.direct_register_custom_op(name, plus, mutates_args=[])
    assert getattr(torch.ops.opmux, name)(torch.zeros(1)).item() == 5.0


@pytest.mark.parametrize("key", ["GPU", "CompositeExplicitAutograd", "cpu"])
def test_direct_register_custom_op_validates_before_defining(ns: str, key: str) -> None:
    lib = torch.library.Library(ns, "FRAGMENT")
    try:
        def quad(x: torch.Tensor) -> torch.Tensor:
            return x * 4

        with pytest.raises(opmux.RegistrationError, match=f"dispatch key '{key}'"):
            opmux.direct_register_custom_op("quad", quad, target_lib=lib, dispatch_key=key)
        assert not hasattr(getattr(torch.ops, ns), "quad")  # nothing defined
        opmux.direct_register_custom_op("quad", quad, target_lib=lib, dispatch_key="CPU")
        assert getattr(torch.ops, ns).quad(torch.ones(1)).item() == 4.0  # the retry works
    finally:
        lib._destroy()


@pytest.mark.parametrize("namespace", ["aten", "prims", "torch"])
def test_torch_namespaces_are_refused(registry: opmux.OpRegistry, namespace: str) -> None:
    def relu2(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(opmux.RegistrationError, match=f"namespace '{namespace}' belongs to torch"):
        opmux.register_op(namespace=namespace, registry=registry)(relu2)
    lib = torch.library.Library(namespace, "FRAGMENT")
    try:
        with pytest.raises(opmux.RegistrationError, match="belongs to torch"):
            opmux.direct_register_custom_op("opmux_relu2", relu2, target_lib=lib,
                                            dispatch_key="CPU")
    finally:
        lib._destroy()


_CLAIM_CATALOG_NAME = """
import json, torch, opmux
errors = []
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x
for attempt in (lambda: opmux.direct_register_custom_op("rms_norm", rms_norm),
                lambda: opmux.register_op(rms_norm)):
    try:
        attempt()
    except opmux.RegistrationError as exc:
        errors.append(str(exc))
opmux.load_plugins()
x, w = torch.randn(2, 8), torch.ones(8)
print(json.dumps({"errors": errors, "ops": len(opmux.list_ops()),
                  "ok": bool(torch.allclose(opmux.ops.rms_norm(x, w),
                                            opmux.get_op("rms_norm").native(x, w), atol=1e-5)),
                  "module": opmux.get_op("rms_norm").native.__module__}))
"""


def test_catalog_names_are_reserved_before_the_catalog_loads() -> None:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPMUX_")}
    out = json.loads(subprocess.run([sys.executable, "-c", _CLAIM_CATALOG_NAME], env=env,
                                    check=True, capture_output=True, text=True).stdout)
    assert len(out["errors"]) == 2
    for message in out["errors"]:
        assert "'opmux::rms_norm' is already defined (by opmux.ops.layernorm)" in message
        assert "reserved in namespace 'opmux'" in message
    assert out["ok"] and out["ops"] >= 11 and out["module"] == "opmux.ops.layernorm"


@pytest.mark.parametrize("fn", [None, 3, "shape"])
def test_register_meta_refuses_what_is_not_a_function(ns: str, fn: Any) -> None:
    registry = opmux.OpRegistry()
    try:
        @opmux.register_op(namespace=ns, registry=registry)
        def halve(x: torch.Tensor) -> torch.Tensor:
            return x[: x.shape[0] // 2].clone()

        with pytest.raises(opmux.RegistrationError, match=r"register_meta on op .*halve': "
                           r"expected a function with the op's signature, got "):
            halve.register_meta(fn)
        assert halve(torch.empty(8, device="meta")).shape == (4,)  # the default fake stays
    finally:
        registry.destroy()
