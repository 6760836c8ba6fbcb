"""Fixtures of the layer tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import opmux


@pytest.fixture
def plugins_no_grad(fresh_custom_ops: None) -> Iterator[None]:
    """Fresh CustomOp settings, the plugins loaded (so platform paths reach their providers),
    autograd off."""
    opmux.load_plugins()
    with torch.no_grad():
        yield
