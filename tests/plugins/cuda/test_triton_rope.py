"""Triton kernels of ``apply_rotary_emb`` and ``dual_chunk_rotary_embedding`` (interpreter on
CPU, or a GPU): errors and dispatch through opmux (the conformance cases run in
``test_triton_kernel_cases.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_refs import OpsFactory, close_outputs

import opmux
import opmux.ops
from opmux.core.errors import OpInputError
from opmux.ops.rotary import make_dual_chunk_caches
from opmux.testing import cases_for

pytestmark = pytest.mark.triton

KERNELS = "triton_rope"
"""The kernel module the ``k`` fixture (conftest) imports."""
OPS = ("apply_rotary_emb", "dual_chunk_rotary_embedding")


def test_errors(k: Any, device: torch.device) -> None:
    caches = make_dual_chunk_caches(24, 8, 64, 32, device=device)
    q, kk = torch.randn(3, 64, device=device), torch.randn(3, 32, device=device)
    pos = torch.tensor([1, 2, 3], device=device)
    # static errors: triton declines, native's check says why
    dual = (pos, q, kk.half(), *caches, 32)
    assert not k.dual_chunk_rotary_embedding_supports(*dual)
    with pytest.raises(OpInputError, match=r"provider 'native'.*'key' expected query's dtype"):
        opmux.ops.dual_chunk_rotary_embedding.native(*dual)
    if device.type == "cpu":  # ranges are data, read where that costs no device sync
        with pytest.raises(OpInputError, match=r"provider 'triton'.*\[0, 64\)"):
            k.dual_chunk_rotary_embedding(pos + 61, q, kk, *caches, 32)
    x = torch.randn(4, 2, 16, device=device)
    rot = (x, torch.randn(3, 8, device=device), torch.randn(4, 8, device=device))
    assert not k.apply_rotary_emb_supports(*rot)
    with pytest.raises(OpInputError, match=r"provider 'native'.*'cos' expected shape \[4, 8\]"):
        opmux.ops.apply_rotary_emb.native(*rot)


@pytest.fixture
def rope_ops(triton_ops_in: OpsFactory) -> dict[str, opmux.Op]:
    """The two ops in a fresh registry with provider ``triton`` first."""
    return triton_ops_in(OPS)


@pytest.mark.parametrize("wrap", [True, False], ids=["dispatcher", "eager"])
def test_dispatch_to_triton(rope_ops: dict[str, opmux.Op], device: torch.device,
                            wrap: bool) -> None:
    for name in OPS:
        op = rope_ops[name]
        args, _ = cases_for(name)[0].materialize(device)
        assert op.dispatch(*args).provider == "triton", op.explain(*args)
        with opmux.enable_torch_wrap(wrap):
            got = op(*args)
        want = op.native(*args)
        close_outputs(got, want, torch.float32)
