"""MoE ops: routing semantics, fused_moe reference, the grouped CPU provider, errors."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import opmux
from opmux.ops.moe import fused_moe, grouped_topk, topk_softmax
from opmux.plugins.cpu import moe_ops
from opmux.plugins.cpu.moe_ops import fused_moe_grouped


class _Case:
    def __init__(self, args: tuple[torch.Tensor, ...]) -> None:
        self.args = args


def fused_moe_case(name: str, *, tokens: int, hidden: int, experts: int, intermediate: int,
                   topk: int, dtype: torch.dtype = torch.float32,
                   ids_dtype: torch.dtype = torch.int32,
                   skip_experts: tuple[int, ...] = ()) -> _Case:
    """Seeded fused_moe arguments; experts in ``skip_experts`` receive no token."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w1 = (torch.randn(experts, 2 * intermediate, hidden, generator=g) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, intermediate, generator=g)
          * intermediate ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    if skip_experts:
        logits[:, list(skip_experts)] = float("-inf")
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    return _Case((x, w1, w2, weights, ids.to(ids_dtype)))


def _per_token_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The definition, one token and one slot at a time (float64)."""
    inter = w1.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w1[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
    return out


# ------------------------------------------------------------------ routing
def test_topk_softmax_semantics() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.0]])
    weights, ids = topk_softmax(logits, 2, False)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 2], [2, 3]]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    weights_r, ids_r = topk_softmax(logits.to(torch.bfloat16), 2, True)
    assert ids_r.tolist() == ids.tolist()
    torch.testing.assert_close(weights_r.sum(-1), torch.ones(2))


def test_topk_softmax_errors() -> None:
    with pytest.raises(opmux.OpInputError,
                       match=r"opmux::topk_softmax \(provider 'native'\): argument 'topk' "
                             r"expected 1 <= topk <= 4 \(the number of experts\), got 5"):
        topk_softmax(torch.randn(3, 4), 5, False)
    with pytest.raises(opmux.OpInputError, match=r"'gating_output' expected a 2-D"):
        topk_softmax(torch.randn(4), 1, False)


def test_grouped_topk_keeps_only_best_groups() -> None:
    # 8 experts in 4 groups of 2; group maxima: g0 0.9, g1 0.2, g2 0.8, g3 0.7
    probs = torch.tensor([[0.9, 0.1, 0.2, 0.15, 0.8, 0.05, 0.7, 0.6]])
    logits = probs.log()  # softmax of log-probs = normalised probs: same order
    weights, ids = grouped_topk(logits, 3, False, 4, 2)
    assert sorted(ids[0].tolist()) == [0, 1, 4]  # only groups 0 and 2; not expert 6 (0.7)
    _, plain_ids = topk_softmax(logits, 3, False)
    assert 6 in plain_ids[0].tolist()  # plain top-k would have taken it
    torch.testing.assert_close(weights, torch.softmax(logits, -1).gather(1, ids.long()))
    w_renorm, _ = grouped_topk(logits, 3, True, 4, 2, routed_scaling_factor=2.0)
    torch.testing.assert_close(w_renorm.sum(-1), torch.tensor([2.0]))


def test_grouped_topk_bias_selects_but_does_not_weight() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.4]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # pushes expert 3 (and its group) in
    weights, ids = grouped_topk(logits, 1, False, 2, 1, "sigmoid", bias)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[0.4]])))


def test_grouped_topk_equals_topk_softmax_with_one_group() -> None:
    logits = torch.randn(11, 16, generator=torch.Generator().manual_seed(3))
    w1, i1 = grouped_topk(logits, 4, True, 1, 1)
    w2, i2 = topk_softmax(logits, 4, True)
    assert i1.tolist() == i2.tolist()
    torch.testing.assert_close(w1, w2)


@pytest.mark.parametrize(("args", "match"), [
    ((3, True, 3, 1), r"'num_expert_group' expected a positive divisor of the number of "
                      r"experts 8, got 3"),
    ((2, True, 4, 5), r"'topk_group' expected 1 <= topk_group <= 4, got 5"),
    ((5, True, 4, 2), r"'topk' expected at most topk_group \* experts per group = 4, got 5"),
    ((2, True, 4, 2, "relu"), r"'scoring_func' expected one of \['sigmoid', 'softmax'\], "
                              r"got 'relu'"),
    ((2, True, 4, 2, "softmax", torch.zeros(3)), r"'e_score_correction_bias' expected "
                                                  r"shape \(8,\), got shape \(3,\)"),
])
def test_grouped_topk_errors(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(opmux.OpInputError,
                       match=r"opmux::grouped_topk \(provider 'native'\): .*" + match):
        grouped_topk(torch.randn(2, 8), *args)


# ---------------------------------------------------------------- fused_moe
def test_fused_moe_reference_matches_definition() -> None:
    case = fused_moe_case("def", tokens=6, hidden=8, experts=4, intermediate=5, topk=2)
    x, w1, w2, weights, ids = case.args
    got = fused_moe(x, w1, w2, weights, ids)
    want = _per_token_reference(x, w1, w2, weights, ids)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32 and got.shape == x.shape


@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("tokens", [1, 37])
def test_grouped_provider_matches_native(experts: int, topk: int, tokens: int) -> None:
    case = fused_moe_case(f"grouped-{experts}-{topk}-{tokens}", tokens=tokens, hidden=48,
                          experts=experts, intermediate=40, topk=topk)
    got = fused_moe_grouped(*case.args)
    want = fused_moe.native(*case.args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_grouped_provider_with_grouped_topk_routing() -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(29, 32, generator=g)
    w1 = torch.randn(16, 48, 32, generator=g) * 0.2
    w2 = torch.randn(16, 32, 24, generator=g) * 0.2
    weights, ids = grouped_topk(torch.randn(29, 16, generator=g), 4, True, 4, 2, "sigmoid",
                                torch.randn(16, generator=g) * 0.1, 1.5)
    torch.testing.assert_close(fused_moe_grouped(x, w1, w2, weights, ids),
                               fused_moe.native(x, w1, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_provider_low_precision(dtype: torch.dtype) -> None:
    case = fused_moe_case(f"lp-{dtype}", tokens=21, hidden=64, experts=8, intermediate=32,
                          topk=2, dtype=dtype)
    got = fused_moe_grouped(*case.args)
    assert got.dtype == dtype
    want = _per_token_reference(*case.args)
    torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(got, fused_moe.native(*case.args), atol=3e-2, rtol=3e-2)


def test_grouped_provider_edge_cases() -> None:
    idle = fused_moe_case("idle", tokens=10, hidden=16, experts=8, intermediate=8, topk=2,
                          skip_experts=(0, 5, 7))
    assert not set(idle.args[4].flatten().tolist()) & {0, 5, 7}
    torch.testing.assert_close(fused_moe_grouped(*idle.args), fused_moe.native(*idle.args))
    wide = fused_moe_case("i64", tokens=4, hidden=16, experts=4, intermediate=8, topk=2,
                          ids_dtype=torch.int64)
    torch.testing.assert_close(fused_moe_grouped(*wide.args), fused_moe.native(*wide.args))
    empty = fused_moe_case("empty", tokens=0, hidden=16, experts=4, intermediate=8, topk=2)
    assert fused_moe_grouped(*empty.args).shape == (0, 16)
    assert fused_moe.native(*empty.args).shape == (0, 16)


@pytest.mark.parametrize("provider", ["native", "grouped"])
def test_fused_moe_errors(provider: str) -> None:
    case = fused_moe_case("err", tokens=3, hidden=8, experts=4, intermediate=6, topk=2)
    x, w1, w2, weights, ids = case.args

    def expect(match: str, *args: torch.Tensor) -> None:
        # grouped's supports_args declines what native's static check refuses; such a call
        # runs native, whose check gives the error. Expert ids are data: grouped checks them.
        taker, impl = provider, fused_moe_grouped
        if provider == "native" or not moe_ops.fused_moe_args_ok(*args):
            taker, impl = "native", fused_moe.native
        with pytest.raises(opmux.OpInputError, match=rf"opmux::fused_moe \(provider "
                           rf"'{taker}'\): argument " + match):
            impl(*args)

    expect(r"'w2' expected shape \(4, 8, 6\)", x, w1, w2[:, :, :5], weights, ids)
    expect(r"'topk_ids' expected dtype torch.int32 or torch.int64", x, w1, w2, weights,
           ids.float())
    expect(r"'w1' expected dtype torch.float32 .*got torch.bfloat16", x, w1.bfloat16(), w2,
           weights, ids)
    expect(r"'topk_weights' expected shape \(3, 2\)", x, w1, w2, weights[:, :1], ids)
    expect(r"'hidden_states' expected a 2-D", x[None], w1, w2, weights, ids)
    bad = ids.clone()
    bad[1, 0] = 4
    assert moe_ops.fused_moe_args_ok(x, w1, w2, weights, bad)
    expect(r"'topk_ids' expected expert ids in \[0, 4\), got id 4", x, w1, w2, weights, bad)
    bad[1, 0] = -1
    expect(r"'topk_ids'.*got id -1", x, w1, w2, weights, bad)


def test_moe_mixed_devices_and_non_tensors_are_input_errors() -> None:
    # a meta tensor among CPU tensors would otherwise run the fake: uninitialised memory
    opmux.load_plugins()
    case = fused_moe_case("dev", tokens=3, hidden=8, experts=4, intermediate=6, topk=2)
    x, w1, w2, weights, ids = case.args
    for args, argument in (((x, w1.to("meta"), w2, weights, ids), "w1"),
                           ((x, w1, w2, weights, ids.to("meta")), "topk_ids"),
                           ((x, w1, None, weights, ids), "w2")):
        with pytest.raises(opmux.OpInputError) as info:
            fused_moe(*args)
        assert info.value.argument == argument
        assert info.value.op == "opmux::fused_moe" and info.value.provider is not None
        # grouped declines them (its supports_args is native's static check)
        assert not moe_ops.fused_moe_args_ok(*args)
    logits = torch.randn(2, 8)
    with pytest.raises(opmux.OpInputError, match=r"'e_score_correction_bias' expected device "
                                                 r"cpu .*got meta") as info:
        grouped_topk(logits, 2, True, 4, 2, "sigmoid", torch.zeros(8, device="meta"))
    assert info.value.op == "opmux::grouped_topk"
    with pytest.raises(opmux.OpInputError, match=r"'e_score_correction_bias' expected a "
                                                 r"floating-point tensor"):
        grouped_topk(logits, 2, True, 4, 2, "sigmoid", torch.zeros(8, dtype=torch.int64))
    with pytest.raises(opmux.OpInputError, match=r"'gating_output' expected a torch.Tensor"):
        topk_softmax(None, 1, False)  # type: ignore[arg-type]


def test_register_dispatches_to_grouped_on_cpu() -> None:
    opmux.load_plugins()
    op = opmux.get_op("fused_moe")
    if moe_ops.PROVIDER not in op.impls:  # the cpu plugin wires it in; else do it here
        moe_ops.register(opmux.global_registry())
    impl = op.impls[moe_ops.PROVIDER]
    assert (impl.dispatch_key, impl.supported, impl.fn) == ("CPU", True, fused_moe_grouped)
    case = fused_moe_case("dispatch", tokens=9, hidden=16, experts=4, intermediate=8, topk=2)
    with op.set_priority([moe_ops.PROVIDER, "native"]):
        assert op.dispatch(*case.args).provider == moe_ops.PROVIDER
        torch.testing.assert_close(op(*case.args), fused_moe.native(*case.args))
    with op.set_priority(["native"]):
        assert op.dispatch(*case.args).provider == "native"


def test_conformance_kit_cases() -> None:
    from opmux.testing import cases_for, check_provider, run_opcheck

    opmux.load_plugins()
    op = opmux.get_op("fused_moe")
    if moe_ops.PROVIDER not in op.impls:
        moe_ops.register(opmux.global_registry())
    assert len(cases_for("fused_moe")) >= 3
    report = check_provider("fused_moe", moe_ops.PROVIDER)
    assert report.ok, [(c.name, c.message) for c in report.cases if c.status != "pass"]
    for name in ("topk_softmax", "grouped_topk", "fused_moe"):
        results = run_opcheck(name, cases=cases_for(name)[:3])
        bad = {case: r for case, r in results.items()
               if any(v != "SUCCESS" for v in r.values())}
        assert not bad, bad


def test_ops_compile_fullgraph() -> None:
    case = fused_moe_case("compile", tokens=7, hidden=16, experts=4, intermediate=8, topk=2)
    x, w1, w2, _, _ = case.args
    logits = torch.randn(7, 4)

    def block(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_softmax(logits, 2, True)
        return fused_moe(x * 1.0, w1, w2, weights, ids)

    explanation = torch._dynamo.explain(block)(x, logits)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, logits), block(x, logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_provider_batched_layout(dtype: torch.dtype) -> None:
    """Every expert active with short, uneven segments: the padded all-experts layout;
    strided weights too."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(9, 32, generator=g).to(dtype)
    w1 = (torch.randn(6, 32, 40, generator=g) * 0.2).to(dtype).transpose(1, 2)  # strided
    w2 = (torch.randn(6, 32, 20, generator=g) * 0.2).to(dtype)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [0, 2], [0, 4], [0, 5], [1, 3], [2, 0],
                        [0, 3]], dtype=torch.int32)  # expert 0: 6 rows, others 2-3
    weights = torch.softmax(torch.randn(9, 2, generator=g), -1)
    got = fused_moe_grouped(x, w1, w2, weights, ids)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), _per_token_reference(x, w1, w2, weights, ids),
                               atol=tol, rtol=tol)
