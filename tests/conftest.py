"""Shared fixtures.

Test isolation: every test that defines ops gets its own :class:`opmux.OpRegistry`
(``registry``) and a namespace no other test uses (``ns``); the registry's torch
libraries are destroyed afterwards, so tests never depend on order. Tests that touch
process-wide state (plugins, platform, priorities of the global registry, switches,
runners, ...) use ``fresh_plugins``, which calls the one reset,
:func:`opmux.testing.reset_for_tests`, before and after the test. ``op_calls`` shows which
catalog ops a layer or model calls, and with what, through the ops' public priorities;
``onednn_calls`` counts the oneDNN matmuls a call makes (``opmux.layers.dense_linear``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

import opmux
import opmux.distributed as od
from opmux.testing import reset_for_tests

_counter = itertools.count()

#: marker → module that must be importable for tests carrying it
_MARKER_NEEDS = {"triton": "triton", "xla": "torch_xla", "mindspore": "mindspore", "vllm": "vllm"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Lanes select their tests with -m; a developer running plain `pytest` in an
    # environment without a stack sees those tests skipped with the reason.
    for item in items:
        for marker, module in _MARKER_NEEDS.items():
            if item.get_closest_marker(marker) and importlib.util.find_spec(module) is None:
                item.add_marker(pytest.mark.skip(reason=f"needs {module} (lane {marker})"))
        if item.get_closest_marker("cuda"):
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def ns() -> str:
    """A torch namespace unique to this test."""
    return f"opmux_t{os.getpid()}_{next(_counter)}"


@pytest.fixture
def registry() -> Iterator[opmux.OpRegistry]:
    """A fresh registry with no plugin loader; its libraries are destroyed afterwards."""
    reg = opmux.OpRegistry()
    yield reg
    reg.destroy()


@pytest.fixture
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every piece of global state reset before the test and again after it (the global
    registry starts up anew on its next use), with no ``OPMUX_*`` start-up variable set."""
    for var in ("OPMUX_PLUGINS", "OPMUX_STRICT_PLUGINS", "OPMUX_PRIORITY", "OPMUX_PLATFORM",
                "OPMUX_CHECK_OUTPUTS"):
        monkeypatch.delenv(var, raising=False)
    # a table `opmux tune` wrote on this machine must not change what the tests expect
    monkeypatch.setenv("OPMUX_TUNED", "0")
    reset_for_tests()
    yield
    monkeypatch.undo()  # the reset after the test sees the real environment
    reset_for_tests()


@pytest.fixture
def fresh_custom_ops() -> Iterator[None]:
    """Reset CustomOp enablement, counts and out-of-tree replacements around a test."""
    reset_for_tests()
    yield
    reset_for_tests()


@pytest.fixture
def fresh_distributed() -> Iterator[None]:
    """No tensor-parallel group or registered process group around a test (TP=1)."""
    od.destroy_tensor_parallel()
    yield
    od.destroy_tensor_parallel()


#: the provider name of the watcher ``op_calls`` puts first in an op's priority
WATCHER = "test_watcher"


@pytest.fixture
def op_calls() -> Iterator[Callable[[str], list[dict[str, Any]]]]:
    """``op_calls("rms_norm")``: a list that from then to the end of the test receives the
    arguments of every call of that op (``{parameter: value}``, defaults filled in).

    A watching provider goes first in the op's priority: its ``supports_args`` records the
    call and declines, so the provider that serves the call otherwise still runs it (the
    arguments are the caller's own objects). Calls through ``Op.eager``, the op itself and
    the torch op are all seen.
    """
    with contextlib.ExitStack() as stack:

        def watch(name: str) -> list[dict[str, Any]]:
            opmux.load_plugins()  # the priority the watcher goes in front of
            op = opmux.get_op(name)
            signature = op.signature
            calls: list[dict[str, Any]] = []

            def record(*args: Any, **kwargs: Any) -> bool:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                calls.append(dict(bound.arguments))
                return False

            def unreachable(*args: Any, **kwargs: Any) -> Any:
                raise AssertionError(f"the watcher of {name} declines every call")

            for fn in (record, unreachable):  # native's signature (the op checks it)
                functools.update_wrapper(fn, op.native)
            op.register_impl(WATCHER, supports_args=record)(unreachable)
            stack.callback(op.unregister_impl, WATCHER)
            stack.enter_context(op.set_priority([WATCHER, *op.priority()]))
            return calls

        yield watch


T = TypeVar("T")

ONEDNN_MATMUL = "mkldnn::_linear_pointwise"
"""The profiler's name of oneDNN's matmul op (torch reaches oneDNN's matmul through it)."""


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch runs on two threads during the test (oneDNN's matmul needs more than one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def has_onednn_matmul() -> bool:
    """Whether this torch build has oneDNN's matmul op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@pytest.fixture
def onednn_calls() -> Callable[[Callable[[], T]], tuple[T, int]]:
    """``onednn_calls(fn)``: ``fn()`` and how many oneDNN matmuls it ran (the profiler's
    events); the test is skipped where this torch build has no oneDNN matmul."""
    if not has_onednn_matmul():
        pytest.skip("this torch build has no oneDNN matmul op")

    def count(fn: Callable[[], T]) -> tuple[T, int]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = fn()
        return result, sum(e.count for e in prof.key_averages() if e.key == ONEDNN_MATMUL)

    return count
