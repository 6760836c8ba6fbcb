"""Fixtures of the MindSpore extension tests (mindspore lane).

The extension is built once per cache key (first run ~1-3 min on two cores, then it loads in
milliseconds from ``$OPMUX_CACHE_DIR/ascend``); MindSpore is imported only inside fixtures, so
collecting these files without MindSpore installed works (the tests are then skipped).
"""

from __future__ import annotations

from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def ms() -> ModuleType:
    """MindSpore on its CPU backend, in PyNative mode."""
    mindspore = pytest.importorskip("mindspore")
    mindspore.set_device("CPU")
    mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    return mindspore


@pytest.fixture(scope="session")
def extension(ms: ModuleType) -> ModuleType:
    """The built and imported ``_C_ops`` extension (fails the test with the build log)."""
    from opmux.plugins.ascend import build

    ok, message = build.build_status()
    assert ok, message
    return build.load()
