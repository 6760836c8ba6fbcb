"""Shared fixtures.

Test isolation: every test that defines ops gets its own :class:`opmux.OpRegistry`
(``registry``) and a namespace no other test uses (``ns``); the registry's torch
libraries are destroyed afterwards, so tests never depend on order. Tests that touch
process-wide state (plugins, platform, priorities of the global registry, switches,
runners, ...) use ``fresh_plugins``, which calls the one reset,
:func:`opmux.testing.reset_for_tests`, before and after the test.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Iterator

import pytest

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
            import torch

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
