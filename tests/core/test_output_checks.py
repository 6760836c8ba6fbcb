"""Provider output checks (``OPMUX_CHECK_OUTPUTS=1`` / ``enable_output_checks``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import opmux
from opmux.core import switches


def _op_with(registry: opmux.OpRegistry, ns: str, impl: Callable[..., Any]) -> opmux.Op:
    @opmux.register_op(namespace=ns, registry=registry)
    def halve(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x / 2

    halve.register_impl("bad", dispatch_key="CPU")(impl)
    return halve


def _int64(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x / 2).long()


def _wrong_shape(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x / 2)[:1]


def _returns_none(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return None  # type: ignore[return-value]


def _returns_tuple(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x / 2, x)  # type: ignore[return-value]


def _meta_output(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, device="meta")


def _writes_y(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y.add_(1)
    return x / 2


def _writes_y_behind_torchs_back(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y.data[0] = 99.0  # no version-counter bump: caught by comparing contents
    return x / 2


@pytest.mark.parametrize(("impl", "message"), [
    (_int64, r"output with dtype torch.int64 \(expected dtype torch.float32\)"),
    (_wrong_shape, r"output with shape \[1\] \(expected shape \[3\]\)"),
    (_returns_none, "returned None as output, expected a Tensor"),
    (_returns_tuple, "returned tuple of 2 as output, expected a Tensor"),
    (_meta_output, r"output with device meta \(expected device cpu\)"),
    (_writes_y, "changed argument 'y', which is not in mutates_args"),
    (_writes_y_behind_torchs_back, "changed argument 'y'"),
])
@pytest.mark.parametrize("wrap", [True, False])
def test_bad_provider_outputs_are_reported_naming_op_and_provider(
        registry: opmux.OpRegistry, ns: str, impl: Callable[..., Any], message: str,
        wrap: bool) -> None:
    op = _op_with(registry, ns, impl)
    x, y = torch.arange(3.0), torch.zeros(3)
    with opmux.enable_output_checks(), opmux.enable_torch_wrap(wrap):
        with pytest.raises(opmux.ProviderOutputError, match=message) as info:
            op(x, y)
    assert info.value.op == op.qualname and info.value.provider == "bad"
    assert f"op {op.qualname!r}: provider 'bad'" in str(info.value)


@pytest.mark.parametrize(("impl", "message"), [
    (_int64, "output with dtype torch.int64"),
    (_writes_y, "changed argument 'y'"),  # inference tensors have no version counter
])
def test_checks_run_on_inference_tensors(registry: opmux.OpRegistry, ns: str,
                                         impl: Callable[..., Any], message: str) -> None:
    op = _op_with(registry, ns, impl)
    with torch.inference_mode():
        x, y = torch.arange(3.0), torch.zeros(3)
        with opmux.enable_output_checks(), pytest.raises(opmux.ProviderOutputError,
                                                         match=message):
            op(x, y)


def test_off_means_the_provider_itself_is_on_the_hot_path(registry: opmux.OpRegistry,
                                                           ns: str) -> None:
    op = _op_with(registry, ns, _int64)
    holder = op.priorities.chains["CPU"]
    assert holder.fns[0] is _int64  # nothing wrapped, nothing tested per call
    assert op(torch.arange(3.0), torch.zeros(3)).dtype == torch.int64
    with opmux.enable_output_checks():
        assert holder.fns[0] is not _int64  # rebuilt when the switch changed
        with pytest.raises(opmux.ProviderOutputError):
            op(torch.arange(3.0), torch.zeros(3))
    assert holder.fns[0] is _int64


def test_good_providers_and_declared_mutations_pass(registry: opmux.OpRegistry,
                                                     ns: str) -> None:
    @opmux.register_op(namespace=ns, registry=registry, mutates_args=("out",))
    def fill(x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out.copy_(x)
        return x.clone(), x * 2

    @fill.register_impl("good", dispatch_key="CPU")
    def _good(x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out.copy_(x)
        return x + 0, x * 2

    x, out = torch.tensor([1.0, float("nan")]), torch.zeros(2)
    with opmux.enable_output_checks():
        _, b = fill(x, out)
    assert out[0].item() == 1.0 and b[0].item() == 2.0


def test_the_environment_variable_turns_checks_on(registry: opmux.OpRegistry, ns: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPMUX_CHECK_OUTPUTS", "1")
    switches.set_output_checks(None)  # back to the environment, which is read now
    try:
        op = _op_with(registry, ns, _returns_none)
        assert switches.output_checks_enabled()
        with pytest.raises(opmux.ProviderOutputError):
            op(torch.ones(3), torch.ones(3))
    finally:
        monkeypatch.delenv("OPMUX_CHECK_OUTPUTS")
        switches.set_output_checks(None)
    assert not switches.output_checks_enabled()


def test_conformance_kit_turns_checks_on(registry: opmux.OpRegistry, ns: str) -> None:
    from opmux.testing.cases import Case
    from opmux.testing.conformance import run_case

    op = _op_with(registry, ns, _writes_y)
    case = Case("c", (torch.arange(3.0), torch.zeros(3)))
    result = run_case(op, "bad", case)
    assert result.status == "fail"
    assert "changed argument 'y'" in result.message
