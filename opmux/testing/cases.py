"""Conformance cases of every op: the catalog's, loaded on first use, and those plugins add.

:func:`cases_for` and :func:`has_cases` look an op up in the case table
(:mod:`opmux.testing.case_table`, re-exported here with :class:`Case` and
:func:`register_cases`) after loading the catalog's cases: this module is the one loader of
the family modules, each of which registers its ops' generators through
:func:`~opmux.testing.case_table.register_cases`. Loading happens again after
:func:`opmux.testing.reset_for_tests` empties the table (a field of the runtime object).
"""

from __future__ import annotations

from collections.abc import Callable

from opmux.core.errors import UnknownOpError
from opmux.core.state import runtime
from opmux.testing.activation_cases import register_activation_cases
from opmux.testing.attention_cases import register_attention_cases
from opmux.testing.cache_cases import register_cache_cases
from opmux.testing.case_table import (
    Case,
    CaseGenerator,
    check_unique,
    generator_for,
    register_cases,
    registered_ops,
    unregister_cases,
)
from opmux.testing.communication_cases import register_communication_cases
from opmux.testing.layernorm_cases import register_layernorm_cases
from opmux.testing.linear_cases import register_linear_cases
from opmux.testing.moe_cases import register_moe_cases
from opmux.testing.quant_cases import register_quant_cases
from opmux.testing.rotary_cases import register_rotary_cases
from opmux.testing.ssd_cases import register_ssd_cases
from opmux.testing.ssm_cases import register_ssm_cases
from opmux.testing.xla_cases import register_xla_cases

__all__ = ["Case", "CaseGenerator", "cases_for", "has_cases", "load_catalog_cases",
           "register_cases", "unregister_cases"]

FAMILIES: tuple[Callable[[], None], ...] = (
    register_activation_cases,
    register_attention_cases,
    register_cache_cases,
    register_communication_cases,
    register_layernorm_cases,
    register_linear_cases,
    register_moe_cases,
    register_quant_cases,
    register_rotary_cases,
    register_ssd_cases,
    register_ssm_cases,
    register_xla_cases,
)
"""The registration function of each family module of the catalog's cases."""


def load_catalog_cases() -> None:
    """Register the catalog's cases (once; again after a reset)."""
    rt = runtime()
    if not rt.catalog_cases_loaded:
        for register in FAMILIES:
            register()
        rt.catalog_cases_loaded = True


def has_cases(op_name: str) -> bool:
    """Whether ``op_name`` has registered conformance cases."""
    load_catalog_cases()
    return generator_for(op_name) is not None


def cases_for(op_name: str) -> list[Case]:
    """The conformance cases of ``op_name``, freshly generated.

    :raises UnknownOpError: when no generator is registered for the op.
    """
    load_catalog_cases()
    qualname = op_name if "::" in op_name else f"opmux::{op_name}"
    gen = generator_for(qualname)
    if gen is None:
        raise UnknownOpError(
            f"no conformance cases registered for op {qualname!r}; register a generator with "
            f"opmux.testing.register_cases({qualname!r}, fn). Ops with cases: "
            f"{registered_ops()}")
    cases = list(gen())
    check_unique(qualname, "conformance cases", "names", [c.name for c in cases])
    return cases
