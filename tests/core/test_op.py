"""Provider selection: priorities, predicates, keys, scoped overrides, the eager bypass."""

from __future__ import annotations

import random
import threading
import warnings
from collections.abc import Callable

import pytest
import torch

import opmux


@pytest.fixture
def add(registry: opmux.OpRegistry, ns: str) -> opmux.Op:
    @opmux.register_op(namespace=ns, registry=registry)
    def add_one(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @add_one.register_impl("p10", dispatch_key="CPU")
    def _p10(x: torch.Tensor) -> torch.Tensor:
        return x + 10

    @add_one.register_impl("p20", dispatch_key="CPU",
                           supports_args=lambda x: x.dtype == torch.float32)
    def _p20(x: torch.Tensor) -> torch.Tensor:
        return x + 20

    return add_one


def test_op_is_a_torch_op(add: opmux.Op, ns: str) -> None:
    assert add.name == "add_one" and add.namespace == ns
    assert add.torch_op is getattr(torch.ops, ns).add_one.default
    assert add.schema == "(Tensor x) -> Tensor"
    assert getattr(torch.ops, ns).add_one(torch.zeros(1)).item() in (10.0, 20.0)


def test_registration_order_is_the_default_priority(add: opmux.Op) -> None:
    assert add.priority() == ["p10", "p20", "native"]
    assert add.priority_source() == "registration order"
    assert add(torch.zeros(2)).tolist() == [10.0, 10.0]


def test_priority_order_decides(add: opmux.Op) -> None:
    add.set_default_priority(["p20", "p10"])
    assert add(torch.zeros(2)).tolist() == [20.0, 20.0]
    assert add.dispatch(torch.zeros(2)).provider == "p20"
    add.set_default_priority(["native"])
    assert add(torch.zeros(2)).tolist() == [1.0, 1.0]


def test_supports_args_rejection_falls_through(add: opmux.Op) -> None:
    add.set_default_priority(["p20"])
    x64 = torch.zeros(2, dtype=torch.float64)
    assert add(x64).tolist() == [1.0, 1.0]  # p20 rejects float64, p10 not listed → native
    assert add.dispatch(x64).provider == "native"
    add.set_default_priority(["p20", "p10"])
    assert add(x64).tolist() == [10.0, 10.0]


def test_scoped_priority_restores_even_after_an_exception(add: opmux.Op) -> None:
    add.set_default_priority(["p10"])
    with add.set_priority(["p20"]):
        assert add(torch.zeros(1)).item() == 20.0
        with add.set_priority(["native"]):
            assert add(torch.zeros(1)).item() == 1.0
        assert add(torch.zeros(1)).item() == 20.0
    assert add(torch.zeros(1)).item() == 10.0
    with pytest.raises(RuntimeError, match="boom"), add.set_priority(["p20"]):
        raise RuntimeError("boom")
    assert add(torch.zeros(1)).item() == 10.0


def test_cpu_provider_is_not_used_for_meta_tensors(add: opmux.Op) -> None:
    out = add(torch.zeros(3, device="meta"))
    assert out.device.type == "meta" and out.shape == (3,)
    assert add.dispatch(torch.zeros(3, device="meta")).provider == "native"


def test_unsupported_providers_are_dropped_when_the_priority_is_set(
        registry: opmux.OpRegistry, ns: str) -> None:
    @opmux.register_op(namespace=ns, registry=registry)
    def neg(x: torch.Tensor) -> torch.Tensor:
        return -x

    @neg.register_impl("absent", dispatch_key="CPU", supported=False, reason="no library")
    def _absent(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("an unsupported provider must never run")

    neg.set_default_priority(["absent", "native"])
    assert neg(torch.ones(1)).item() == -1.0
    assert neg.supported_providers() == ["native"]
    assert "unsupported (no library)" in neg.explain(torch.ones(1))


def test_explain_names_the_choice_and_every_skip(add: opmux.Op) -> None:
    add.set_default_priority(["p20", "p10"])
    text = add.explain(torch.zeros(1, dtype=torch.float64))
    assert "runs 'p10'" in text
    assert "supports_args rejected" in text
    meta = add.explain(torch.zeros(1, device="meta"))
    assert "serves dispatch key CPU, not Meta" in meta


def test_impls_and_opimpl_call(add: opmux.Op) -> None:
    impls = add.impls
    assert set(impls) == {"native", "p10", "p20"}
    assert impls["p10"].dispatch_key == "CPU" and impls["p10"].supported
    assert impls["p20"](torch.zeros(1)).item() == 20.0
    assert impls["native"].dispatch_key == "CompositeExplicitAutograd"


def test_eager_bypass_runs_the_same_selection(add: opmux.Op) -> None:
    add.set_default_priority(["p20", "p10"])
    with opmux.enable_torch_wrap(False):
        assert not opmux.torch_wrap_enabled()
        assert add(torch.zeros(1)).item() == 20.0
        assert add(torch.zeros(1, dtype=torch.float64)).item() == 10.0
        assert add(x=torch.zeros(1)).item() == 20.0
        assert add(torch.zeros(1, device="meta")).device.type == "meta"
    assert opmux.torch_wrap_enabled()


def test_sixteen_threads_dispatch_while_priorities_change(add: opmux.Op) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: set[float] = set()

    def dispatcher() -> None:
        x = torch.zeros(1)
        try:
            while not stop.is_set():
                seen.add(add(x).item())
        except BaseException as exc:  # reported below
            errors.append(exc)

    def changer() -> None:
        try:
            for i in range(300):
                if i % 3 == 0:
                    with add.set_priority(["p20"]):
                        pass
                else:
                    add.set_default_priority(["p10"] if i % 2 else ["p20", "p10"])
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    threads = [threading.Thread(target=dispatcher) for _ in range(16)]
    threads.append(threading.Thread(target=changer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert seen <= {10.0, 20.0} and seen  # never native (1.0), never anything else


@pytest.mark.parametrize("seed", range(20))
def test_overlapping_scopes_from_threads_unwind_in_any_exit_order(add: opmux.Op,
                                                                  seed: int) -> None:
    add.set_default_priority(["p20", "p10"])
    before = add.priority()
    n = 6
    entered = threading.Barrier(n)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    turn = threading.Condition()
    position = [0]
    errors: list[BaseException] = []

    def scope(i: int) -> None:
        try:
            with add.set_priority(["p10"] if i % 2 else ["native"]):
                entered.wait(timeout=30)  # every scope is open before any closes
                with turn:  # then close in the shuffled order
                    turn.wait_for(lambda: order[position[0]] == i, timeout=30)
            with turn:
                position[0] += 1
                turn.notify_all()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=scope, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert add.priority() == before
    assert add(torch.zeros(1)).item() == 20.0


def test_nested_scopes_closed_out_of_order_in_one_thread(add: opmux.Op) -> None:
    add.set_default_priority(["p10"])
    outer, inner = add.set_priority(["p20"]), add.set_priority(["native"])
    outer.__enter__()
    inner.__enter__()
    assert add(torch.zeros(1)).item() == 1.0
    outer.__exit__(None, None, None)  # the outer closes first: the newer scope still rules
    assert add(torch.zeros(1)).item() == 1.0
    inner.__exit__(None, None, None)
    assert add(torch.zeros(1)).item() == 10.0 and add.priority_source() == "code"


@pytest.mark.parametrize("wrap", [True, False])
def test_native_listed_first_wins(add: opmux.Op, wrap: bool) -> None:
    add.set_default_priority(["native", "p10"])
    with opmux.enable_torch_wrap(wrap):
        assert add(torch.zeros(1)).item() == 1.0
    assert add.dispatch(torch.zeros(1)).provider == "native"
    assert add.priority() == ["native", "p10"]
    assert "native comes first" in add.explain(torch.zeros(1))
    add.set_default_priority(["p10", "native", "p20"])
    assert add(torch.zeros(1)).item() == 10.0


@pytest.mark.parametrize("wrap", [True, False])
def test_a_raising_supports_args_declines(registry: opmux.OpRegistry, ns: str,
                                          wrap: bool) -> None:
    @opmux.register_op(namespace=ns, registry=registry)
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def fragile(x: torch.Tensor) -> bool:
        return bool(x.shape[1] == 4)  # IndexError on 1-D input

    @double.register_impl("fragile", dispatch_key="CPU", supports_args=fragile)
    def _fragile(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 100

    with opmux.enable_torch_wrap(wrap):
        assert double(torch.ones(2, 4))[0, 0].item() == 102.0
        with pytest.warns(RuntimeWarning, match=r"supports_args of provider 'fragile' raised "
                                                r"IndexError: .*counts as declining"):
            assert double(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]  # declined: native ran
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per (op, provider)
            assert double(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert double.dispatch(torch.ones(3)).provider == "native"
    text = double.explain(torch.ones(3))
    assert "runs 'native'" in text
    assert "supports_args raised IndexError" in text and "counts as declining" in text


@pytest.mark.parametrize("bad", ["p10", b"p10", 42])
def test_a_priority_is_a_list_not_a_string(add: opmux.Op, bad: object) -> None:
    with pytest.raises(opmux.RegistrationError, match="a priority is a list of provider names"):
        add.set_default_priority(bad)  # type: ignore[arg-type]
    with pytest.raises(opmux.RegistrationError, match=r"did you mean \['p10'\]"):
        add.set_default_priority("p10")
    with pytest.raises(opmux.RegistrationError), add.set_priority("p10"):
        pass
    assert add.priority() == ["p10", "p20", "native"]


class _SeenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op that reaches the torch dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_the_provider_without_the_dispatcher(add: opmux.Op, ns: str) -> None:
    assert opmux.torch_wrap_enabled()
    eager = add.eager
    assert add.eager is eager  # built once
    x = torch.zeros(2)
    with _SeenOps() as mode:
        assert eager(x).tolist() == [10.0, 10.0]
    assert mode.seen and f"{ns}.add_one.default" not in mode.seen  # only the provider's add
    with _SeenOps() as mode:
        assert add(x).tolist() == [10.0, 10.0]
    assert f"{ns}.add_one.default" in mode.seen  # the wrapped call goes through torch
    # the same selection as the wrapped call, priorities and predicates read per call
    with add.set_priority(["p20", "p10"]):
        assert eager(x).tolist() == [20.0, 20.0]
        assert eager(x.double()).tolist() == [10.0, 10.0]  # p20 declines float64
    add.set_default_priority(["native"])
    assert eager(x).tolist() == [1.0, 1.0]
    assert eager(x=x).tolist() == [1.0, 1.0]


def test_eager_is_one_node_under_compile(add: opmux.Op, ns: str) -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    for built in (False, True):  # first traced before the eager caller exists, then after
        if built:
            assert add.eager(torch.zeros(1)).tolist() == [10.0]
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: add.eager(t) * 2, backend=backend, fullgraph=True)
        assert compiled(torch.zeros(2)).tolist() == [20.0, 20.0]
        targets = [str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"]
        assert f"{ns}.add_one.default" in targets
    assert len(graphs) == 2


@pytest.mark.parametrize("wrap", [True, False])
def test_the_kernel_and_dispatch_choose_alike(registry: opmux.OpRegistry, ns: str,
                                              wrap: bool) -> None:
    @opmux.register_op(namespace=ns, registry=registry)
    def tag(x: torch.Tensor) -> torch.Tensor:
        return x * 0

    preds = {"wide": lambda x: x.shape[-1] > 4, "f64": lambda x: x.dtype == torch.float64,
             "any": None, "odd": lambda x: x.numel() % 2 == 1}
    def filler(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
        def impl(x: torch.Tensor) -> torch.Tensor:
            return torch.full_like(x, value)

        return impl

    for i, (name, pred) in enumerate(preds.items(), start=1):
        tag.register_impl(name, dispatch_key="CPU", supports_args=pred)(filler(float(i)))
    names = list(preds)
    inputs = [torch.zeros(2, 3), torch.zeros(2, 8), torch.zeros(3, dtype=torch.float64),
              torch.zeros(1, 3)]
    for order in (["wide", "f64", "odd", "any"], ["odd", "wide"], ["f64"], ["any", "wide"]):
        tag.set_default_priority([*order, "native"])
        with opmux.enable_torch_wrap(wrap):
            for x in inputs:
                ran = int(tag(x).flatten()[0].item()) if x.numel() else 0
                chosen = tag.dispatch(x).provider
                assert chosen == (names[ran - 1] if ran else "native"), (order, x.shape)
