"""Triton kernels of ``encoder_attention``, ``concat_and_cache_mla`` and ``mla_attention``
(interpreter on CPU, or a GPU) against the native references on every conformance case, and
their input errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_refs import close

import opmux
import opmux.ops
from opmux.testing import Case, cases_for

pytestmark = pytest.mark.triton

OPS = ("encoder_attention", "concat_and_cache_mla", "mla_attention")


@pytest.fixture(scope="module")
def k() -> Any:
    from opmux.plugins.cuda import triton_attention

    return triton_attention


def _all_cases() -> list[tuple[str, Case]]:
    # the interpreter runs a program at a time: the long and wide cases stay on the GPU lane
    return [(name, c) for name in OPS for c in cases_for(name)
            if torch.cuda.is_available() or not any(w in c.name for w in ("long", "wide"))]


@pytest.mark.parametrize("name,case", _all_cases(), ids=lambda v: v if isinstance(v, str)
                         else v.name)
def test_kernel_matches_native(k: Any, device: torch.device, name: str, case: Case) -> None:
    args, _ = case.materialize(device)
    fn, supports = getattr(k, name), getattr(k, f"{name}_supports")
    assert supports(*args), case.name   # strided views and int64 offsets are read in place
    if name == "concat_and_cache_mla":
        want_cache = args[2].clone()
        getattr(opmux.ops, name).native(args[0], args[1], want_cache, args[3])
        fn(*args)
        assert torch.equal(args[2], want_cache)
        return
    got = fn(*args)
    want = getattr(opmux.ops, name).native(*args)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    close(got, want, case.tolerance_dtype() or torch.float32)


def test_errors(k: Any, device: torch.device) -> None:
    q = torch.randn(6, 4, 8, device=device)
    cu = torch.tensor([0, 4, 3], dtype=torch.int32, device=device)
    with pytest.raises(opmux.OpInputError, match=r"opmux::encoder_attention \(provider "
                       r"'triton'\): argument 'cu_seqlens' expected non-decreasing"):
        k.encoder_attention(q, q, q, cu, None, 0.5)
    # a shape error: triton declines, native's check says why
    cache = torch.zeros(2, 4, 12, device=device)
    args = (torch.ones(2, 8, device=device), torch.ones(2, 5, device=device), cache,
            torch.tensor([0, 1], device=device))
    assert not k.concat_and_cache_mla_supports(*args)
    with pytest.raises(opmux.OpInputError, match=r"concat_and_cache_mla \(provider 'native'\)"
                                                 r".*'k_pe' expected \[2, 4\]"):
        opmux.ops.concat_and_cache_mla.native(*args)
    assert not cache.any()
