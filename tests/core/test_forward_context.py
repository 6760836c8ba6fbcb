"""The forward context and layer-name ops: resolution, errors, nesting, threads, compile."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import opmux
from opmux.core.forward_context import (
    collect_layers,
    forward_context,
    get_forward_context,
    register_layer_op,
    resolve_layer,
)


class Shift(torch.nn.Module):
    def __init__(self, layer_name: str, bias: float) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.bias = bias
        self.calls = 0


def _shift_op(ns: str, registry: opmux.OpRegistry) -> opmux.Op:
    @register_layer_op("shift", namespace=ns, registry=registry,
                       fake=lambda layer_name, x: torch.empty_like(x))
    def shift(layer: Shift, x: torch.Tensor) -> torch.Tensor:
        layer.calls += 1
        return x + layer.bias

    return shift


def test_layer_op_resolves_from_context(ns: str, registry: opmux.OpRegistry) -> None:
    op = _shift_op(ns, registry)
    assert op.schema == "(str layer_name, Tensor x) -> Tensor"
    a, b = Shift("a", 1.0), Shift("b", 2.0)
    with forward_context(layers={"a": a, "b": b}) as ctx:
        assert get_forward_context() is ctx
        assert op("a", torch.zeros(2)).tolist() == [1.0, 1.0]
        assert op("b", torch.zeros(2)).tolist() == [2.0, 2.0]
        assert resolve_layer("a") is a
    assert (a.calls, b.calls) == (1, 1)


def test_errors_outside_context_and_for_unknown_names(ns: str,
                                                      registry: opmux.OpRegistry) -> None:
    op = _shift_op(ns, registry)
    with pytest.raises(opmux.OpmuxError,
                       match=r"layer 'a' was requested but no forward context is active in "
                             r"this thread; wrap the forward pass in"):
        op("a", torch.zeros(1))
    with pytest.raises(opmux.OpmuxError, match="no forward context is active"):
        get_forward_context()
    with forward_context(layers={"b": Shift("b", 0.0), "a2": Shift("a2", 0.0)}), \
            pytest.raises(opmux.OpmuxError,
                          match=r"layer 'a' is not in the active forward context; known "
                                r"layers: \['a2', 'b'\]"):
        op("a", torch.zeros(1))
    with pytest.raises(opmux.OpmuxError, match="layer names must be strings"):
        with forward_context(layers={1: Shift("x", 0.0)}):  # type: ignore[dict-item]
            pass


def test_nested_contexts_restore(ns: str, registry: opmux.OpRegistry) -> None:
    op = _shift_op(ns, registry)
    outer, inner = Shift("l", 1.0), Shift("l", 5.0)
    x = torch.zeros(1)
    with forward_context(layers={"l": outer}, metadata="outer") as c1:
        assert op("l", x).item() == 1.0
        with forward_context(layers={"l": inner}, metadata="inner") as c2:
            assert op("l", x).item() == 5.0
            assert get_forward_context().metadata == "inner"
        assert get_forward_context() is c1 and op("l", x).item() == 1.0
        with pytest.raises(RuntimeError, match="inside"), forward_context(layers={}):
            raise RuntimeError("inside")
        assert get_forward_context() is c1
        assert c2.layers["l"] is inner
    with pytest.raises(opmux.OpmuxError):
        get_forward_context()


def test_context_is_per_thread(ns: str, registry: opmux.OpRegistry) -> None:
    op = _shift_op(ns, registry)
    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            with forward_context(layers={"l": Shift("l", float(i))}):
                barrier.wait()  # every thread is inside its own context at once
                results[i] = [op("l", torch.zeros(1)).item() for _ in range(50)]
        except BaseException as exc:
            errors.append(exc)

    with forward_context(layers={"l": Shift("l", -1.0)}):
        seen_in_thread: list[BaseException] = []

        def bare() -> None:
            try:
                op("l", torch.zeros(1))
            except opmux.OpmuxError as exc:
                seen_in_thread.append(exc)

        t = threading.Thread(target=bare)
        t.start()
        t.join()
        assert len(seen_in_thread) == 1  # the main thread's context is not inherited
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert op("l", torch.zeros(1)).item() == -1.0
    assert not errors, errors[0]
    assert results == {i: [float(i)] * 50 for i in range(8)}


def test_collect_layers() -> None:
    model = torch.nn.Sequential(Shift("m.0", 0.0), torch.nn.ReLU(), Shift("m.2", 0.0))
    layers = collect_layers(model)
    assert sorted(layers) == ["m.0", "m.2"] and layers["m.0"] is model[0]
    dup = torch.nn.Sequential(Shift("same", 0.0), Shift("same", 1.0))
    with pytest.raises(opmux.OpmuxError, match=r"two layers are named 'same' \(the second at "
                                               r"'1'\)"):
        collect_layers(dup)


class _Model(torch.nn.Module):
    def __init__(self, op: opmux.Op) -> None:
        super().__init__()
        self.op = op
        self.first = Shift("model.first", 1.0)
        self.second = Shift("model.second", 10.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.op(self.first.layer_name, x * 2)
        return self.op(self.second.layer_name, y) - 1


def test_compiled_layer_op_resolves_at_execution(ns: str, registry: opmux.OpRegistry) -> None:
    op = _shift_op(ns, registry)
    model = _Model(op)
    x = torch.randn(3)
    with forward_context(layers=collect_layers(model)):
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1
        assert explanation.graphs[0].code.count(f"torch.ops.{ns}.shift.default") == 2
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), x * 2 + 10.0)
    # same compiled graph, other layers under the same names: resolved when it runs
    other = {"model.first": Shift("model.first", 100.0),
             "model.second": Shift("model.second", 0.0)}
    with forward_context(layers=other):
        torch.testing.assert_close(compiled(x), x * 2 + 99.0)
    assert other["model.first"].calls == 1
    with pytest.raises(opmux.OpmuxError, match="no forward context is active"):
        compiled(x)


@pytest.mark.parametrize("factory", [register_layer_op, opmux.register_runner_op])
def test_object_op_decorators_refuse_bad_options_when_built(factory: Any) -> None:
    with pytest.raises(opmux.SignatureMismatchError, match=r"unknown option\(s\) \['mutates'\]"):
        factory("x", fake=lambda k, t: t, mutates=("t",))
    with pytest.raises(opmux.SignatureMismatchError, match="no fake= given"):
        factory("x")
