"""Bad inputs of the mixture-of-experts ops: ``topk_softmax``, ``grouped_topk`` and
``fused_moe``.

Registered by :func:`register_moe_bad_inputs` (called by :mod:`opmux.testing.bad_inputs`). Every
row is refused by native and by every provider with an :class:`opmux.OpInputError` naming the
argument in the row."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from opmux.testing.bad_input_table import BadInput, register_bad_inputs, row_randn, variants

__all__ = [
    "fused_moe_bad_inputs", "grouped_topk_bad_inputs", "register_moe_bad_inputs",
    "topk_softmax_bad_inputs",
]

_META = torch.device("meta")


def topk_softmax_bad_inputs() -> Iterator[BadInput]:
    """Rows of ``topk_softmax`` (5 tokens, 8 experts, top 2)."""
    logits = row_randn(31, 5, 8)
    base: dict[str, Any] = {"gating_output": logits, "topk": 2, "renormalize": True}
    yield from variants(base, [
        ("gating_output-none", "gating_output", {"gating_output": None}),
        ("gating_output-1d", "gating_output", {"gating_output": logits[0]}),
        ("gating_output-3d", "gating_output", {"gating_output": logits[None]}),
        ("gating_output-int", "gating_output", {"gating_output": logits.long()}),
        ("topk-zero", "topk", {"topk": 0}),
        ("topk-above-experts", "topk", {"topk": 9}),
    ])


def grouped_topk_bad_inputs() -> Iterator[BadInput]:
    """Rows of ``grouped_topk`` (5 tokens, 8 experts in 4 groups, top 2 of 2 groups)."""
    logits = row_randn(32, 5, 8)
    base: dict[str, Any] = {
        "gating_output": logits, "topk": 2, "renormalize": True, "num_expert_group": 4,
        "topk_group": 2, "scoring_func": "sigmoid", "e_score_correction_bias": row_randn(33, 8),
        "routed_scaling_factor": 2.5}
    yield from variants(base, [
        ("gating_output-none", "gating_output", {"gating_output": None}),
        ("gating_output-int", "gating_output", {"gating_output": logits.int()}),
        ("topk-zero", "topk", {"topk": 0}),
        ("topk-above-selected-groups", "topk", {"topk": 5}),
        ("num_expert_group-not-divisor", "num_expert_group", {"num_expert_group": 3}),
        ("num_expert_group-zero", "num_expert_group", {"num_expert_group": 0}),
        ("topk_group-zero", "topk_group", {"topk_group": 0}),
        ("topk_group-above-groups", "topk_group", {"topk_group": 5}),
        ("scoring_func-unknown", "scoring_func", {"scoring_func": "relu"}),
        ("bias-shape", "e_score_correction_bias", {"e_score_correction_bias": row_randn(34, 4)}),
        ("bias-2d", "e_score_correction_bias", {"e_score_correction_bias": row_randn(35, 1, 8)}),
        ("bias-int", "e_score_correction_bias",
         {"e_score_correction_bias": torch.zeros(8, dtype=torch.int64)}),
        ("bias-meta", "e_score_correction_bias",
         {"e_score_correction_bias": torch.zeros(8, device=_META)}),
        ("routed_scaling_factor-nan", "routed_scaling_factor",
         {"routed_scaling_factor": float("nan")}),
    ])


def fused_moe_bad_inputs() -> Iterator[BadInput]:
    """Rows of ``fused_moe`` (4 tokens, hidden 8, 4 experts, intermediate 6, top 2)."""
    x = row_randn(41, 4, 8)
    w1, w2 = row_randn(42, 4, 12, 8), row_randn(43, 4, 8, 6)
    weights = torch.softmax(row_randn(44, 4, 2), -1)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], dtype=torch.int32)
    base: dict[str, Any] = {"hidden_states": x, "w1": w1, "w2": w2, "topk_weights": weights,
                            "topk_ids": ids}
    out_of_range = ids.clone()
    out_of_range[2, 1] = 4
    negative = ids.clone()
    negative[0, 0] = -1
    yield from variants(base, [
        ("hidden_states-none", "hidden_states", {"hidden_states": None}),
        ("hidden_states-1d", "hidden_states", {"hidden_states": x[0]}),
        ("hidden_states-3d", "hidden_states", {"hidden_states": x[None]}),
        ("hidden_states-int", "hidden_states", {"hidden_states": x.long()}),
        ("w1-none", "w1", {"w1": None}),
        ("w1-2d", "w1", {"w1": w1[0]}),
        ("w1-wrong-hidden", "w1", {"w1": row_randn(45, 4, 12, 6)}),
        ("w1-odd-rows", "w1", {"w1": row_randn(46, 4, 11, 8)}),
        ("w1-dtype", "w1", {"w1": w1.double()}),
        ("w1-meta", "w1", {"w1": w1.to(_META)}),
        ("w2-none", "w2", {"w2": None}),
        ("w2-shape", "w2", {"w2": w2[:, :, :5]}),
        ("w2-experts", "w2", {"w2": w2[:3]}),
        ("w2-dtype", "w2", {"w2": w2.half()}),
        ("w2-meta", "w2", {"w2": w2.to(_META)}),
        ("topk_weights-none", "topk_weights", {"topk_weights": None}),
        ("topk_weights-shape", "topk_weights", {"topk_weights": weights[:, :1]}),
        ("topk_weights-int", "topk_weights", {"topk_weights": torch.ones(4, 2, dtype=torch.int32)}),
        ("topk_weights-meta", "topk_weights", {"topk_weights": weights.to(_META)}),
        ("topk_ids-none", "topk_ids", {"topk_ids": None}),
        ("topk_ids-float", "topk_ids", {"topk_ids": ids.float()}),
        ("topk_ids-1d", "topk_ids", {"topk_ids": ids.reshape(-1)}),
        ("topk_ids-tokens", "topk_ids", {"topk_ids": ids[:3]}),
        ("topk_ids-past-experts", "topk_ids", {"topk_ids": out_of_range}),
        ("topk_ids-negative", "topk_ids", {"topk_ids": negative}),
        ("topk_ids-meta", "topk_ids", {"topk_ids": ids.to(_META)}),
    ])


def register_moe_bad_inputs() -> None:
    """Register the generators above."""
    register_bad_inputs("topk_softmax", topk_softmax_bad_inputs)
    register_bad_inputs("grouped_topk", grouped_topk_bad_inputs)
    register_bad_inputs("fused_moe", fused_moe_bad_inputs)
