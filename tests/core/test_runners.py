"""The runner registry and runner ops (schema, lookup, errors, torch.compile opacity)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch

import opmux
from opmux.core import runners
from opmux.core.runners import RunnerRegistry, register_runner_op


class Counting:
    """A runner that adds ``k`` and counts its calls."""

    def __init__(self, k: float = 1.0) -> None:
        self.k = k
        self.calls = 0

    def run(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.k

    def __repr__(self) -> str:
        return f"Counting(k={self.k})"


class Slotted:
    __slots__ = ("v",)

    def __init__(self) -> None:
        self.v = 1


@pytest.fixture
def table() -> Iterator[RunnerRegistry]:
    reg = RunnerRegistry()
    yield reg
    reg.clear()


def _add_op(ns: str, registry: opmux.OpRegistry, table: RunnerRegistry) -> opmux.Op:
    @register_runner_op("runner_add", namespace=ns, registry=registry, runners=table,
                        fake=lambda runner_id, x: torch.empty_like(x))
    def runner_add(runner: Counting, x: torch.Tensor) -> torch.Tensor:
        return runner.run(x)

    return runner_add


# ------------------------------------------------------------------ registry
def test_register_get_release(table: RunnerRegistry) -> None:
    a, b = Counting(1.0), Counting(2.0)
    ra, rb = table.register(a), table.register(b)
    assert ra != rb and ra > 0 and rb > 0
    assert table.get(ra) is a and table.get(rb) is b
    assert ra in table and len(table) == 2
    table.release(ra)
    assert ra not in table and table.get(rb) is b
    with pytest.raises(opmux.UnknownRunnerError,
                       match=rf"runner id {ra} is no longer registered: it was "
                             rf".*Counting Counting\(k=1.0\) \(released\)"):
        table.get(ra)
    with pytest.raises(opmux.UnknownRunnerError, match=rf"runner id {ra} .*\(released\)"):
        table.release(ra)


def test_ids_are_never_reused(table: RunnerRegistry) -> None:
    first = table.register(Counting())
    table.release(first)
    table.clear()
    assert table.register(Counting()) > first


def test_unknown_id_message(table: RunnerRegistry) -> None:
    table.register(Counting())
    with pytest.raises(opmux.UnknownRunnerError,
                       match=r"unknown runner id 987654: no runner was ever registered under "
                             r"it here \(1 live runner\(s\)\)"):
        table.get(987654)
    with pytest.raises(KeyError):  # UnknownRunnerError is also a KeyError
        table.get(987654)


def test_register_none_rejected(table: RunnerRegistry) -> None:
    with pytest.raises(opmux.RegistrationError, match=r"register_runner\(None\)"):
        table.register(None)


def test_scope_releases_on_exit_and_on_error(table: RunnerRegistry) -> None:
    with table.scope(Counting()) as rid:
        assert rid in table
    assert rid not in table
    with pytest.raises(RuntimeError, match="boom"), table.scope(Counting()) as rid2:
        raise RuntimeError("boom")
    assert rid2 not in table
    with table.scope(Counting()) as rid3:
        table.release(rid3)  # released early: exiting the scope must not raise
    assert len(table) == 0


def test_weak_entry_vanishes_after_collection(table: RunnerRegistry) -> None:
    obj = Counting(5.0)
    rid = table.register(obj, weak=True)
    assert table.get(rid) is obj and rid in table
    del obj
    gc.collect()
    assert rid not in table and len(table) == 0
    with pytest.raises(opmux.UnknownRunnerError,
                       match=rf"runner id {rid} is no longer registered: it was .*Counting"
                             rf"\(k=5.0\) \(collected\)"):
        table.get(rid)


def test_weak_release_then_collect_keeps_released_tombstone(table: RunnerRegistry) -> None:
    obj = Counting()
    rid = table.register(obj, weak=True)
    table.release(rid)
    del obj
    gc.collect()
    with pytest.raises(opmux.UnknownRunnerError, match=r"\(released\)"):
        table.get(rid)


def test_weak_requires_weakref_support(table: RunnerRegistry) -> None:
    with pytest.raises(opmux.RegistrationError, match=r"cannot be weakly referenced.*__weakref__"):
        table.register(Slotted(), weak=True)
    assert len(table) == 0
    assert table.get(table.register(Slotted())).v == 1  # strong is fine


def test_tombstones_are_bounded() -> None:
    table = RunnerRegistry(tombstone_limit=2)
    ids = [table.register(Counting()) for _ in range(4)]
    for rid in ids:
        table.release(rid)
    with pytest.raises(opmux.UnknownRunnerError, match="no runner was ever registered"):
        table.get(ids[0])
    with pytest.raises(opmux.UnknownRunnerError, match="no longer registered"):
        table.get(ids[-1])


def test_sixteen_threads(table: RunnerRegistry) -> None:
    per_thread = 300
    barrier = threading.Barrier(16)
    kept: list[list[tuple[int, object]]] = [[] for _ in range(16)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait()
            for j in range(per_thread):
                obj = Counting(float(j))
                weak = j % 3 == 0
                rid = table.register(obj, weak=weak)
                assert table.get(rid) is obj
                if j % 2:
                    table.release(rid)
                    with pytest.raises(opmux.UnknownRunnerError):
                        table.get(rid)
                else:
                    kept[i].append((rid, obj))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    survivors = [pair for lst in kept for pair in lst]
    ids = [rid for rid, _ in survivors]
    assert len(ids) == len(set(ids)) == 16 * per_thread // 2
    assert len(table) == len(ids)
    assert all(table.get(rid) is obj for rid, obj in survivors)


def test_global_functions() -> None:
    obj = Counting()
    rid = opmux.core.runners.register_runner(obj)
    try:
        assert runners.get_runner(rid) is obj
        assert runners.runner_registry().get(rid) is obj
    finally:
        runners.release_runner(rid)
    with pytest.raises(opmux.UnknownRunnerError):
        runners.get_runner(rid)
    with runners.runner_scope(obj) as rid2:
        assert runners.get_runner(rid2) is obj


# ----------------------------------------------------------------- runner ops
def test_runner_op_schema_and_call(ns: str, registry: opmux.OpRegistry,
                                   table: RunnerRegistry) -> None:
    op = _add_op(ns, registry, table)
    assert op.schema == "(SymInt runner_id, Tensor x) -> Tensor"
    r1, r2 = Counting(1.0), Counting(10.0)
    id1, id2 = table.register(r1), table.register(r2)
    x = torch.zeros(3)
    assert op(id1, x).tolist() == [1.0] * 3
    assert op(id2, x).tolist() == [10.0] * 3
    assert op.torch_op(id2, x).tolist() == [10.0] * 3
    assert (r1.calls, r2.calls) == (1, 2)
    table.release(id1)
    with pytest.raises(opmux.UnknownRunnerError, match=rf"runner id {id1} .*\(released\)"):
        op(id1, x)


def test_runner_op_eager_bypass_with_keywords(ns: str, registry: opmux.OpRegistry,
                                              table: RunnerRegistry) -> None:
    op = _add_op(ns, registry, table)
    rid = table.register(Counting(2.0))
    with opmux.enable_torch_wrap(False):
        assert op(runner_id=rid, x=torch.zeros(2)).tolist() == [2.0, 2.0]
        assert op(rid, x=torch.ones(2)).tolist() == [3.0, 3.0]


def test_runner_op_weak_runner(ns: str, registry: opmux.OpRegistry,
                               table: RunnerRegistry) -> None:
    op = _add_op(ns, registry, table)
    obj = Counting(4.0)
    rid = table.register(obj, weak=True)
    assert op(rid, torch.zeros(1)).item() == 4.0
    del obj
    gc.collect()
    with pytest.raises(opmux.UnknownRunnerError, match=r"\(collected\)"):
        op(rid, torch.zeros(1))


def test_runner_op_mutating(ns: str, registry: opmux.OpRegistry, table: RunnerRegistry) -> None:
    @register_runner_op("fill_from", namespace=ns, registry=registry, runners=table,
                        mutates_args=("out",), fake=lambda runner_id, out: None)
    def fill_from(runner: Counting, out: torch.Tensor) -> None:
        out.fill_(runner.k)

    assert fill_from.schema.startswith("(SymInt runner_id, Tensor(a")
    assert fill_from.schema.endswith("!) out) -> ()")
    out = torch.zeros(2)
    fill_from(table.register(Counting(7.0)), out)
    assert out.tolist() == [7.0, 7.0]


def test_runner_op_definition_errors(ns: str, registry: opmux.OpRegistry,
                                     table: RunnerRegistry) -> None:
    with pytest.raises(opmux.SignatureMismatchError,
                       match=r"the fake must take the op's parameters \['runner_id', 'x'\].*"
                             r"got \['runner', 'x'\]"):
        @register_runner_op("bad_fake", namespace=ns, registry=registry, runners=table,
                            fake=lambda runner, x: x)
        def bad_fake(runner: Counting, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(opmux.SignatureMismatchError, match="first positional parameter"):
        @register_runner_op("no_params", namespace=ns, registry=registry, runners=table,
                            fake=lambda: None)
        def no_params() -> None:
            return None

    with pytest.raises(opmux.SignatureMismatchError, match="'runner_id' is reserved"):
        @register_runner_op("clash", namespace=ns, registry=registry, runners=table,
                            fake=lambda runner_id, x, runner_id2: x)
        def clash(runner: Counting, x: torch.Tensor, runner_id: int) -> torch.Tensor:
            return x


# ------------------------------------------------------------- torch.compile
class _UsesRunner(torch.nn.Module):
    def __init__(self, op: opmux.Op, rid: int) -> None:
        super().__init__()
        self.op = op
        self.rid = rid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.rid, x * 2) + 1


def test_runner_op_is_one_opaque_node(ns: str, registry: opmux.OpRegistry,
                                      table: RunnerRegistry) -> None:
    op = _add_op(ns, registry, table)
    runner = Counting(3.0)
    model = _UsesRunner(op, table.register(runner))
    x = torch.randn(4)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    code = explanation.graphs[0].code
    assert f"torch.ops.{ns}.runner_add.default" in code


def test_runner_not_called_while_tracing(ns: str, registry: opmux.OpRegistry,
                                         table: RunnerRegistry) -> None:
    op = _add_op(ns, registry, table)
    runner = Counting(3.0)
    model = _UsesRunner(op, table.register(runner))
    calls_at_compile: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        calls_at_compile.append(runner.calls)
        return gm.forward

    x = torch.randn(4)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out = compiled(x)
    assert calls_at_compile == [0]
    assert runner.calls == 1
    torch.testing.assert_close(out, x * 2 + 3.0 + 1)


def test_runner_called_once_per_execution_under_aot(ns: str, registry: opmux.OpRegistry,
                                                    table: RunnerRegistry) -> None:
    # aot_eager traces with fake tensors (the fake), then runs the graph: exactly one
    # runner call per execution means tracing never reached the runner.
    op = _add_op(ns, registry, table)
    runner = Counting(1.0)
    model = _UsesRunner(op, table.register(runner))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(5)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), x * 2 + 2.0)
    assert runner.calls == 3


def test_runner_id_as_graph_input(ns: str, registry: opmux.OpRegistry,
                                  table: RunnerRegistry) -> None:
    op = _add_op(ns, registry, table)
    r1, r2 = Counting(1.0), Counting(100.0)
    id1, id2 = table.register(r1), table.register(r2)

    @torch.compile(fullgraph=True, backend="eager")
    def f(rid: int, x: torch.Tensor) -> torch.Tensor:
        return op(rid, x)

    x = torch.zeros(2)
    assert f(id1, x).tolist() == [1.0, 1.0]
    assert f(id2, x).tolist() == [100.0, 100.0]
