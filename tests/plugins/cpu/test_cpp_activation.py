"""The ``cpp`` kernels of vLLM's other activation rows: every conformance case against native,
strided input declined, bad arguments rejected before anything is written."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import opmux
from opmux.testing import conformance

pytestmark = pytest.mark.slow  # the session fixture compiles the extension on first use

OPS = ("fatrelu_and_mul", "mul_and_silu", "gelu_and_mul_sparse", "swigluoai_and_mul",
       "gelu_new", "gelu_fast", "quick_gelu", "relu2", "xielu")


@pytest.fixture(scope="session")
def k(cpp: Any) -> Any:
    from opmux.plugins.cpu import cpp_activation

    return cpp_activation


@pytest.mark.parametrize("name", OPS)
def test_conformance_cases(k: Any, name: str) -> None:
    report = conformance.check_provider(name, "cpp")
    assert report.ok, report.format()
    # transposed input is declined (native runs it); xielu also declines results the
    # reference promotes (fp16 x, bf16 parameters) or broadcasts (0-d x)
    skipped = {c.name for c in report.cases if c.status == "skip"}
    assert skipped, report.format()
    for case in skipped:
        assert case.startswith("fp32-transposed") or (
            name == "xielu" and case in ("fp16-bf16-params", "fp32-scalar")), report.format()


@pytest.mark.parametrize("name", OPS)
def test_cpp_is_the_default_provider_on_cpu(k: Any, name: str) -> None:
    op = opmux.get_op(name)
    args = conformance.cases_for(name)[0].materialize("cpu")[0]
    assert op.dispatch(*args).provider == "cpp", op.explain(*args)
    strided = torch.randn(40, 8).t()
    rest = args[1:]
    assert op.dispatch(strided, *rest).provider == "native"


def test_kernels_check_their_outputs(k: Any) -> None:
    x = torch.randn(4, 16)
    out = torch.full((4, 7), 3.0)
    with pytest.raises(ValueError, match=r"opmux::mul_and_silu \(provider 'cpp'\): out"):
        torch.ops.opmux_cpu.mul_and_silu_out(out, x)
    assert torch.equal(out, torch.full((4, 7), 3.0))
    with pytest.raises(ValueError, match=r"'approximate' expected one of"):
        torch.ops.opmux_cpu.gelu_and_mul_sparse_out(torch.empty(4, 8), x, 1.6, "erf")
    with pytest.raises(ValueError, match=r"relu2 \(provider 'cpp'\): argument 'x' expected a "
                                         r"contiguous"):
        torch.ops.opmux_cpu.relu2_out(torch.empty(16, 4), x.t())


def test_predicates_decline_what_native_rejects() -> None:
    # the predicate declines; through the op, native says why
    x = torch.randn(3, 10)
    for name, args, match in (
            ("gelu_and_mul_sparse", (x, 0.0, "none"), r"'activation_sparsity'"),
            ("swigluoai_and_mul", (x, 1.702, -1.0), r"'limit'"),
            ("fatrelu_and_mul", (x[:, :9], 0.0), r"'x'.*even"),
            ("gelu_new", (torch.ones(3, dtype=torch.int32),), r"'x'.*floating")):
        op = opmux.get_op(name)
        assert not op.impls["cpp"].supports_args(*args)
        with op.set_priority(["cpp", "native"]), pytest.raises(
                opmux.OpInputError, match=rf"{name} \(provider 'native'\).*{match}"):
            op(*args)


def test_fatrelu_ties_and_nan(k: Any) -> None:
    x = torch.tensor([[0.5, 0.25, float("nan"), 1.0, 2.0, 2.0, 2.0, 2.0]])
    got = k.fatrelu_and_mul(x, 0.5)
    want = opmux.get_op("fatrelu_and_mul").native(x, 0.5)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got[0, 0] == 0.0 and got[0, 1] == 0.0 and got[0, 2].isnan()
