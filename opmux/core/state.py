"""The one reset of opmux's process-wide state, for tests.

Every module that keeps global state (the registry's priorities and loaded flag, the
torch-wrap and output-check switches, the plugin manager, the platform cache, the runner
table, build-status caches, ...) registers a function that returns it to its state after
import with :func:`register_reset`; :func:`reset_for_tests` (re-exported by
:mod:`opmux.core.runtime`) calls them all. This module imports nothing of opmux, so any
module (core or backend) can register without an import cycle and core never imports a
backend to reset it.

The name tables in that state (layers by name, process groups, CustomOp classes) share one
rule, :func:`claim`: a name stays with the first object entered under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import TypeVar

__all__ = ["claim", "register_reset", "reset_for_tests"]

_V = TypeVar("_V")

_RESETS: dict[str, Callable[[], None]] = {}
_LOCK = threading.Lock()


def register_reset(fn: Callable[[], None], *, name: str | None = None) -> Callable[[], None]:
    """Register ``fn`` to run on :func:`reset_for_tests`; usable as a decorator.

    :param name: a stable key (default ``module.qualname`` of ``fn``): registering the
        same key again replaces the earlier function (module reloads stay harmless).
    """
    key = name or f"{fn.__module__}.{fn.__qualname__}"
    with _LOCK:
        _RESETS[key] = fn
    return fn


def reset_for_tests() -> None:
    """Return every piece of registered global state to its state after import.

    Resetters run in registration order; the first error is raised after all have run.
    """
    with _LOCK:
        resets = list(_RESETS.values())
    first: BaseException | None = None
    for fn in resets:
        try:
            fn()
        except Exception as exc:  # the others still reset; the failure is not lost
            first = first or exc
    if first is not None:
        raise first


def claim(table: MutableMapping[str, _V], name: str, value: _V) -> _V | None:
    """Enter ``value`` as ``table[name]`` unless another object holds ``name``.

    :returns: ``None`` when ``name`` is now ``value``'s (entered, or already its), else the
        other object that holds it (the table is unchanged; the caller raises its error).
    """
    holder = table.setdefault(name, value)
    return None if holder is value else holder
