"""The generated selection functions and their on-disk code cache."""

from __future__ import annotations

import marshal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import opmux
from opmux.core import _chooser


@pytest.fixture
def empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_chooser, "_CODE", {})
    monkeypatch.setattr(_chooser, "_DISK", [False])
    return tmp_path


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


def test_variants_are_written_and_read_back(empty_cache: Path, registry: opmux.OpRegistry,
                                            ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    op = _op(registry, ns)
    assert op(torch.ones(2)).tolist() == [2.0, 2.0]
    assert op(torch.ones(2, dtype=torch.float64)).tolist() == [102.0, 102.0]
    assert op._eager is None  # the wrap-off path is built when the wrap is first turned off
    with opmux.enable_torch_wrap(False):
        assert op(torch.ones(2, dtype=torch.float64)).tolist() == [102.0, 102.0]
    assert op._eager is not None
    path = _chooser._disk_path()
    assert path.parent.parent == empty_cache
    stored = marshal.loads(path.read_bytes())
    assert {"eager", "kernel/a0, a1"} <= set(stored)
    monkeypatch.setattr(_chooser, "_CODE", {})
    monkeypatch.setattr(_chooser, "_DISK", [False])
    _chooser._read_disk()
    assert set(_chooser._CODE) == set(stored)


@pytest.mark.parametrize("content", [b"not marshal", marshal.dumps({"eager": 1, 2: "x"})])
def test_a_damaged_copy_is_ignored_and_replaced(empty_cache: Path, registry: opmux.OpRegistry,
                                                ns: str, content: bytes) -> None:
    path = _chooser._disk_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    op = _op(registry, ns)
    assert op(torch.ones(2, dtype=torch.float64), 3.0).tolist() == [103.0, 103.0]
    with opmux.enable_torch_wrap(False):
        assert op(torch.ones(2), k=3.0).tolist() == [3.0, 3.0]
    assert "eager" in marshal.loads(path.read_bytes())


def test_a_raising_predicate_declines_through_the_guard(registry: opmux.OpRegistry,
                                                        ns: str) -> None:
    @opmux.register_op(namespace=ns, registry=registry)
    def ident(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def boom(x: torch.Tensor) -> bool:
        raise RuntimeError("no")

    @ident.register_impl("first", dispatch_key="CPU", supports_args=boom)
    def first(x: torch.Tensor) -> torch.Tensor:
        return x + 10

    @ident.register_impl("second", dispatch_key="CPU")
    def second(x: torch.Tensor) -> torch.Tensor:
        return x + 20

    holder = ident._chains["CPU"]
    assert holder.guard is not None and holder.direct is None
    assert ident(torch.zeros(1)).item() == 20.0
    ident.unregister_impl("second")
    assert holder.guard is not None  # first, else native
    assert ident(torch.zeros(1)).item() == 0.0


def test_kernels_take_the_body_of_their_shortcut_once_loaded(ns: str) -> None:
    starts: list[int] = []
    registry = opmux.OpRegistry(loader=lambda reg: starts.append(1))
    try:
        op = _op(registry, ns)  # "wide" has a predicate, then native: the one-test shortcut
        holder = op._chains["CPU"]
        assert holder.kernel is not None and holder.bodies is not None
        general, direct, guard, _ = holder.bodies
        assert holder.kernel.__code__ is general  # not loaded: the start-up test comes first
        assert op(torch.ones(2)).tolist() == [2.0, 2.0] and starts == [1]
        assert holder.kernel.__code__ is guard
        assert op(torch.ones(2, dtype=torch.float64)).tolist() == [102.0, 102.0]

        @op.register_impl("plain", dispatch_key="CPU")
        def plain(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
            return x * k + 1

        op.set_default_priority(["plain", "wide"])
        assert holder.kernel.__code__ is direct
        assert op(torch.ones(2)).tolist() == [3.0, 3.0]
        registry._set_loaded(False)  # a reset: the next call must run start-up again
        assert holder.kernel.__code__ is general
        assert op(torch.ones(2)).tolist() == [3.0, 3.0] and starts == [1, 1]
        assert holder.kernel.__code__ is direct
    finally:
        registry._reset_for_tests()


def test_a_walk_keeps_the_general_body_and_stale_bodies_stay_correct(
        registry: opmux.OpRegistry, ns: str) -> None:
    op = _op(registry, ns)

    def small(x: torch.Tensor, k: float = 2.0) -> bool:
        return x.numel() < 3

    @op.register_impl("narrow", dispatch_key="CPU", supports_args=small)
    def narrow(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
        return x * k + 200

    op.set_default_priority(["wide", "narrow"])  # two predicates, then native: the walk
    holder = op._chains["CPU"]
    assert holder.kernel is not None and holder.bodies is not None
    general = holder.bodies[0]
    assert holder.direct is None and holder.guard is None
    assert holder.kernel.__code__ is general
    want = {(2, torch.float64): 102.0, (2, torch.float32): 202.0, (4, torch.float32): 2.0}
    # a body that no longer matches the selection (a reader racing a change of priorities)
    # takes the full walk: slower for that call, never wrong
    for body in holder.bodies:
        holder.kernel.__code__ = body
        for (n, dtype), value in want.items():
            assert op(torch.ones(n, dtype=dtype))[0].item() == value, (body, n, dtype)


def test_size_buckets_take_the_same_shortcuts(registry: opmux.OpRegistry, ns: str) -> None:
    # a tuned table's buckets: a provider that takes every call is called directly, a
    # predicate followed by one that takes every call is one test (raising declines), and a
    # longer chain is walked; both the kernel and the wrap-off path
    @opmux.register_op(namespace=ns, registry=registry)
    def ident(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def boom(x: torch.Tensor) -> bool:
        raise RuntimeError("no")

    def small(x: torch.Tensor) -> bool:
        return x.numel() < 3

    def adder(add: float) -> Callable[[torch.Tensor], torch.Tensor]:
        def impl(x: torch.Tensor) -> torch.Tensor:
            return x + add
        return impl

    for name, pred, add in (("a", boom, 10), ("b", None, 20), ("c", small, 30), ("d", small, 40)):
        ident.register_impl(name, dispatch_key="CPU", supports_args=pred)(adder(add))
    per_bucket = [["b"]] * _chooser.SIZE_BUCKETS
    per_bucket[_chooser.bucket_of(1)] = ["a", "b"]  # guard: boom declines, b takes it
    per_bucket[_chooser.bucket_of(2)] = ["c", "d"]  # walk: c, then d (same predicate), native
    per_bucket[_chooser.bucket_of(4)] = ["c", "d"]
    ident._set_tuned(["b"], per_bucket)
    holder = ident._chains["CPU"]
    assert holder.pairs is None and holder.sized is not None
    assert holder.sized[_chooser.bucket_of(1)][3] is None  # a one-test selector
    assert holder.sized[_chooser.bucket_of(8)][0] is None  # a direct one
    assert holder.sized[_chooser.bucket_of(2)][3] is not None  # the walk
    assert holder.kernel is not None and holder.bodies is not None
    assert holder.kernel.__code__ is holder.bodies[3]  # the kernel's sized body
    want = {1: 20.0, 2: 30.0, 4: 0.0, 8: 20.0}
    for wrap in (True, False):
        with opmux.enable_torch_wrap(wrap):
            for n, value in want.items():
                assert ident(torch.zeros(n))[0].item() == value, (wrap, n)


def test_predicates_are_compiled_once_and_kept_on_disk(empty_cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from opmux.plugins._registration import predicate

    def impl(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
        return x

    first = predicate(impl, lambda x: x.dim() == 1)
    assert marshal.loads(_chooser._disk_path().read_bytes()).keys() == {"predicate/x,k/x"}
    # a later process reads the code back: no compile, and each predicate keeps its own check
    monkeypatch.setattr(_chooser, "_CODE", {})
    monkeypatch.setattr(_chooser, "_DISK", [False])
    compiles: list[str] = []
    real_compile = compile

    def counting(source: str, filename: str, mode: str) -> object:
        compiles.append(filename)
        return real_compile(source, filename, mode)

    monkeypatch.setattr("builtins.compile", counting)
    second = predicate(impl, lambda x: x.dim() == 2)
    assert compiles == []
    assert first(torch.ones(2)) and not second(torch.ones(2)) and second(torch.ones(1, 1))
    assert second.__defaults__ == (2.0,) and second.__name__ == "_impl_supports"
