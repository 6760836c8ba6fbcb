"""The doctests of opmux.models run."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", ["opmux.models", "opmux.core.tally",
                                    "opmux.models.memory"])
def test_doctests(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_reachable_as_opmux_models() -> None:
    import opmux
    from opmux.models import load_model

    assert opmux.models.load_model is load_model
