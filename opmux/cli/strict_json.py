"""Strict JSON for the ``--json`` outputs of ``opmux``: standard JSON, never ``NaN`` or
``Infinity``.

Python's :mod:`json` writes a non-finite float as the bare token ``NaN``, ``Infinity`` or
``-Infinity``, which is not JSON (RFC 8259) and which most parsers refuse. Every ``opmux``
command that prints JSON writes such a number as one of the strings in
:data:`NON_FINITE` instead (a provider that outputs ``inf`` has an error of ``"inf"``), and
:func:`read_number` reads a number written either way.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

__all__ = ["NON_FINITE", "dumps", "read_number", "strict"]

NON_FINITE: Final = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
"""The strings that stand for the non-finite numbers, and the numbers."""


def strict(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists and tuples, at any depth)
    replaced by its string in :data:`NON_FINITE`."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def dumps(value: Any, indent: int | None = 2) -> str:
    """``json.dumps`` of :func:`strict` ``(value)``; raises rather than write a bare NaN."""
    return json.dumps(strict(value), indent=indent, allow_nan=False)


def read_number(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number (not a boolean) or a string of
    :data:`NON_FINITE`; ``None`` otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return NON_FINITE.get(value)
    return None
