"""Fixtures of the ``cpp`` provider tests: the kernels, built (or loaded from the cache) once."""

from __future__ import annotations

from typing import Any

import pytest

import opmux


@pytest.fixture(scope="session")
def cpp() -> Any:
    """The ``cpp`` provider module, its kernels built and the plugins loaded."""
    from opmux.plugins.cpu import build

    ok, message = build.build_status()
    assert ok, message
    opmux.load_plugins()
    from opmux.plugins.cpu import cpp_ops

    return cpp_ops
