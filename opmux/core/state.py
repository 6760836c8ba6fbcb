"""The runtime object: the one owner of opmux's process state, and its reset for tests.

:class:`Runtime` holds the process-wide registry and one *part* per kind of state, each a
small class defined beside the code that uses it: the plugin records and manager
(:class:`opmux.core.plugins.PluginState`), the platform (``opmux.platforms``), the
switches (:class:`opmux.core.switches.Switches`), the tuned-table status
(:mod:`opmux.core.tuned`) and the CustomOp settings (:mod:`opmux.layers.custom_op`).
A part is built on first use from its class, so floors above core keep their state here
without core importing them. :func:`reset_for_tests` replaces the runtime object (the
registry carries over: torch cannot undefine an op) after running the undo hooks that
put back what outlives it (providers plugins added to ops, each op's priorities and
wiring, caches of derived data), registered with :func:`register_reset`.

The name tables of that state (layers by name, process groups, CustomOp classes) share
one rule, :func:`claim`: a name stays with the first object entered under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from opmux.core.registry import OpRegistry

__all__ = ["Runtime", "claim", "register_reset", "reset_for_tests", "runtime"]

_V = TypeVar("_V")
_P = TypeVar("_P")


class Runtime:
    """The process state of opmux (see the module docstring)."""

    def __init__(self, registry: OpRegistry | None = None) -> None:
        self._registry = registry
        self._parts: dict[type[Any], Any] = {}
        self._lock = threading.Lock()

    @property
    def registry(self) -> OpRegistry:
        """The process-wide registry (installed by :mod:`opmux._runtime` at import)."""
        registry = self._registry
        if registry is None:
            raise RuntimeError("opmux's process-wide registry is not installed; import opmux "
                               "(its package import installs it)")
        return registry

    def install(self, registry: OpRegistry) -> None:
        """Install the process-wide registry (once, by :mod:`opmux._runtime`)."""
        self._registry = registry

    def part(self, cls: type[_P]) -> _P:
        """The part of class ``cls``, built with ``cls()`` on first use."""
        try:
            part: _P = self._parts[cls]
        except KeyError:
            with self._lock:
                part = self._parts.setdefault(cls, cls())
        return part

    def reset_part(self, cls: type[Any]) -> None:
        """Drop the part of class ``cls``: the next :meth:`part` builds a fresh one."""
        with self._lock:
            self._parts.pop(cls, None)


#: The runtime object; a one-element list so that a reset swaps it for every reader.
_CURRENT: list[Runtime] = [Runtime()]
_RESETS: dict[str, Callable[[], None]] = {}
_LOCK = threading.Lock()


def runtime() -> Runtime:
    """This process's runtime object."""
    return _CURRENT[0]


def register_reset(fn: Callable[[], None], *, name: str | None = None) -> Callable[[], None]:
    """Register an undo hook run by :func:`reset_for_tests`; usable as a decorator.

    For what outlives the runtime object: registrations on ops, caches of derived data,
    handles. State of its own belongs in a part (:meth:`Runtime.part`).

    :param name: a stable key (default ``module.qualname`` of ``fn``): registering the
        same key again replaces the earlier function (module reloads stay harmless).
    """
    key = name or f"{fn.__module__}.{fn.__qualname__}"
    with _LOCK:
        _RESETS[key] = fn
    return fn


def reset_for_tests() -> None:
    """Run the undo hooks (in registration order), then replace the runtime object.

    The first error of a hook is raised after all have run and the object is replaced.
    """
    with _LOCK:
        resets = list(_RESETS.values())
    first: BaseException | None = None
    for fn in resets:
        try:
            fn()
        except Exception as exc:  # the others still reset; the failure is not lost
            first = first or exc
    _CURRENT[0] = Runtime(_CURRENT[0]._registry)
    if first is not None:
        raise first


def claim(table: MutableMapping[str, _V], name: str, value: _V) -> _V | None:
    """Enter ``value`` as ``table[name]`` unless another object holds ``name``.

    :returns: ``None`` when ``name`` is now ``value``'s (entered, or already its), else the
        other object that holds it (the table is unchanged; the caller raises its error).
    """
    holder = table.setdefault(name, value)
    return None if holder is value else holder
