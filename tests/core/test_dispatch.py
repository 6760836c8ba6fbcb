"""The per-key selection closures (opmux.core.dispatch) and the plugins' predicates."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import opmux
from opmux.core import dispatch


def _op(registry: opmux.OpRegistry, ns: str) -> opmux.Op:
    @opmux.register_op(namespace=ns, registry=registry)
    def scale(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
        return x * k

    def picky(x: torch.Tensor, k: float = 2.0) -> bool:
        return x.dtype == torch.float64

    @scale.register_impl("wide", dispatch_key="CPU", supports_args=picky)
    def wide(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
        return x * k + 100

    return scale


def test_plain_code_and_nothing_on_disk(registry: opmux.OpRegistry, ns: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # the selection functions are closures of opmux.core.dispatch: no generated source, no
    # code kept on disk
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(tmp_path))
    op = _op(registry, ns)
    assert op(torch.ones(2)).tolist() == [2.0, 2.0]
    assert op(torch.ones(2, dtype=torch.float64)).tolist() == [102.0, 102.0]
    with opmux.enable_torch_wrap(False):
        assert op(torch.ones(2, dtype=torch.float64), k=3.0).tolist() == [103.0, 103.0]
        assert op(torch.ones(2), 3.0).tolist() == [3.0, 3.0]
    assert inspect.getsourcefile(op.eager) == inspect.getsourcefile(dispatch)
    assert list(tmp_path.iterdir()) == []


def _ident(registry: opmux.OpRegistry, ns: str) -> opmux.Op:
    @opmux.register_op(namespace=ns, registry=registry)
    def ident(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    return ident


def _boom(x: torch.Tensor) -> bool:
    raise RuntimeError("no")


def _adder(add: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def impl(x: torch.Tensor) -> torch.Tensor:
        return x + add
    return impl


def test_a_raising_predicate_declines(registry: opmux.OpRegistry, ns: str) -> None:
    ident = _ident(registry, ns)

    @ident.register_impl("first", dispatch_key="CPU", supports_args=_boom)
    def first(x: torch.Tensor) -> torch.Tensor:
        return x + 10

    @ident.register_impl("second", dispatch_key="CPU")
    def second(x: torch.Tensor) -> torch.Tensor:
        return x + 20

    with pytest.warns(RuntimeWarning, match="provider 'first' raised RuntimeError: no"):
        for wrap in (True, False):
            with opmux.enable_torch_wrap(wrap):
                assert ident(torch.zeros(1)).item() == 20.0
    ident.unregister_impl("second")
    for wrap in (True, False):
        with opmux.enable_torch_wrap(wrap):
            assert ident(torch.zeros(1)).item() == 0.0  # first declines, native runs
    assert "supports_args raised RuntimeError: no" in ident.explain(torch.zeros(1))


def test_start_up_runs_before_the_first_selection(ns: str) -> None:
    starts: list[int] = []
    registry = opmux.OpRegistry(loader=lambda reg: starts.append(1))
    try:
        op = _op(registry, ns)
        assert op(torch.ones(2)).tolist() == [2.0, 2.0] and starts == [1]
        assert op(torch.ones(2)).tolist() == [2.0, 2.0] and starts == [1]
        registry.unload()  # a reset: the next call runs start-up again
        with opmux.enable_torch_wrap(False):
            assert op(torch.ones(2, dtype=torch.float64)).tolist() == [102.0, 102.0]
        assert starts == [1, 1]
    finally:
        registry.destroy()


def test_only_is_set_exactly_when_there_is_nothing_to_walk(registry: opmux.OpRegistry,
                                                            ns: str) -> None:
    # the kernels' one-read path: a provider without a predicate first and no size buckets
    ident = _ident(registry, ns)
    ident.register_impl("picky", dispatch_key="CPU", supports_args=_boom)(_adder(10))
    ident.register_impl("plain", dispatch_key="CPU")(_adder(20))
    holder = ident.priorities.chains["CPU"]
    assert holder.only is None and holder.sel[0]  # picky first: its predicate is walked
    ident.priorities.set_tuned(["plain"], [["plain"]] * dispatch.SIZE_BUCKETS)
    assert holder.only is None and holder.sized is not None  # a bucket is picked per call
    ident.priorities.set_tuned(None, None)
    assert holder.only is None and holder.sized is None
    ident.set_default_priority(["plain", "picky"])
    assert holder.only is holder.sel[1] and not holder.sel[0]
    for wrap in (True, False):
        with opmux.enable_torch_wrap(wrap):
            assert ident(torch.zeros(1)).item() == 20.0
    ident.set_default_priority(["native"])
    assert holder.only is holder.native
    for wrap in (True, False):
        with opmux.enable_torch_wrap(wrap):
            assert ident(torch.zeros(1)).item() == 0.0


def test_size_buckets(registry: opmux.OpRegistry, ns: str) -> None:
    # a tuned table's buckets: each bucket walks its own order; a predicate that raises
    # declines; both the kernel and the wrap-off path
    ident = _ident(registry, ns)

    def small(x: torch.Tensor) -> bool:
        return x.numel() < 3

    for name, pred, add in (("a", _boom, 10), ("b", None, 20), ("c", small, 30), ("d", small, 40)):
        ident.register_impl(name, dispatch_key="CPU", supports_args=pred)(_adder(add))
    per_bucket = [["b"]] * dispatch.SIZE_BUCKETS
    per_bucket[dispatch.bucket_of(1)] = ["a", "b"]  # boom declines, b takes it
    per_bucket[dispatch.bucket_of(2)] = ["c", "d"]  # c, then d (same predicate), native
    per_bucket[dispatch.bucket_of(4)] = ["c", "d"]
    ident.priorities.set_tuned(["b"], per_bucket)
    holder = ident.priorities.chains["CPU"]
    assert holder.sized is not None and len(holder.sized) == dispatch.SIZE_BUCKETS
    want = {1: 20.0, 2: 30.0, 4: 0.0, 8: 20.0}
    with pytest.warns(RuntimeWarning, match="provider 'a' raised"):
        ident(torch.zeros(1))
    for wrap in (True, False):
        with opmux.enable_torch_wrap(wrap):
            for n, value in want.items():
                assert ident(torch.zeros(n))[0].item() == value, (wrap, n)
                assert ident.dispatch(torch.zeros(n)).provider == \
                    {20.0: "b", 30.0: "c", 0.0: "native"}[value]


def test_predicates_carry_the_impl_signature() -> None:
    from opmux.plugins.registration import predicate

    def impl(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
        return x

    one = predicate(impl, lambda x: x.dim() == 1)
    other = predicate(impl, lambda k: k > 1)
    assert one.__name__ == "_impl_supports"
    assert list(inspect.signature(one).parameters) == ["x", "k"]
    assert inspect.signature(one).parameters["k"].default == 2.0
    assert one(torch.ones(2), 2.0) and not one(torch.ones(1, 1), 2.0)
    assert one(torch.ones(2)) and one(x=torch.ones(2)) and not one(torch.ones(1, 1), k=5.0)
    assert other(torch.ones(2)) and not other(torch.ones(2), 0.5) and other(torch.ones(2), k=3)
    with pytest.raises(TypeError):
        one(torch.ones(2), 2.0, 3.0)


def test_predicate_refuses_names_the_impl_lacks() -> None:
    from opmux.plugins.registration import predicate

    def impl(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(opmux.SignatureMismatchError, match=r"reads \['y'\]"):
        predicate(impl, lambda y: True)


def test_first_choice_is_the_provider_every_call_tries_first(registry: opmux.OpRegistry,
                                                             ns: str) -> None:
    op = _op(registry, ns)
    first = op.first_choice("CPU")
    assert first is not None and first.provider == "wide"  # its predicate decides each call
    assert op.first_choice("XLA") is None  # no provider of that key
    with op.set_priority(["native", "wide"]):
        assert op.first_choice("CPU") is None
    op.priorities.set_tuned(["wide"], [["wide"]] * dispatch.SIZE_BUCKETS)
    assert op.first_choice("CPU") is None  # an order per size bucket
    op.priorities.set_tuned(None, None)
    with opmux.enable_output_checks():
        assert op.first_choice("CPU") is None  # the provider runs wrapped
    assert op.first_choice("CPU") is first
