"""Provider ``triton`` for gemma_rms_norm, gemma_fused_add_rms_norm, rms_norm_gated and
quant_fp8: the conformance kit (interpreter on CPU, or the GPU), strided inputs, dispatch
through opmux, errors."""

from __future__ import annotations

import pytest
import torch
from cuda_refs import OpsFactory

import opmux
import opmux.ops
from opmux.testing import cases_for, check_provider

pytestmark = pytest.mark.triton

OPS = ("gemma_rms_norm", "gemma_fused_add_rms_norm", "rms_norm_gated", "quant_fp8")


@pytest.fixture
def ops(triton_ops_in: OpsFactory) -> dict[str, opmux.Op]:
    """The four natives in a fresh registry, with provider ``triton`` first on the device key."""
    return triton_ops_in(OPS)


@pytest.mark.parametrize("name", OPS)
def test_conformance_kit(ops: dict[str, opmux.Op], device: torch.device, name: str) -> None:
    report = check_provider(ops[name], "triton", device, cases=cases_for(name))
    assert report.ok, report.format()
    assert report.counts["pass"] == len(report.cases)


def test_strided_inputs_and_dispatch(ops: dict[str, opmux.Op], device: torch.device) -> None:
    base = torch.randn(96, 6, device=device)
    x = base.t()[:, :80]  # [6, 80], row stride 1 only after a transpose: copied to rows
    w = torch.randn(80, device=device) * 0.1
    z = torch.randn(6, 80, device=device)
    for name, args in (("gemma_rms_norm", (x, w, 1e-6)),
                       ("gemma_fused_add_rms_norm", (x, z, w, 1e-6)),
                       ("rms_norm_gated", (x, w, z, 1e-5, 16, True, "sigmoid"))):
        op = ops[name]
        assert op.dispatch(*args).provider == "triton"
        got, want = op(*args), op.native(*args)
        for g, v in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(g, v, atol=1e-5, rtol=1e-5)
    quant = ops["quant_fp8"]
    for args in ((x,), (x, None, True, torch.tensor([0.001], device=device)),
                 (x, None, False, None, 32, True), (x, torch.rand(3, 4, device=device) + 0.1)):
        assert quant.dispatch(*args).provider == "triton"
        (q, s), (wq, ws) = quant(*args), quant.native(*args)
        assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)


def test_errors_match_native(ops: dict[str, opmux.Op], device: torch.device) -> None:
    from opmux.plugins.cuda import triton_norm, triton_quant

    # triton's supports_args declines what native refuses; the op runs native, whose check
    # gives the error
    x = torch.randn(4, 8, device=device)
    gated = (x, torch.ones(8, device=device), None, 1e-5, 3)
    assert not triton_norm.rms_norm_gated_supports(*gated)
    with pytest.raises(opmux.OpInputError, match=r"opmux::rms_norm_gated \(provider 'native'\): "
                       r"argument 'group_size' expected"):
        ops["rms_norm_gated"](*gated)
    quant = (x, None, False, None, None, True)
    assert not triton_quant.quant_fp8_supports(*quant)
    with pytest.raises(opmux.OpInputError, match=r"opmux::quant_fp8 \(provider 'native'\): "
                       r"argument 'use_ue8m0' expected False without group_size"):
        ops["quant_fp8"](*quant)


def test_quant_fp8_declines_on_gpus_without_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton lowers float8_e4m3fn for sm_89 and newer only: on an A100 native runs."""
    from opmux.plugins.cuda import triton_quant, triton_runtime

    x = torch.randn(2, 8)
    assert triton_runtime.cuda_capability(x) is None and triton_quant.quant_fp8_supports(x)
    for capability, accepted in (((8, 0), False), ((8, 6), False), ((8, 9), True),
                                 ((9, 0), True)):
        monkeypatch.setattr(triton_runtime, "cuda_capability", lambda t, c=capability: c)
        assert triton_quant.quant_fp8_supports(x) is accepted, capability
