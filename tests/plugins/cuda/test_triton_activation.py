"""The Triton kernels of vLLM's other activation rows, through opmux, against native.

Every conformance case of each op runs on provider ``triton`` (the interpreter on CPU
tensors without a GPU), registered in a fresh registry and namespace for the test device's
key; bad arguments raise the same errors as native.
"""

from __future__ import annotations

import pytest
import torch
from cuda_refs import OpsFactory

import opmux
import opmux.ops
from opmux.testing import conformance
from opmux.testing.cases import cases_for

pytestmark = pytest.mark.triton

OPS = ("fatrelu_and_mul", "mul_and_silu", "gelu_and_mul_sparse", "swigluoai_and_mul",
       "gelu_new", "gelu_fast", "quick_gelu", "relu2", "xielu")


@pytest.fixture
def act_ops(triton_ops_in: OpsFactory) -> dict[str, opmux.Op]:
    return triton_ops_in(OPS)


@pytest.mark.parametrize("name", OPS)
def test_conformance_cases(act_ops: dict[str, opmux.Op], device: torch.device,
                           name: str) -> None:
    report = conformance.check_provider(act_ops[name], "triton", device,
                                        cases=cases_for(name))
    assert report.ok, report.format()
    skipped = {c.name for c in report.cases if c.status == "skip"}
    # strided inputs are taken; only xielu declines results the reference promotes/broadcasts
    assert skipped == ({"fp16-bf16-params", "fp32-scalar"} if name == "xielu" else set()), (
        report.format())


def test_dispatch_reaches_triton(act_ops: dict[str, opmux.Op], device: torch.device) -> None:
    x = torch.randn(4, 2 * 24, device=device, dtype=torch.bfloat16)
    op = act_ops["swigluoai_and_mul"]
    assert op.dispatch(x, 1.702, 7.0).provider == "triton"
    torch.testing.assert_close(op(x, 1.702, 7.0).float(), op.native(x, 1.702, 7.0).float(),
                               atol=3e-2, rtol=3e-2)
    ap = torch.tensor([0.3], dtype=torch.bfloat16, device=device)
    # fp16 input with bf16 parameters: the reference promotes to fp32, triton declines
    assert act_ops["xielu"].dispatch(x.half(), ap, ap, 0.5, -1e-6).provider == "native"


def test_bad_arguments_are_rejected(act_ops: dict[str, opmux.Op], device: torch.device) -> None:
    from opmux.plugins.cuda import triton_activation as k

    # triton's supports_args declines; the op runs native, whose check says why
    x = torch.randn(3, 10, device=device)
    alpha_n = torch.zeros(1, device=device)
    for name, args, match in (
            ("gelu_and_mul_sparse", (x, 1.0, "none"), r"'activation_sparsity'"),
            ("gelu_and_mul_sparse", (x, 0.9, "erf"), r"'approximate'"),
            ("mul_and_silu", (x[:, :9],), r"even last dimension"),
            ("xielu", (x, torch.zeros(2, device=device), alpha_n, 0.5, -1e-6),
             r"'alpha_p'.*one value")):
        assert not getattr(k, f"{name}_supports")(*args)
        with pytest.raises(opmux.OpInputError, match=rf"{name} \(provider 'native'\).*{match}"):
            act_ops[name](*args)
