"""The ``cpp`` kernel of ``fused_moe``: agreement with native over the shapes that exercise its
tiles (row groups, row blocks, unit and column tails, odd widths), routing corner cases,
thread-count independence, its share of the work with ``grouped``, and its errors."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch

import opmux
from opmux.ops.moe import fused_moe, topk_softmax
from opmux.testing import conformance

pytestmark = pytest.mark.slow  # the session fixture compiles the extension on first use


@pytest.fixture(scope="session")
def k(cpp: Any) -> Any:
    from opmux.plugins.cpu import cpp_moe

    return cpp_moe


def _case(name: str, *, tokens: int, hidden: int, experts: int, inter: int, topk: int,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), topk)
    return x, w1, w2, weights, ids


_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize(("tokens", "hidden", "experts", "inter", "topk"), [
    (1, 16, 4, 8, 1),       # one row: the single-row tile
    (5, 24, 4, 7, 2),       # odd intermediate width: the last tile repeats a unit
    (9, 37, 3, 13, 2),      # widths that are not whole vectors: scalar tails
    (70, 64, 2, 32, 2),     # 70 rows per expert: token panels, leftover rows, prefetch
    (33, 200, 8, 50, 3),    # tails of a task: 200 hidden and 50 intermediate units
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_matches_native(k: Any, tokens: int, hidden: int, experts: int, inter: int, topk: int,
                        dtype: torch.dtype) -> None:
    args = _case(f"{tokens}-{hidden}-{experts}-{inter}-{topk}", tokens=tokens, hidden=hidden,
                 experts=experts, inter=inter, topk=topk, dtype=dtype)
    got = k.fused_moe(*args)
    want = fused_moe.native(*args)
    assert got.dtype == dtype and got.shape == want.shape
    rtol, atol = _TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_per_expert_cover_panels_and_leftover_rows(k: Any, dtype: torch.dtype) -> None:
    # per expert, rows that fill whole token panels, a half panel, a panel plus leftover rows,
    # and leftover rows only (panels hold 2 vectors of token lanes: 16 rows with AVX2); with
    # AVX-512 all rows are leftover rows, in groups of 4 and a last group of 1, 2 or 3
    counts = [8, 27, 5, 16, 0, 1, 33, 48, 6]
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(3))][:, None]
    x, w1, w2, _, _ = _case("panels", tokens=len(ids), hidden=40, experts=len(counts), inter=13,
                            topk=1, dtype=dtype)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4))
    rtol, atol = _TOL[dtype]
    torch.testing.assert_close(k.fused_moe(x, w1, w2, weights, ids),
                               fused_moe.native(x, w1, w2, weights, ids), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hidden", "inter"), [(40, 13), (1024, 512)])
def test_ragged_rows_per_expert_padded_panels(k: Any, dtype: torch.dtype, hidden: int,
                                              inter: int) -> None:
    # with AVX2, an expert whose last token panel would hold 9-15 rows runs it as a whole
    # panel with zero lanes (csrc/cpu/moe.cpp, kPadFrom): 9, 13, 15, 29 and 31 rows take it,
    # 8, 17 and 6 do not, and an expert with no rows sits between them; the ragged loads of
    # a 64-token batch (13-18 rows per expert) are among them
    counts = [9, 13, 0, 15, 16, 17, 29, 8, 31, 6, 14, 18]
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(5))]
    ids = ids.reshape(-1, 2)  # top-2: some tokens send both slots to one expert
    x, w1, w2, _, _ = _case(f"ragged-{hidden}", tokens=len(ids), hidden=hidden,
                            experts=len(counts), inter=inter, topk=1, dtype=dtype)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(6))
    got = k.fused_moe(x, w1, w2, weights, ids)
    rtol, atol = _TOL[dtype]
    torch.testing.assert_close(got, fused_moe.native(x, w1, w2, weights, ids), rtol=rtol,
                               atol=atol)
    if dtype == torch.float32:
        # against float64 (padding lanes must add nothing, not even a NaN)
        exact = fused_moe.native(*(t.double() for t in (x, w1, w2)), weights.double(), ids)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_topk_ties_and_strided_inputs(k: Any) -> None:
    x, w1, w2, _, _ = _case("ties", tokens=24, hidden=64, experts=4, inter=32, topk=2)
    # tied router scores: even tokens tie experts 1 and 2 (weights split evenly), odd tokens
    # tie all four experts
    logits = torch.zeros(24, 4)
    logits[::2, 1:3] = 1.0
    weights, ids = topk_softmax(logits, 2, True)
    assert torch.equal(ids[0].sort().values.long(), torch.tensor([1, 2]))
    assert weights[0, 0] == weights[0, 1]
    torch.testing.assert_close(k.fused_moe(x, w1, w2, weights, ids),
                               fused_moe.native(x, w1, w2, weights, ids))
    # views that are not contiguous: every-other hidden row, transposed weights, a column of
    # routing ids; the provider takes them (it copies to contiguous) and agrees with native
    wide = torch.randn(48, 64, generator=torch.Generator().manual_seed(7))
    w1_t = w1.transpose(1, 2).contiguous().transpose(1, 2)
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    ids_wide = torch.stack([ids[:, 1], ids[:, 0], ids[:, 0]], dim=1)[:, :2]
    weights_wide = torch.stack([weights[:, 1], weights[:, 0], weights[:, 0]], dim=1)[:, :2]
    args = (wide[::2], w1_t, w2_t, weights_wide, ids_wide)
    assert not any(t.is_contiguous() for t in args)
    assert opmux.get_op("fused_moe").dispatch(*args).provider == "cpp"
    torch.testing.assert_close(k.fused_moe(*args), fused_moe.native(*args))


def test_routing_corner_cases(k: Any) -> None:
    x, w1, w2, weights, ids = _case("corner", tokens=6, hidden=32, experts=5, inter=16, topk=2)
    # a token sending both slots to one expert, an unused expert, int32 and float64 routing
    ids = torch.tensor([[0, 0], [1, 3], [3, 1], [4, 4], [0, 1], [1, 0]], dtype=torch.int32)
    weights = weights.double()
    torch.testing.assert_close(k.fused_moe(x, w1, w2, weights, ids),
                               fused_moe.native(x, w1, w2, weights, ids))
    empty = (x[:0], w1, w2, weights[:0], ids[:0])
    assert k.fused_moe(*empty).shape == (0, 32)
    zero_k = (x, w1, w2, weights[:, :0], ids[:, :0])
    torch.testing.assert_close(k.fused_moe(*zero_k), fused_moe.native(*zero_k))


def test_thread_count_does_not_change_bits(k: Any) -> None:
    args = _case("threads", tokens=40, hidden=96, experts=4, inter=48, topk=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = k.fused_moe(*args)
        torch.set_num_threads(max(2, before))
        many = k.fused_moe(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_conformance_cases(k: Any) -> None:
    report = conformance.check_provider("fused_moe", "cpp")
    assert report.ok, report.format()
    # the kit's widths (hidden 64, intermediate 32) are whole tile steps: cpp takes every case,
    # bf16 included on CPUs with AMX tiles
    assert all(c.status == "pass" for c in report.cases), report.format()


def test_large_fp32_batches_go_to_grouped(k: Any) -> None:
    op = opmux.get_op("fused_moe")
    assert op.priority()[:2] == ["cpp", "grouped"]
    experts = 4
    limit = k.FP32_MAX_ROWS_PER_EXPERT * experts // 2  # tokens at the limit with top-2
    small = _case("small", tokens=limit, hidden=16, experts=experts, inter=8, topk=2)
    large = _case("large", tokens=limit + 1, hidden=16, experts=experts, inter=8, topk=2)
    assert op.dispatch(*small).provider == "cpp"
    assert op.dispatch(*large).provider == "grouped"
    # bf16 stays on cpp at any size, except on CPUs with AMX tiles (torch's bf16 matmuls,
    # which grouped calls, run on them there)
    bf16_provider = "grouped" if torch.cpu._is_amx_tile_supported() else "cpp"
    assert k.BF16_ON_TILES == torch.cpu._is_amx_tile_supported()
    for case in (small, large):
        as_bf16 = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in case)
        assert op.dispatch(*as_bf16).provider == bf16_provider
        half = tuple(t.half() if t.is_floating_point() else t for t in case)
        assert op.dispatch(*half).provider == "cpp"
    torch.testing.assert_close(op(*small), fused_moe.native(*small))
    # widths in whole tile steps (hidden and intermediate multiples of 32): bf16 on cpp
    # everywhere, on the tile path where the CPU has AMX
    tiled = _case("tiled", tokens=5, hidden=64, experts=experts, inter=32, topk=2,
                  dtype=torch.bfloat16)
    assert op.dispatch(*tiled).provider == "cpp"


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vector"])
@pytest.mark.parametrize(("counts", "hidden", "inter", "topk"), [
    ([1, 0, 2, 1], 32, 32, 1),                    # single rows, an unused expert
    ([16, 17, 15, 31, 32, 33, 48, 0], 64, 32, 1),  # whole, odd and paired chunks of 16
    ([40, 7, 70, 3], 96, 64, 2),                  # 3 hidden steps, 2 intermediate steps
    ([20, 30, 10, 40, 25, 15], 1024, 512, 2),     # the benchmark's widths
    ([9, 9, 9], 32, 96, 3),                       # a unit block that ends a step's first half
])
def test_bf16_amx_and_vector(k: Any, amx: bool, counts: list[int], hidden: int, inter: int,
                             topk: int) -> None:
    # bf16 with hidden and intermediate widths in whole steps of 32 takes the AMX tile path
    # where the CPU has AMX (csrc/cpu/moe.cpp, moe_amx), the vector path otherwise; both are
    # run on an AMX machine, and the switch reports what torch detects. `counts`: (token,
    # slot) rows per expert; with top-k > 1 a token may send several slots to one expert.
    switch = torch.ops.opmux_cpu.fused_moe_amx
    g = torch.Generator().manual_seed(sum(counts) * hidden + inter)
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])
    ids = ids[torch.randperm(len(ids), generator=g)].reshape(-1, topk)
    x, w1, w2, _, _ = _case(f"amx-{counts}", tokens=len(ids), hidden=hidden,
                            experts=len(counts), inter=inter, topk=1, dtype=torch.bfloat16)
    weights = torch.rand(ids.shape, generator=g)
    threads = torch.get_num_threads()
    try:
        assert switch(1 if amx else 0) == (amx and torch.cpu._is_amx_tile_supported())
        torch.set_num_threads(1)
        one = k.fused_moe(x, w1, w2, weights, ids)
        torch.set_num_threads(max(2, threads))
        got = k.fused_moe(x, w1, w2, weights, ids)
    finally:
        switch(1)
        torch.set_num_threads(threads)
    assert torch.equal(one, got)  # each output row is one task's work, whatever the threads
    want = fused_moe.native(x, w1, w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # against an fp32 computation of the same bf16 inputs, the error is the bf16 rounding of
    # the activations and of the result (native rounds more often)
    exact = fused_moe.native(*(t.float() for t in (x, w1, w2)), weights, ids)
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)


def test_errors_name_cpp(k: Any) -> None:
    x, w1, w2, weights, ids = _case("errors", tokens=3, hidden=16, experts=4, inter=8, topk=2)
    with pytest.raises(opmux.OpInputError, match=r"fused_moe \(provider 'cpp'\).*id 4") as info:
        k.fused_moe(x, w1, w2, weights, torch.full_like(ids, 4))
    assert info.value.argument == "topk_ids"
    with pytest.raises(opmux.OpInputError, match="provider 'cpp'"):
        k.fused_moe(x, w1.to(torch.bfloat16), w2, weights, ids)
    # the kernel guards its own memory accesses (an id the Python check did not see)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match=r"fused_moe \(provider 'cpp'\).*got id -1"):
        torch.ops.opmux_cpu.fused_moe_out(out, x, w1, w2, weights.float(),
                                          torch.full((3, 2), -1, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.opmux_cpu.fused_moe_out(out, x, w1.transpose(1, 2).contiguous().transpose(1, 2),
                                          w2, weights.float(), ids.long())
