"""Checks of layer constructor arguments, in the shape of the op checks.

A layer built with a size or epsilon no op can take would otherwise fail later, inside a
forward (``ZeroDivisionError``) or not at all (NaN outputs); these raise
:class:`opmux.OpInputError` at construction, naming the layer, the argument and the range.
Sizes go through :func:`opmux.ops.checks.check_int_range` (:func:`check_size`).
"""

from __future__ import annotations

import math
from typing import Any

from opmux.core.errors import OpInputError
from opmux.ops.checks import check_int_range

__all__ = ["check_eps"]


def check_size(layer: str, name: str, value: Any) -> int:
    """``value`` when it is a positive ``int`` (not ``bool``).

    :raises opmux.OpInputError: naming ``layer`` and ``name``.
    """
    return int(check_int_range(value, f"{layer}: {name}", low=1, argument=name))


def check_eps(layer: str, value: Any, name: str = "eps") -> float:
    """``value`` when it is a finite number > 0 (a norm's epsilon).

    :raises opmux.OpInputError: naming ``layer`` and ``name``.
    """
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise OpInputError(f"{layer}: {name} must be a finite number > 0, got {value!r}",
                           argument=name)
    return float(value)
