"""Triton kernels of ``ssd_chunk_scan`` and ``ssd_state_update`` (interpreter on CPU, or a
GPU) against the per-token reference, directly and through opmux dispatch (the conformance
cases run in ``test_triton_kernel_cases.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_refs import OpsFactory, close

import opmux
import opmux.ops
from opmux.core.errors import OpInputError
from opmux.testing.ssd_cases import ssd_inputs
from opmux.testing.ssd_reference import sequential_ssd

pytestmark = pytest.mark.triton

KERNELS = "triton_ssd"
"""The kernel module the ``k`` fixture (conftest) imports."""
OPS = ("ssd_chunk_scan", "ssd_state_update")


def test_scan_then_decode_matches_sequential(k: Any, device: torch.device) -> None:
    i = ssd_inputs("triton-seq", [5, 3], dtype=torch.bfloat16)
    want, want_state = sequential_ssd(i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"],
                                      i["state_indices"], i["query_start_loc"],
                                      i["has_initial_state"], i["D"], i["z"], i["dt_bias"],
                                      True)
    dev = {n: t.to(device) for n, t in i.items()}
    state = dev["ssm_state"].clone()
    prompt = torch.tensor([0, 1, 2, 3, 5, 6], device=device)
    y = k.ssd_chunk_scan(dev["x"][prompt], dev["dt"][prompt], dev["A"], dev["B"][prompt],
                         dev["C"][prompt], state, dev["state_indices"],
                         torch.tensor([0, 4, 6], device=device), dev["has_initial_state"],
                         dev["D"], dev["z"][prompt], dev["dt_bias"], True)
    close(y.cpu(), want[prompt.cpu()], torch.bfloat16)
    rows = torch.tensor([4, 7], device=device)
    y = k.ssd_state_update(dev["x"][rows], dev["dt"][rows], dev["A"], dev["B"][rows],
                           dev["C"][rows], state, dev["state_indices"], dev["D"],
                           dev["z"][rows], dev["dt_bias"], True)
    close(y.cpu(), want[rows.cpu()], torch.bfloat16)
    close(state.cpu(), want_state, torch.float32)


def test_errors(k: Any, device: torch.device) -> None:
    i = {n: t.to(device) for n, t in ssd_inputs("triton-errors", [2, 2]).items()}
    base = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"])
    # a shape error: triton declines, native's check says why
    bad = (*base[:4], i["C"][:, :1], i["ssm_state"], i["state_indices"], i["query_start_loc"])
    assert not k.ssd_chunk_scan_supports(*bad)
    with pytest.raises(OpInputError, match=r"provider 'native'.*'C' expected shape"):
        opmux.ops.ssd_chunk_scan.native(*bad)
    if device.type == "cpu":  # index values are read where that costs no device sync
        with pytest.raises(OpInputError, match=r"provider 'triton'.*values in \[0, 4\)"):
            k.ssd_chunk_scan(*base, torch.tensor([0, 9]), i["query_start_loc"])


@pytest.fixture
def triton_ssd_ops(triton_ops_in: OpsFactory) -> dict[str, opmux.Op]:
    return triton_ops_in(OPS)


def test_dispatch_selects_triton(triton_ssd_ops: dict[str, opmux.Op],
                                 device: torch.device) -> None:
    i = {n: t.to(device) for n, t in ssd_inputs("triton-dispatch", [3, 1]).items()}
    op = triton_ssd_ops["ssd_chunk_scan"]
    args = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_state"], i["state_indices"],
            i["query_start_loc"])
    assert op.dispatch(*args).provider == "triton"
    ref_state = i["ssm_state"].clone()
    got = op(*args)
    want = opmux.ops.ssd_chunk_scan.native(*args[:5], ref_state, *args[6:])
    close(got, want, torch.float32)
    close(i["ssm_state"], ref_state, torch.float32)
