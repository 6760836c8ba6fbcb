"""The bad-input table: what a bad input is, and the one table of bad-input generators per op.

Each op's generators yield :class:`BadInput` rows ``(label, args, kwargs, argument)``:
arguments the op must refuse with :class:`opmux.OpInputError` whose ``.argument`` is
``argument``, through native and through every provider (called directly and through the
op), without changing any input tensor. Every generator enters the table through
:func:`register_bad_inputs`: the catalog's family modules (``bad_inputs_elementwise``,
``bad_inputs_cache``, ``bad_inputs_moe``) and plugins that add ops alike. This module imports
none of them; :mod:`opmux.testing.bad_inputs` loads the catalog's and answers lookups.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from opmux.core.errors import RegistrationError

__all__ = [
    "BadInput",
    "BadInputGenerator",
    "generators_for",
    "ops_with_generators",
    "register_bad_inputs",
    "row_randn",
    "unregister_bad_inputs",
    "variants",
]


@dataclass(frozen=True)
class BadInput:
    """One input an op must refuse.

    :ivar label: short id, unique within the op (``"eps-nan"``).
    :ivar args: positional arguments (CPU tensors).
    :ivar kwargs: keyword arguments.
    :ivar argument: the argument the error must name (``OpInputError.argument``).
    """

    label: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    argument: str = ""

    def __iter__(self) -> Any:  # unpacks as (label, args, kwargs, argument)
        return iter((self.label, self.args, self.kwargs, self.argument))


def row_randn(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded normal values for a bad-input row."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def variants(base: dict[str, Any], rows: list[tuple[str, str, dict[str, Any]]]
              ) -> Iterator[BadInput]:
    """One row per ``(label, argument, changes)``: ``base`` with ``changes`` applied."""
    names = list(base)
    for label, argument, changes in rows:
        values = {**base, **changes}
        yield BadInput(label, tuple(values[n] for n in names), {}, argument)


BadInputGenerator = Callable[[], Iterable[BadInput]]
"""A function returning an op's bad inputs (built on the CPU, deterministic)."""

_GENERATORS: dict[str, list[BadInputGenerator]] = {}
_LOCK = threading.Lock()


def _qualify(op_name: str) -> str:
    return op_name if "::" in op_name else f"opmux::{op_name}"


def register_bad_inputs(op_name: str, generator: BadInputGenerator) -> None:
    """Add a generator of bad inputs for ``op_name`` (``"ns::name"``; bare = ``opmux::``).

    An op may have several generators (e.g. one per concern); their rows are concatenated
    and labels must stay unique within the op.

    :raises RegistrationError: when ``generator`` is already registered for the op.
    """
    qualname = _qualify(op_name)
    with _LOCK:
        gens = _GENERATORS.setdefault(qualname, [])
        if generator in gens:
            raise RegistrationError(f"bad-input generator {generator!r} is already registered "
                                    f"for op {qualname!r}", op=qualname)
        gens.append(generator)


def unregister_bad_inputs(op_name: str) -> None:
    """Remove every bad-input generator of ``op_name`` (tests)."""
    with _LOCK:
        _GENERATORS.pop(_qualify(op_name), None)


def ops_with_generators() -> list[str]:
    """Qualified names of the ops that have bad-input generators, sorted."""
    with _LOCK:
        return sorted(name for name, gens in _GENERATORS.items() if gens)


def generators_for(op_name: str) -> list[BadInputGenerator]:
    """The bad-input generators registered for ``op_name`` (empty when none)."""
    with _LOCK:
        return list(_GENERATORS.get(_qualify(op_name), ()))
