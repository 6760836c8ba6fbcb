"""Remembering which argument layouts passed an op's static checks.

An engine calls the same op with the same layouts step after step: the same dtypes,
devices, shapes and strides, the same scalars. The static part of a ``check_<op>`` (types,
dtypes, ranks, sizes, strides, devices, scalar ranges) depends on nothing else, so once a
layout has passed, the answer for it is known. :class:`StaticMemo` keeps those layouts per
check and per provider; a hit skips the static checks, a miss runs them and remembers the
layout only if they passed (a failing layout is checked, and raises, every time). Value
checks (index ranges) are never remembered: they read the tensors' data on every call.

A layout is remembered only when every argument has a plain description:

- a plain strided ``torch.Tensor`` or ``nn.Parameter`` (a model's weights; no other
  subclass: fake and functional tensors while tracing never hit), described by
  ``(dtype, device, shape, strides)``;
- ``None``, or an ``int``/``float``/``bool``/``str``, described by its type and value
  (``True`` and ``1`` differ).

Anything else (symbolic sizes, lists, subclasses) is checked every time. A memo holds at most
:data:`LIMIT` layouts and starts over when full; :func:`opmux.core.state.reset_for_tests`
empties every memo.
"""

from __future__ import annotations

from typing import Final

import torch
from torch import Tensor
from torch.nn import Parameter

from opmux.core.state import register_reset

__all__ = ["LIMIT", "StaticMemo"]

LIMIT: Final = 512
"""Layouts one memo keeps before it starts over (an engine uses a handful per op)."""

_SCALARS: Final = (int, float, bool, str)
_TENSORS: Final = (Tensor, Parameter)
_MEMOS: list[StaticMemo] = []


def _layout(provider: str, args: tuple[object, ...]) -> tuple[object, ...] | None:
    key: list[object] = [provider]
    for a in args:
        kind = type(a)
        if kind in _TENSORS:
            if a.layout is not torch.strided:  # type: ignore[attr-defined]
                return None
            key.append((a.dtype, a.device, a.shape, a.stride()))  # type: ignore[attr-defined]
        elif a is None or kind in _SCALARS:
            key.append((kind, a))
        else:
            return None
    return tuple(key)


class StaticMemo:
    """The argument layouts that passed one check's static part, per provider.

    Use::

        layout = _MEMO.seen(provider, args)
        if layout is not True:
            ...static checks (raise on failure)...
            _MEMO.add(layout)
    """

    __slots__ = ("_passed",)

    def __init__(self) -> None:
        self._passed: set[tuple[object, ...]] = set()
        _MEMOS.append(self)

    def seen(self, provider: str, args: tuple[object, ...]) -> tuple[object, ...] | bool:
        """``True`` when ``args``' layout passed before; else the layout to :meth:`add`
        after the checks pass (``False`` when it cannot be described)."""
        layout = _layout(provider, args)
        if layout is None:
            return False
        return True if layout in self._passed else layout

    def add(self, layout: tuple[object, ...] | bool) -> None:
        """Remember a layout :meth:`seen` returned, once its checks passed."""
        if isinstance(layout, tuple):
            if len(self._passed) >= LIMIT:
                self._passed.clear()
            self._passed.add(layout)

    def __len__(self) -> int:
        return len(self._passed)


@register_reset
def _reset() -> None:
    for memo in _MEMOS:
        memo._passed.clear()
