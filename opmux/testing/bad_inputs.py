"""Bad inputs of every op: the catalog's, loaded on first use, and those plugins add.

:func:`bad_inputs_for` and :func:`ops_with_bad_inputs` look an op up in the bad-input table
(:mod:`opmux.testing.bad_input_table`, whose :class:`BadInput` and
:func:`register_bad_inputs` are re-exported here) after loading the catalog's rows: this
module is the one loader of the family modules named in :data:`CATALOG_MODULES`, each of
which registers its ops' generators through
:func:`~opmux.testing.bad_input_table.register_bad_inputs`.

>>> from opmux.testing.bad_inputs import bad_inputs_for
>>> row = bad_inputs_for("rms_norm")[0]
>>> row.label, row.argument
('x-none', 'x')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from opmux.core.errors import UnknownOpError
from opmux.testing.bad_input_table import (
    BadInput,
    BadInputGenerator,
    generators_for,
    ops_with_generators,
    register_bad_inputs,
    unregister_bad_inputs,
)
from opmux.testing.bad_inputs_cache import register_cache_bad_inputs
from opmux.testing.bad_inputs_elementwise import register_elementwise_bad_inputs
from opmux.testing.bad_inputs_linear import register_linear_bad_inputs
from opmux.testing.bad_inputs_moe import register_moe_bad_inputs
from opmux.testing.case_table import check_unique

__all__ = [
    "CATALOG_MODULES",
    "BadInput",
    "BadInputGenerator",
    "bad_inputs_for",
    "ops_with_bad_inputs",
    "register_bad_inputs",
    "unregister_bad_inputs",
]

_FAMILIES: Final[tuple[Callable[[], None], ...]] = (
    register_elementwise_bad_inputs, register_cache_bad_inputs, register_moe_bad_inputs,
    register_linear_bad_inputs)

CATALOG_MODULES: Final[tuple[str, ...]] = tuple(f.__module__ for f in _FAMILIES)
"""Modules registering the catalog's bad inputs (one per op family group)."""

_LOADED: list[bool] = [False]  # the catalog's rows are registered once per process


def _ensure_catalog() -> None:
    if not _LOADED[0]:
        _LOADED[0] = True
        for register in _FAMILIES:
            register()


def ops_with_bad_inputs() -> list[str]:
    """Qualified names of the ops that have bad inputs registered, sorted."""
    _ensure_catalog()
    return ops_with_generators()


def bad_inputs_for(op_name: str) -> list[BadInput]:
    """The bad inputs of ``op_name``, freshly generated.

    :raises UnknownOpError: when none are registered for the op.
    :raises RegistrationError: when two rows share a label.
    """
    _ensure_catalog()
    qualname = op_name if "::" in op_name else f"opmux::{op_name}"
    gens = generators_for(qualname)
    if not gens:
        raise UnknownOpError(f"no bad inputs registered for op {qualname!r}; register a "
                             f"generator with opmux.testing.bad_inputs.register_bad_inputs")
    rows = [row for gen in gens for row in gen()]
    check_unique(qualname, "bad inputs", "labels", [r.label for r in rows])
    return rows
