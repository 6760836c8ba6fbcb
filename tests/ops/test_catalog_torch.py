"""torch integration of the catalog: torch.library.opcheck and torch.compile(fullgraph)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import opmux
from opmux.ops.rotary import make_cos_sin_cache
from opmux.testing import Case, cases_for, run_opcheck
from opmux.testing.attention_cases import attention_case

CATALOG = ["advance_step_flashattn", "fused_add_rms_norm", "gelu_and_mul", "paged_attention",
           "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul"]
_EDGE_WORDS = ("empty", "window-softcap", "padding", "qlen0", "gptj", "3d", "partial")


def _subset(cases: list[Case]) -> list[Case]:
    """A few representative cases: the first one, one per dtype, and the edge cases."""
    seen: set[str] = set()
    keep = []
    for c in cases:
        prefix = c.name.split("-")[0]
        if prefix not in seen or any(w in c.name for w in _EDGE_WORDS):
            seen.add(prefix)
            keep.append(c)
    return keep[:4]


@pytest.mark.parametrize("name", CATALOG)
def test_opcheck_every_catalog_op(name: str) -> None:
    op = opmux.get_op(name)
    results = run_opcheck(op, cases=_subset(cases_for(name)))
    assert results
    for per_case in results.values():
        assert set(per_case.values()) == {"SUCCESS"}, per_case


@pytest.mark.parametrize("name", CATALOG)
def test_opcheck_native_kernel(name: str) -> None:
    op = opmux.get_op(name)
    with op.set_priority(["native"]):
        results = run_opcheck(op, cases=cases_for(name)[:1],
                              test_utils=("test_schema", "test_faketensor"))
    assert set(next(iter(results.values())).values()) == {"SUCCESS"}


def _block(x, residual, w, positions, cache, kc, vc, slots, tables, lens, qsl):  # type: ignore[no-untyped-def]
    ops = opmux.ops
    h, new_res = ops.fused_add_rms_norm(x, residual, w, 1e-6)
    h = ops.rms_norm(h, w, 1e-6)
    t = h.shape[0]
    q, k = ops.rotary_embedding(positions, h, h[:, :64], cache, 32, True)
    ops.reshape_and_cache(k.view(t, 2, 32), h[:, 64:128].reshape(t, 2, 32), kc, vc, slots)
    attn = ops.paged_attention(q.view(t, 4, 32), kc, vc, tables, lens, qsl, 32 ** -0.5, None,
                               None)
    return ops.silu_and_mul(attn.view(t, 128)) + ops.gelu_and_mul(new_res, "tanh")


def test_compile_fullgraph_over_a_block_has_no_graph_break() -> None:


    g = torch.Generator().manual_seed(0)
    t = 6
    x, residual = torch.randn(t, 128, generator=g), torch.randn(t, 128, generator=g)
    w = torch.randn(128, generator=g)
    positions = torch.arange(t)
    cache = make_cos_sin_cache(16, 32)
    tables = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([4, 2], dtype=torch.int32)
    qsl = torch.tensor([0, 4, 6], dtype=torch.int32)
    slots = torch.tensor([32, 33, 34, 35, 16, 17])

    def inputs():  # type: ignore[no-untyped-def]
        kc = torch.zeros(4, 16, 2, 32)
        return (x, residual, w, positions, cache, kc, torch.zeros_like(kc), slots, tables, lens,
                qsl)

    eager_args = inputs()
    want = _block(*eager_args)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_block)(*inputs())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(_block, fullgraph=True, backend="eager")
    comp_args = inputs()
    got = compiled(*comp_args)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(comp_args[5], eager_args[5])  # the cache write happened
    torch._dynamo.reset()


def test_compile_advance_step_and_attention_decode() -> None:


    case = attention_case("compile", q_lens=[1, 1], kv_lens=[5, 20])
    compiled = torch.compile(opmux.ops.paged_attention, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*case.args), opmux.ops.paged_attention.native(*case.args))

    def step(tokens, sampled, pos, lens, slots, tables):  # type: ignore[no-untyped-def]
        opmux.ops.advance_step_flashattn(2, 2, 16, tokens, sampled, pos, lens, slots, tables)
        return pos + 1

    state = (torch.zeros(2, dtype=torch.int64), torch.tensor([[3], [4]]),
             torch.zeros(2, dtype=torch.int64), torch.tensor([5, 20], dtype=torch.int32),
             torch.zeros(2, dtype=torch.int64), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    out = torch.compile(step, fullgraph=True, backend="eager")(*state)
    assert out.tolist() == [6, 21]
    assert state[4].tolist() == [5, 3 * 16 + 4]
    torch._dynamo.reset()
