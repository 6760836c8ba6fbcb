"""The ``cpp`` kernels of ``apply_rotary_emb`` and ``dual_chunk_rotary_embedding`` against the
native references, on every conformance case, plus what they decline and reject."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import opmux
from opmux.core.errors import OpInputError
from opmux.ops.rotary import make_dual_chunk_caches
from opmux.testing import TOLERANCES, Case, cases_for

pytestmark = pytest.mark.slow  # the session fixture compiles the extension on first use

OPS = ("apply_rotary_emb", "dual_chunk_rotary_embedding")


def _all_cases() -> list[tuple[str, Case]]:
    return [(name, c) for name in OPS for c in cases_for(name)]


@pytest.mark.parametrize("name,case", _all_cases(), ids=lambda v: v if isinstance(v, str)
                         else v.name)
def test_kernel_matches_native_or_declines(cpp: Any, name: str, case: Case) -> None:
    native = opmux.get_op(name).impls["native"].fn
    fn, supports = cpp.OPS[name]
    args, _ = case.materialize("cpu")
    if not supports(*args):
        # only layouts the kernel does not read are declined: non-contiguous or int32 indices
        assert any(isinstance(a, torch.Tensor) and (not a.is_contiguous() or a.dtype ==
                                                    torch.int32) for a in args), case.name
        return
    got = fn(*args)
    want = native(*args)
    atol, rtol = TOLERANCES[case.tolerance_dtype() or torch.float32]
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol)


def test_apply_rotary_emb_large_heads_and_rows(cpp: Any) -> None:
    """Many rows across threads, head sizes with vector tails (gptj: pairs past kF)."""
    native = opmux.get_op("apply_rotary_emb").impls["native"].fn
    for d in (80, 128, 34):
        x = torch.randn(3, 33, 5, d)
        ang = torch.rand(33, d // 2) * 6.3
        for neox in (True, False):
            torch.testing.assert_close(cpp.apply_rotary_emb(x, ang.cos(), ang.sin(), neox),
                                       native(x, ang.cos(), ang.sin(), neox), atol=2e-5,
                                       rtol=2e-5)


def test_dual_chunk_rejects_out_of_range_positions(cpp: Any) -> None:
    caches = make_dual_chunk_caches(24, 8, 64, 32)
    q, k = torch.randn(3, 64), torch.randn(3, 32)
    with pytest.raises(OpInputError, match=r"provider 'cpp'.*outside \[0, 64\)"):
        cpp.dual_chunk_rotary_embedding(torch.tensor([1, 64, 2]), q, k, *caches, 32, True, None)
    with pytest.raises(OpInputError, match=r"outside \[0, 64\)"):
        cpp.dual_chunk_rotary_embedding(torch.tensor([1, 3, 2]), q, k, *caches, 32, True,
                                        torch.tensor([0, 0, -3]))


def test_apply_rotary_emb_rejects_bad_tables(cpp: Any) -> None:
    with pytest.raises(OpInputError, match=r"provider 'cpp'.*cos and sin must be \[4, 8\]"):
        cpp.apply_rotary_emb(torch.randn(4, 2, 16), torch.randn(4, 4), torch.randn(4, 4))


def test_dispatch_reaches_cpp(cpp: Any) -> None:
    opmux.load_plugins()
    op = opmux.get_op("dual_chunk_rotary_embedding")
    caches = make_dual_chunk_caches(24, 8, 64, 32)
    args = (torch.arange(5), torch.randn(5, 64), torch.randn(5, 32), *caches, 32)
    assert op.dispatch(*args).provider == "cpp", op.explain(*args)
    ap = opmux.get_op("apply_rotary_emb")
    x = torch.randn(4, 2, 16)
    assert ap.dispatch(x, torch.randn(4, 8), torch.randn(4, 8)).provider == "cpp"
    assert ap.dispatch(x.transpose(0, 1), torch.randn(2, 8), torch.randn(2, 8)
                       ).provider == "native"  # non-contiguous x is declined
