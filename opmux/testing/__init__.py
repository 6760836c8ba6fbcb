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
    from opmux.testing.bad_input_table import BadInput, register_bad_inputs
    from opmux.testing.bad_inputs import bad_inputs_for
    from opmux.testing.case_table import Case, CaseGenerator, register_cases
    from opmux.testing.cases import cases_for, has_cases
    from opmux.testing.conformance import (
        TOLERANCES,
        CaseResult,
        ProviderReport,
        check_provider,
        compare_outputs,
        provider_impl,
        run_case,
        run_opcheck,
        tolerance,
    )
    from opmux.testing.kv_format_cases import check_kv_cache_format
    from opmux.testing.paged_batches import PagedBatch, paged_batch
    from opmux.testing.reset import reset_for_tests
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
    "check_kv_cache_format",
    "check_provider",
    "compare_outputs",
    "has_cases",
    "paged_batch",
    "provider_impl",
    "register_bad_inputs",
    "register_cases",
    "reset_for_tests",
    "run_case",
    "run_opcheck",
    "run_variant",
    "strided_variants",
    "tolerance",
]

# the tables (case_table, bad_input_table) import no family module: registering a plugin's
# cases does not load the catalog's; the lookups (cases, bad_inputs) load it on first use
_HOME = {name: "opmux.testing.case_table" for name in ("Case", "CaseGenerator", "register_cases")}
_HOME.update({name: "opmux.testing.cases" for name in ("cases_for", "has_cases")})
_HOME.update({name: "opmux.testing.conformance" for name in
              ("TOLERANCES", "CaseResult", "ProviderReport", "check_provider", "compare_outputs",
               "provider_impl", "run_case", "run_opcheck", "tolerance")})
_HOME.update({name: "opmux.testing.bad_input_table" for name in
              ("BadInput", "register_bad_inputs")})
_HOME.update({"bad_inputs_for": "opmux.testing.bad_inputs"})
_HOME.update({name: "opmux.testing.views" for name in
              ("StridedVariant", "run_variant", "strided_variants")})
_HOME.update({name: "opmux.testing.paged_batches" for name in ("PagedBatch", "paged_batch")})
_HOME.update({"check_kv_cache_format": "opmux.testing.kv_format_cases"})
_HOME.update({"reset_for_tests": "opmux.testing.reset"})


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'opmux.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
