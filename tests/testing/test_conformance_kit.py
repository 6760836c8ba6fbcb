"""The conformance kit: it passes correct providers, fails wrong ones, and runs over every
provider supported here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import opmux
from opmux.testing import (
    Case,
    cases_for,
    check_provider,
    has_cases,
    register_cases,
    run_case,
    tolerance,
)
from opmux.testing.cases import unregister_cases

opmux.load_plugins()
_PAIRS = [(op.qualname, p) for op in opmux.list_ops() if has_cases(op.qualname)
          for p in op.supported_providers() if p != "native"]


@pytest.mark.parametrize(("op_name", "provider"), _PAIRS or [pytest.param(
    "", "", marks=pytest.mark.skip(reason="only native providers are registered here"))])
def test_every_supported_provider_conforms(op_name: str, provider: str) -> None:
    report = check_provider(op_name, provider)
    assert report.ok, report.format()
    assert report.counts["pass"] + report.counts["skip"] == len(report.cases)


@pytest.mark.parametrize("op", [op for op in opmux.list_ops() if has_cases(op.qualname)],
                         ids=lambda op: op.qualname)
def test_generated_cases_are_valid_native_inputs(op: opmux.Op) -> None:
    cases = cases_for(op.qualname)
    assert len(cases) >= 4
    for case in cases:
        args, kwargs = case.materialize("cpu")
        op.native(*args, **kwargs)  # raises on an invalid case
    again = cases_for(op.qualname)  # deterministic
    for a, b in zip(cases, again, strict=True):
        for x, y in zip(a.args, b.args, strict=True):
            assert type(x) is type(y)
            if isinstance(x, torch.Tensor):  # bit for bit (damaged caches hold NaN)
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_edge_cases_are_covered() -> None:
    names = {op: {c.name for c in cases_for(op)} for op in
             ("paged_attention", "rotary_embedding", "reshape_and_cache",
              "advance_step_flashattn")}
    pa = " ".join(names["paged_attention"])
    for word in ("gqa1", "gqa4", "gqa8", "window", "softcap", "chunked-prefill", "qlen0",
                 "padding-rows", "empty", "bf16", "fp16"):
        assert word in pa, word
    assert any("gptj" in n for n in names["rotary_embedding"])
    assert any("partial-rot" in n for n in names["rotary_embedding"])
    assert "fp32-all-padding" in names["reshape_and_cache"]
    assert {"worked-example", "padding-rows", "empty"} <= names["advance_step_flashattn"]


# ------------------------------------------------------------- the kit can fail
@pytest.fixture
def scaled(registry: opmux.OpRegistry, ns: str) -> Iterator[opmux.Op]:
    @opmux.register_op(namespace=ns, registry=registry)
    def scale_rows(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    @opmux.register_op(namespace=ns, registry=registry, mutates_args=("out",))
    def fill_rows(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)

    def gen() -> Iterator[Case]:
        g = torch.Generator().manual_seed(0)
        for tag, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            yield Case(f"{tag}-basic", (torch.randn(4, 8, generator=g).to(dt), 3.0))
        yield Case("fp32-empty", (torch.zeros(0, 8), 3.0))

    def gen_fill() -> Iterator[Case]:
        yield Case("fp32", (torch.randn(3, 4), torch.zeros(3, 4)))

    register_cases(f"{ns}::scale_rows", gen)
    register_cases(f"{ns}::fill_rows", gen_fill)
    yield scale_rows
    unregister_cases(f"{ns}::scale_rows")
    unregister_cases(f"{ns}::fill_rows")


def test_exact_provider_passes(scaled: opmux.Op) -> None:
    @scaled.register_impl("exact", dispatch_key="CPU")
    def _(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    report = check_provider(scaled, "exact")
    assert report.ok and report.verdict() == "PASS"
    assert [c.status for c in report.cases] == ["pass"] * 3


def test_wrong_provider_fails_with_errors_vs_tolerance(scaled: opmux.Op) -> None:
    @scaled.register_impl("wrong", dispatch_key="CPU")
    def _(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor + 0.5

    report = check_provider(scaled, "wrong")
    assert not report.ok and report.verdict() == "FAIL"
    fp32 = report.cases[0]
    assert fp32.status == "fail"
    assert fp32.max_abs == pytest.approx(0.5)
    assert (fp32.atol, fp32.rtol) == (1e-4, 1e-4)
    assert fp32.ratio > 1
    assert "elements beyond tolerance" in fp32.message
    assert report.cases[2].status == "pass"  # the empty case cannot differ
    assert "FAIL" in report.format() and "fp32-basic" in report.format()


def test_slightly_off_provider_passes_bf16_but_fails_fp32(scaled: opmux.Op) -> None:
    @scaled.register_impl("sloppy", dispatch_key="CPU")
    def _(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor * (1 + 1e-3)

    statuses = {c.name: c.status for c in check_provider(scaled, "sloppy").cases}
    assert statuses == {"fp32-basic": "fail", "bf16-basic": "pass", "fp32-empty": "pass"}


@pytest.mark.parametrize(("impl", "expect"), [
    (lambda x, factor=2.0: (x * factor).half(), "expected dtype torch.float32"),
    (lambda x, factor=2.0: (x * factor)[:2], "expected shape [4, 8]"),
    (lambda x, factor=2.0: torch.full_like(x, float("nan")), "NaN pattern differs"),
])
def test_wrong_dtype_shape_or_nan_fail(scaled: opmux.Op, impl, expect) -> None:  # type: ignore[no-untyped-def]
    def fn(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return impl(x, factor)  # type: ignore[no-any-return]

    scaled.register_impl("bad", dispatch_key="CPU")(fn)
    result = check_provider(scaled, "bad").cases[0]
    assert result.status == "fail" and expect in result.message


def test_raising_provider_is_an_error(scaled: opmux.Op) -> None:
    @scaled.register_impl("raises", dispatch_key="CPU")
    def _(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        raise RuntimeError("kernel exploded")

    report = check_provider(scaled, "raises")
    assert not report.ok
    assert report.cases[0].status == "error"
    assert "RuntimeError: kernel exploded" in report.cases[0].message


def test_mutated_arguments_are_compared(registry: opmux.OpRegistry, ns: str,
                                        scaled: opmux.Op) -> None:
    fill = registry.get_op(f"{ns}::fill_rows")

    @fill.register_impl("half_done", dispatch_key="CPU")
    def _(x: torch.Tensor, out: torch.Tensor) -> None:
        out[:1].copy_(x[:1])

    result = check_provider(fill, "half_done").cases[0]
    assert result.status == "fail"
    assert "mutated argument 'out'" in result.message


def test_supports_args_rejection_and_unsupported_are_skips(scaled: opmux.Op) -> None:
    @scaled.register_impl("fp32_only", dispatch_key="CPU",
                          supports_args=lambda x, factor=2.0: x.dtype == torch.float32)
    def _(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    @scaled.register_impl("absent", dispatch_key="CPU", supported=False, reason="no hardware")
    def _absent(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    report = check_provider(scaled, "fp32_only")
    assert [c.status for c in report.cases] == ["pass", "skip", "pass"]
    assert report.ok
    absent = check_provider(scaled, "absent")
    assert absent.verdict() == "UNSUPPORTED" and absent.reason == "no hardware"


def test_errors_for_unknown_provider_op_and_duplicate_cases(scaled: opmux.Op) -> None:
    with pytest.raises(opmux.ProviderUnavailableError, match=r"has no provider 'nope'"):
        check_provider(scaled, "nope")
    with pytest.raises(opmux.UnknownOpError, match=r"no conformance cases registered for op "
                                                   r"'opmux::does_not_exist'"):
        cases_for("does_not_exist")
    with pytest.raises(opmux.RegistrationError, match="already registered"):
        register_cases(scaled.qualname, lambda: [])


def test_tolerances_per_dtype() -> None:
    assert tolerance(Case("a", (torch.zeros(1),))) == (1e-4, 1e-4)
    assert tolerance(Case("a", (torch.zeros(1, dtype=torch.bfloat16),))) == (3e-2, 3e-2)
    assert tolerance(Case("a", (torch.zeros(1, dtype=torch.int64),))) == (0.0, 0.0)
    assert tolerance(Case("a", (torch.zeros(1),), atol=1.0)) == (1.0, 1e-4)


def test_catalog_provider_that_ignores_padding_slots_fails() -> None:
    op = opmux.ops.reshape_and_cache
    case = next(c for c in cases_for("reshape_and_cache") if c.name == "fp32-basic")

    def writes_padding(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_cache_format: str = "canonical") -> None:
        d = key_cache.shape[-1]
        key_cache.view(-1, key.shape[1], d)[slot_mapping] = key  # -1 hits the last slot
        value_cache.view(-1, key.shape[1], d)[slot_mapping] = value

    op.register_impl("kit_test_padding_bug", dispatch_key="CPU")(writes_padding)
    try:
        result = run_case(op, "kit_test_padding_bug", case)
    finally:
        op.unregister_impl("kit_test_padding_bug")
    assert result.status == "fail"
    assert "mutated argument 'key_cache'" in result.message


def test_the_one_reset_forgets_registered_cases_and_keeps_the_catalogs() -> None:
    from opmux.testing import Case, cases_for, has_cases, register_cases, reset_for_tests

    register_cases("rms_norm_reset_probe", lambda: iter([Case("one", ())]))
    assert has_cases("rms_norm_reset_probe")
    reset_for_tests()
    assert not has_cases("rms_norm_reset_probe")
    assert cases_for("rms_norm")  # the catalog's generators come back on the next lookup
