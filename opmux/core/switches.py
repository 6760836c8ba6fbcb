"""Process-wide switches that change how every op's calls are wired.

Both switches rebuild what the dispatch hot path reads when they change, so the hot path
never tests them per call: ``enable_torch_wrap`` swaps each op's ``__call__``,
``enable_output_checks`` swaps each chain's functions for checked ones.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from opmux.core import config
from opmux.core.state import register_reset

if TYPE_CHECKING:
    from opmux.core.op import Op

__all__ = ["enable_output_checks", "enable_torch_wrap", "output_checks_enabled",
           "set_output_checks", "torch_wrap_enabled"]

#: The torch-wrap switch; a one-element list so the hot path reads it without a lookup
#: of a module global that a ``global`` statement rebinds.
_WRAP: list[bool] = [True]
#: Output checks; ``None`` until first read, then the ``OPMUX_CHECK_OUTPUTS`` value or
#: what :func:`set_output_checks` said.
_CHECK: list[bool | None] = [None]
_LOCK = threading.RLock()
_ALL_OPS: weakref.WeakSet[Op] = weakref.WeakSet()


def _track(op: Op) -> None:
    """Called by every new op so the switches can rewire it."""
    _ALL_OPS.add(op)


def torch_wrap_enabled() -> bool:
    """Whether op calls go through the torch dispatcher (the default)."""
    return _WRAP[0]


@contextlib.contextmanager
def enable_torch_wrap(enabled: bool = True) -> Iterator[None]:
    """Route op calls through the torch dispatcher (``True``) or bypass it (``False``).

    With the wrap off, calling an op maps the device type of its first tensor argument
    to a dispatch key and runs the same provider selection in Python: a plain call of
    the chosen provider. Under ``torch.compile`` the dispatcher is always used. The
    switch is process-wide; the previous value is restored on exit.
    """
    with _LOCK:
        previous = _WRAP[0]
        _set_wrap(bool(enabled))
    try:
        yield
    finally:
        with _LOCK:
            _set_wrap(previous)


def _set_wrap(enabled: bool) -> None:
    _WRAP[0] = enabled
    for op in list(_ALL_OPS):
        op._install_call(enabled)


def output_checks_enabled() -> bool:
    """Whether provider outputs are checked (``OPMUX_CHECK_OUTPUTS`` or code)."""
    value = _CHECK[0]
    if value is None:
        with _LOCK:
            if _CHECK[0] is None:
                _CHECK[0] = config.check_outputs()
            value = _CHECK[0]
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
        _CHECK[0] = None if enabled is None else bool(enabled)
        for op in list(_ALL_OPS):
            op._rebuild_chains()


@contextlib.contextmanager
def enable_output_checks(enabled: bool = True) -> Iterator[None]:
    """Scoped :func:`set_output_checks`; the previous setting returns on exit."""
    with _LOCK:
        previous = _CHECK[0]
        set_output_checks(enabled)
    try:
        yield
    finally:
        with _LOCK:
            _CHECK[0] = previous
            for op in list(_ALL_OPS):
                op._rebuild_chains()


@register_reset
def _reset_switches() -> None:
    with _LOCK:
        _set_wrap(True)
        set_output_checks(None)
