"""Conditions that stay symbolic under ``torch.compile``, and whether values can be read.

Size conditions go through :func:`require`, which turns a symbolic condition
(``torch.SymBool`` under ``torch.compile(dynamic=True)``) into a deferred runtime assert
(``torch._check``) instead of a guard, and the checks never call ``int()``/``bool()`` on a
symbolic size, so they never specialise a compiled graph. Value checks (index ranges) run
only when :func:`has_data`: never on meta or fake tensors, never while tracing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from opmux.ops.checks.input_errors import input_error

__all__ = ["has_data", "is_concrete", "require"]


def is_concrete(*values: object) -> bool:
    """Whether none of ``values`` is symbolic (``SymInt``/``SymFloat``/``SymBool``)."""
    return not any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
                   for v in values)


def require(ok: object, op: str, provider: str, argument: str,
            expected: str | Callable[[], str], got: object) -> None:
    """Raise :func:`input_error` unless ``ok``.

    A symbolic ``ok`` (``torch.SymBool`` while tracing with dynamic shapes) becomes a
    deferred runtime assert (``torch._check``), so the check adds no guard and never
    specialises the graph; a concrete ``ok`` is tested directly. ``expected`` may be a
    function returning the phrase (and ``got`` a function returning the value), so a passing
    check formats nothing.
    """
    if isinstance(ok, torch.SymBool):
        torch._check(ok, lambda: str(input_error(op, provider, argument, str(_text(expected)),
                                                 _text(got))))
        return
    if not ok:
        raise input_error(op, provider, argument, str(_text(expected)), _text(got))


def _text(value: object) -> object:
    return value() if callable(value) else value


def has_data(*tensors: Tensor) -> bool:
    """Whether the values of ``tensors`` can be read (not meta, not fake, not tracing)."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t.is_meta:
            return False
        if type(t) is not Tensor:  # subclasses only: a plain tensor is never fake
            from torch._subclasses.fake_tensor import is_fake

            if is_fake(t):
                return False
    return True
