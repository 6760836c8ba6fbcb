"""Mixture-of-experts ops: routing (top-k softmax, grouped top-k) and the expert compute.

Shapes: T tokens, d hidden size, E experts, I expert intermediate size, k experts per
token. Routing returns ``topk_weights [T, k]`` float32 and ``topk_ids [T, k]`` int32
(the engines' convention), best expert first.

``fused_moe`` computes, for each token ``t``::

    out[t] = sum_j topk_weights[t, j] * expert(topk_ids[t, j], x[t])
    expert(e, x) = w2[e] @ (silu(g) * u),  [g, u] = split(w1[e] @ x)   # w1[e]: [2I, d]

The reference runs every expert on every token and keeps the selected results: it has
no data-dependent shapes (compiles, runs on XLA) at the price of E/k times the FLOPs of
a grouped provider. Everything runs in float32 whatever the input dtype: the gate/up
projection, the SiLU-and-mul, the down projection and the weighted sum, rounded once to
``hidden_states.dtype`` at the end (the catalog's numerics rule; the providers follow it).
On vLLM's CPU MoE shapes (8 experts, top 4, hidden/intermediate 128 and 2880) native and the
``grouped`` provider stay within float32's default tolerance of a float64 evaluation, and in
bf16/fp16 no further from it than a computation rounding after every step
(``tests/ops/test_moe_accuracy.py``, ``tests/ops/test_numerics_rule.py``).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks.moe import (
    check_expert_ids,
    check_fused_moe_args,
    check_grouped_topk,
    check_topk_softmax,
)

__all__ = [
    "fused_moe",
    "grouped_topk",
    "topk_softmax",
]

@register_op
def topk_softmax(gating_output: Tensor, topk: int, renormalize: bool
                 ) -> tuple[Tensor, Tensor]:
    """Softmax over experts (float32), the ``topk`` best, optionally renormalised to sum 1.

    :param gating_output: router logits ``[T, E]``.
    :param topk: experts per token, ``1 <= topk <= E``.
    :param renormalize: divide the kept weights by their sum.
    :returns: ``(topk_weights [T, topk] float32, topk_ids [T, topk] int32)``.
    """
    check_topk_softmax(gating_output, topk, renormalize)
    scores = torch.softmax(gating_output.float(), dim=-1)
    weights, ids = torch.topk(scores, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@topk_softmax.register_meta
def _topk_softmax_fake(gating_output: Tensor, topk: int, renormalize: bool
                       ) -> tuple[Tensor, Tensor]:
    tokens, _ = check_topk_softmax(gating_output, topk, renormalize, provider="native")
    return (gating_output.new_empty((tokens, topk), dtype=torch.float32),
            gating_output.new_empty((tokens, topk), dtype=torch.int32))


@register_op
def grouped_topk(gating_output: Tensor, topk: int, renormalize: bool, num_expert_group: int,
                 topk_group: int, scoring_func: str = "softmax",
                 e_score_correction_bias: Optional[Tensor] = None,
                 routed_scaling_factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """DeepSeek-style routing: pick ``topk_group`` expert groups, then ``topk`` experts in them.

    Scores are ``softmax`` or ``sigmoid`` of the logits (float32). The E experts form
    ``num_expert_group`` equal groups of consecutive experts. A group's score is its best
    expert score, or, with ``e_score_correction_bias``, the sum of its two best biased
    scores (DeepSeek-V3). Experts outside the ``topk_group`` best groups are excluded;
    the ``topk`` best remaining experts are chosen (by biased score when a bias is given)
    and weighted by their unbiased scores, renormalised if asked, times
    ``routed_scaling_factor``.

    :returns: ``(topk_weights [T, topk] float32, topk_ids [T, topk] int32)``.
    """
    tokens, num_experts, per_group = check_grouped_topk(
        gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
        e_score_correction_bias, routed_scaling_factor)
    logits = gating_output.float()
    scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float()
        grouped = choice.view(tokens, num_expert_group, per_group)
        best = grouped.topk(min(2, per_group), dim=-1).values
        group_scores = best.sum(dim=-1)
    else:
        choice = scores
        group_scores = scores.view(tokens, num_expert_group, per_group).amax(dim=-1)
    group_idx = torch.topk(group_scores, topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand(tokens, num_expert_group, per_group)
    masked = choice.masked_fill(~expert_mask.reshape(tokens, num_experts), float("-inf"))
    ids = torch.topk(masked, topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


@grouped_topk.register_meta
def _grouped_topk_fake(gating_output: Tensor, topk: int, renormalize: bool,
                       num_expert_group: int, topk_group: int, scoring_func: str = "softmax",
                       e_score_correction_bias: Optional[Tensor] = None,
                       routed_scaling_factor: float = 1.0) -> tuple[Tensor, Tensor]:
    tokens, _, _ = check_grouped_topk(gating_output, topk, renormalize, num_expert_group,
                                      topk_group, scoring_func, e_score_correction_bias,
                                      routed_scaling_factor, provider="native")
    return (gating_output.new_empty((tokens, topk), dtype=torch.float32),
            gating_output.new_empty((tokens, topk), dtype=torch.int32))


def _is_concrete(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


@register_op
def fused_moe(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
              topk_ids: Tensor) -> Tensor:
    """Mixture-of-experts MLP: SiLU-and-mul experts, weighted sum over each token's top-k.

    :param hidden_states: ``[T, d]``.
    :param w1: gate and up projections ``[E, 2I, d]`` (gate rows first).
    :param w2: down projections ``[E, d, I]``.
    :param topk_weights: ``[T, k]`` routing weights.
    :param topk_ids: ``[T, k]`` int32/int64 expert ids in ``[0, E)``.
    :returns: ``[T, d]`` in ``hidden_states.dtype``.
    """
    tokens, hidden, experts, intermediate = check_fused_moe_args(
        "native", hidden_states, w1, w2, topk_weights, topk_ids)
    if _is_concrete(topk_ids) and topk_ids.numel():
        lo, hi = torch.aminmax(topk_ids)
        check_expert_ids("native", int(lo), int(hi), experts)
    weights = topk_weights.float()
    x = hidden_states.float()
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    for e in range(experts):
        hit = topk_ids == e  # [T, k]
        selected = hit.any(dim=-1, keepdim=True)
        weight = (weights * hit).sum(dim=-1, keepdim=True)
        gate_up = F.linear(x, w1[e].float())
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = F.linear(act, w2[e].float())
        out += torch.where(selected, y * weight, 0.0)
    return out.to(hidden_states.dtype)


@fused_moe.register_meta
def _fused_moe_fake(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                    topk_ids: Tensor) -> Tensor:
    check_fused_moe_args("native", hidden_states, w1, w2, topk_weights, topk_ids)
    return torch.empty_like(hidden_states)

