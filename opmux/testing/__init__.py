"""The conformance kit: seeded cases per op, provider-vs-native checks, opcheck, pytest plugin.

>>> from opmux.testing import cases_for
>>> [c.name for c in cases_for("advance_step_flashattn")][:2]
['worked-example', 'bs4-multi-block']

Names are imported on first use: pytest imports this package for its plugin module in
every run, and the plugin must stay inert until enabled.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opmux.testing.bad_inputs import BadInput, bad_inputs_for, register_bad_inputs
    from opmux.testing.cases import Case, CaseGenerator, cases_for, has_cases, register_cases
    from opmux.testing.conformance import (
        TOLERANCES,
        CaseResult,
        ProviderReport,
        check_provider,
        run_case,
        run_opcheck,
        tolerance,
    )
    from opmux.testing.paged_batches import PagedBatch, paged_batch
    from opmux.testing.views import StridedVariant, run_variant, strided_variants

__all__ = [
    "BadInput",
    "Case",
    "CaseGenerator",
    "CaseResult",
    "PagedBatch",
    "ProviderReport",
    "StridedVariant",
    "TOLERANCES",
    "bad_inputs_for",
    "cases_for",
    "check_provider",
    "has_cases",
    "paged_batch",
    "register_bad_inputs",
    "register_cases",
    "run_case",
    "run_opcheck",
    "run_variant",
    "strided_variants",
    "tolerance",
]

_HOME = {name: "opmux.testing.cases" for name in
         ("Case", "CaseGenerator", "cases_for", "has_cases", "register_cases")}
_HOME.update({name: "opmux.testing.conformance" for name in
              ("TOLERANCES", "CaseResult", "ProviderReport", "check_provider", "run_case",
               "run_opcheck", "tolerance")})
_HOME.update({name: "opmux.testing.bad_inputs" for name in
              ("BadInput", "bad_inputs_for", "register_bad_inputs")})
_HOME.update({name: "opmux.testing.views" for name in
              ("StridedVariant", "run_variant", "strided_variants")})
_HOME.update({name: "opmux.testing.paged_batches" for name in ("PagedBatch", "paged_batch")})


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'opmux.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
