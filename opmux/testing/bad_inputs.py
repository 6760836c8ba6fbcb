"""Registry of bad inputs per op: the table the bad-input conformance test runs (#11).

Each op's generator yields :class:`BadInput` rows ``(label, args, kwargs, argument)``:
arguments the op must refuse with :class:`opmux.OpInputError` whose ``.argument`` is
``argument``, through native and through every provider (called directly and through the
op), without changing any input tensor. Plugins that add ops register theirs with
:func:`register_bad_inputs`; the catalog's rows live in modules named in
:data:`CATALOG_MODULES`, imported on first use.

>>> from opmux.testing.bad_inputs import bad_inputs_for
>>> row = bad_inputs_for("rms_norm")[0]
>>> row.label, row.argument
('x-not-a-tensor', 'x')
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from opmux.core.errors import RegistrationError, UnknownOpError
from opmux.testing.cases import _check_unique

__all__ = [
    "CATALOG_MODULES",
    "BadInput",
    "BadInputGenerator",
    "bad_inputs_for",
    "ops_with_bad_inputs",
    "register_bad_inputs",
    "unregister_bad_inputs",
]

CATALOG_MODULES: Final[tuple[str, ...]] = (
    "opmux.testing.bad_inputs_elementwise",
    "opmux.testing.bad_inputs_cache",
    "opmux.testing.bad_inputs_moe",
)
"""Modules registering the catalog's bad inputs (one per op family group)."""


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


def _randn(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded normal values for a bad-input row."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _variants(base: dict[str, Any], rows: list[tuple[str, str, dict[str, Any]]]
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
_LOADED: list[bool] = [False]


def _qualify(op_name: str) -> str:
    return op_name if "::" in op_name else f"opmux::{op_name}"


def _ensure_catalog() -> None:
    if not _LOADED[0]:
        _LOADED[0] = True
        for module in CATALOG_MODULES:
            importlib.import_module(module)


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


def ops_with_bad_inputs() -> list[str]:
    """Qualified names of the ops that have bad inputs registered, sorted."""
    _ensure_catalog()
    with _LOCK:
        return sorted(name for name, gens in _GENERATORS.items() if gens)


def bad_inputs_for(op_name: str) -> list[BadInput]:
    """The bad inputs of ``op_name``, freshly generated.

    :raises UnknownOpError: when none are registered for the op.
    :raises RegistrationError: when two rows share a label.
    """
    _ensure_catalog()
    qualname = _qualify(op_name)
    with _LOCK:
        gens = list(_GENERATORS.get(qualname, ()))
    if not gens:
        raise UnknownOpError(f"no bad inputs registered for op {qualname!r}; register a "
                             f"generator with opmux.testing.bad_inputs.register_bad_inputs")
    rows = [row for gen in gens for row in gen()]
    _check_unique(qualname, "bad inputs", "labels", [r.label for r in rows])
    return rows
