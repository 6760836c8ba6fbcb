"""GroupedTopk: both forward paths against a per-token reference, errors, fullgraph."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import Tensor

import opmux
from opmux.layers import GroupedTopk

E, GROUPS = 16, 4


def _reference(logits: Tensor, topk: int, renormalize: bool, topk_group: int,
               scoring_func: str, bias: Optional[Tensor], scale: float
               ) -> tuple[Tensor, Tensor]:
    """Per token: score, rank groups, keep the best groups, pick experts there (float64)."""
    per = E // GROUPS
    weights, ids = [], []
    for row in logits.double():
        scores = row.softmax(-1) if scoring_func == "softmax" else row.sigmoid()
        choice = scores + bias.double() if bias is not None else scores
        group_score = [sorted(choice[g * per:(g + 1) * per].tolist())[-2:] if bias is not None
                       else [max(choice[g * per:(g + 1) * per].tolist())]
                       for g in range(GROUPS)]
        ranked = sorted(range(GROUPS), key=lambda g: -sum(group_score[g]))[:topk_group]
        candidates = [e for e in range(E) if e // per in ranked]
        chosen = sorted(candidates, key=lambda e: -float(choice[e]))[:topk]
        w = scores[chosen]
        if renormalize:
            w = w / w.sum()
        weights.append(w * scale)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


def _sorted(weights: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    order = ids.long().argsort(-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("scoring_func", "use_bias", "renormalize", "scale"), [
    ("softmax", False, True, 1.0), ("sigmoid", True, True, 2.5), ("sigmoid", False, False, 1.0)])
def test_grouped_topk_enabled_and_disabled(fresh_custom_ops: None, dtype: torch.dtype,
                                           scoring_func: str, use_bias: bool,
                                           renormalize: bool, scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(11, E, generator=gen).to(dtype)
    hidden = torch.randn(11, 8, generator=gen).to(dtype)
    bias = torch.randn(E, generator=gen) * 0.1 if use_bias else None
    kwargs = {"topk": 3, "renormalize": renormalize, "num_expert_group": GROUPS,
              "topk_group": 2, "scoring_func": scoring_func, "routed_scaling_factor": scale}
    want_w, want_ids = _reference(logits, 3, renormalize, 2, scoring_func, bias, scale)
    on = GroupedTopk(**kwargs)  # type: ignore[arg-type]
    opmux.set_custom_ops("all,-grouped_topk")
    off = GroupedTopk(**kwargs)  # type: ignore[arg-type]
    for layer in (on, off):
        weights, ids = layer(hidden, logits, bias)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32
        got_w, got_ids = _sorted(weights, ids)
        ref_w, ref_ids = _sorted(want_w, want_ids)
        assert torch.equal(got_ids, ref_ids)
        torch.testing.assert_close(got_w.double(), ref_w, atol=1e-6, rtol=1e-5)
    counts = opmux.custom_op_counts()
    assert counts["enabled"]["grouped_topk"] == 1 and counts["disabled"]["grouped_topk"] == 1


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_expert_group": 0}, "num_expert_group must be >= 1, got 0"),
    ({"topk_group": 5}, r"topk_group must be in \[1, num_expert_group=4\], got 5"),
    ({"scoring_func": "tanh"}, "scoring_func must be 'softmax' or 'sigmoid'"),
    ({"num_fused_shared_experts": 1}, "num_fused_shared_experts must be 0"),
])
def test_grouped_topk_config_errors(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"topk": 2, "renormalize": True, "num_expert_group": 4,
                               "topk_group": 2}
    args.update(kwargs)
    with pytest.raises(opmux.ConfigError, match=match):
        GroupedTopk(**args)  # type: ignore[arg-type]


def test_grouped_topk_token_mismatch() -> None:
    router = GroupedTopk(2, True, 4, 2)
    with pytest.raises(opmux.OpInputError, match="argument 'gating_output' expected 3 rows"):
        router(torch.randn(3, 8), torch.randn(4, E))


def test_grouped_topk_compiles_fullgraph() -> None:
    router = GroupedTopk(2, True, 4, 2, scoring_func="sigmoid")
    gate = torch.nn.Linear(8, E, bias=False)

    def route(x: Tensor) -> tuple[Tensor, Tensor]:
        return router(x, gate(x))  # type: ignore[no-any-return]

    x = torch.randn(5, 8)
    explanation = torch._dynamo.explain(route)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    got = torch.compile(route, fullgraph=True, backend="eager")(x)
    want = route(x)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
