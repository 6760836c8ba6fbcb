"""Process-wide switches that change how every op's calls are wired.

Both switches rebuild what the dispatch hot path reads when they change, so the hot path
never tests them per call: ``enable_torch_wrap`` swaps each op's call target,
``enable_output_checks`` swaps each chain's functions for checked ones. Their values are
fields of the runtime object (:class:`opmux.core.state.Runtime`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from opmux.core import config
from opmux.core.state import runtime

if TYPE_CHECKING:
    from opmux.core.op import Op

__all__ = ["enable_output_checks", "enable_torch_wrap", "output_checks_enabled",
           "rewire_ops", "set_output_checks", "torch_wrap_enabled", "track"]

#: guards rewiring the live ops (they outlive the runtime object, see ``_ALL_OPS``)
_LOCK = threading.RLock()
#: every live op, so that a switch can rewire it; a module global because ops outlive the
#: runtime object (the catalog's are defined in torch for the life of the process)
_ALL_OPS: weakref.WeakSet[Op] = weakref.WeakSet()


def track(op: Op) -> None:
    """Called by every new op so the switches can rewire it."""
    _ALL_OPS.add(op)


def torch_wrap_enabled() -> bool:
    """Whether op calls go through the torch dispatcher (the default)."""
    return runtime().torch_wrap


@contextlib.contextmanager
def enable_torch_wrap(enabled: bool = True) -> Iterator[None]:
    """Route op calls through the torch dispatcher (``True``) or bypass it (``False``).

    With the wrap off, calling an op maps the device type of its first tensor argument
    to a dispatch key and runs the same provider selection in Python: a plain call of
    the chosen provider. Under ``torch.compile`` the dispatcher is always used. The
    switch is process-wide; the previous value is restored on exit.
    """
    with _LOCK:
        previous = runtime().torch_wrap
        _set_wrap(bool(enabled))
    try:
        yield
    finally:
        with _LOCK:
            _set_wrap(previous)


def _set_wrap(enabled: bool) -> None:
    runtime().torch_wrap = enabled
    for op in list(_ALL_OPS):
        op.set_wrap(enabled)


def output_checks_enabled() -> bool:
    """Whether provider outputs are checked (``OPMUX_CHECK_OUTPUTS`` or code)."""
    rt = runtime()
    value = rt.output_checks
    if value is None:
        with _LOCK:
            if rt.output_checks is None:
                rt.output_checks = config.check_outputs()
            value = rt.output_checks
    return bool(value)


def set_output_checks(enabled: bool | None) -> None:
    """Turn provider output checks on or off for every op (``None``: back to the env).

    When on, every provider call (not native's) is checked against the op's fake:
    outputs must have the fake's structure, dtype, shape and device, and no input
    outside ``mutates_args`` may change; a violation raises
    :class:`~opmux.ProviderOutputError` naming op and provider. The chains are rebuilt
    now, so the hot path costs nothing while the checks are off.
    """
    with _LOCK:
        runtime().output_checks = None if enabled is None else bool(enabled)
        for op in list(_ALL_OPS):
            op.priorities.rebuild()


@contextlib.contextmanager
def enable_output_checks(enabled: bool = True) -> Iterator[None]:
    """Scoped :func:`set_output_checks`; the previous setting returns on exit."""
    with _LOCK:
        previous = runtime().output_checks
        set_output_checks(enabled)
    try:
        yield
    finally:
        with _LOCK:
            runtime().output_checks = previous
            for op in list(_ALL_OPS):
                op.priorities.rebuild()


def rewire_ops() -> None:
    """Give every live op the wiring of the current switch values (after the runtime
    object is replaced)."""
    with _LOCK:
        _set_wrap(runtime().torch_wrap)
        for op in list(_ALL_OPS):
            op.priorities.rebuild()
