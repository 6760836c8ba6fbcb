"""Fixtures of the core tests: fake plugin distributions and an op to serve."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fake_plugins import FakePlugins

import opmux


@pytest.fixture
def fake(fresh_plugins: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePlugins]:
    """Fresh global state; the installed plugins are replaced by the ones a test adds."""
    yield FakePlugins(monkeypatch)


@pytest.fixture
def reg_op(registry: opmux.OpRegistry, ns: str) -> opmux.Op:
    @opmux.register_op(namespace=ns, registry=registry)
    def inc(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    return inc
