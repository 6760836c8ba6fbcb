"""Triton kernels of ``ssd_chunk_scan`` and ``ssd_state_update`` (interpreter on CPU, or a
GPU) against the native references and the per-token reference, directly and through
opmux dispatch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from cuda_refs import close

import opmux
import opmux.ops
from opmux.core.errors import OpInputError
from opmux.testing import Case, cases_for
from opmux.testing.ssd_cases import ssd_inputs
from opmux.testing.ssd_reference import sequential_ssd

pytestmark = pytest.mark.triton

OPS = ("ssd_chunk_scan", "ssd_state_update")


@pytest.fixture(scope="module")
def k() -> Any:
    from opmux.plugins.cuda import triton_ssd

    return triton_ssd


def _all_cases() -> list[tuple[str, Case]]:
    return [(name, c) for name in OPS for c in cases_for(name)]


@pytest.mark.parametrize("name,case", _all_cases(), ids=lambda v: v if isinstance(v, str)
                         else v.name)
def test_kernel_matches_native(k: Any, device: torch.device, name: str, case: Case) -> None:
    args, kwargs = case.materialize(device)
    ref_args, ref_kwargs = case.materialize("cpu")
    assert getattr(k, f"{name}_supports")(*args, **kwargs)  # strided inputs are read in place
    got = getattr(k, name)(*args, **kwargs)
    want = getattr(opmux.ops, name).native(*ref_args, **ref_kwargs)
    dtype = case.tolerance_dtype() or torch.float32
    assert got.shape == want.shape and got.dtype == want.dtype
    close(got, want, dtype)
    close(args[5], ref_args[5], dtype)  # the state cache, every slot


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
    with pytest.raises(OpInputError, match=r"provider 'triton'.*'C' expected shape"):
        k.ssd_chunk_scan(*base[:4], i["C"][:, :1], i["ssm_state"], i["state_indices"],
                         i["query_start_loc"])
    if device.type == "cpu":  # index values are read where that costs no device sync
        with pytest.raises(OpInputError, match=r"provider 'triton'.*values in \[0, 4\)"):
            k.ssd_chunk_scan(*base, torch.tensor([0, 9]), i["query_start_loc"])


@pytest.fixture
def triton_ssd_ops(registry: opmux.OpRegistry, ns: str,
                   device: torch.device) -> Iterator[dict[str, opmux.Op]]:
    from opmux.plugins.cuda import triton_ops

    ops = {}
    for name in OPS:
        src = getattr(opmux.ops, name)
        ops[name] = registry.register_op(src.native, name=name, namespace=ns,
                                         mutates_args=src.mutates_args)
    done = triton_ops.register(registry, "CUDA" if device.type == "cuda" else "CPU")
    assert sorted(done) == sorted(f"{n}:triton" for n in OPS)
    for op in ops.values():
        op.set_default_priority(["triton", "native"])
    yield ops


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
