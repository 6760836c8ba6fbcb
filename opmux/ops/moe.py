"""Mixture-of-experts ops: routing (top-k softmax, grouped top-k) and the expert compute.

Shapes: T tokens, d hidden size, E experts, I expert intermediate size, k experts per
token. Routing returns ``topk_weights [T, k]`` float32 and ``topk_ids [T, k]`` int32
(the engines' convention), best expert first.

``fused_moe`` computes, for each token ``t``::

    out[t] = sum_j topk_weights[t, j] * expert(topk_ids[t, j], x[t])
    expert(e, x) = w2[e] @ (silu(g) * u),  [g, u] = split(w1[e] @ x)   # w1[e]: [2I, d]

The reference runs every expert on every token and keeps the selected results: it has
no data-dependent shapes (compiles, runs on XLA) at the price of E/k times the FLOPs of
a grouped provider. Weighted sums accumulate in float32; the result has
``hidden_states.dtype``. With float32 inputs everything runs in float32: on vLLM's CPU MoE
shapes (8 experts, top 4, hidden/intermediate 128 and 2880) native and the ``grouped``
provider stay within float32's default tolerance of a float64 evaluation
(``tests/ops/test_moe_accuracy.py``).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.errors import OpInputError
from opmux.core.registry import register_op
from opmux.ops._checks import (
    check_bool,
    check_int,
    check_real,
    check_same_device,
    check_tensor,
    input_error,
)

__all__ = [
    "check_expert_ids",
    "check_fused_moe_args",
    "check_grouped_topk",
    "check_topk_softmax",
    "fused_moe",
    "grouped_topk",
    "topk_softmax",
]

_SCORING_FUNCS = ("sigmoid", "softmax")


def _err(op: str, provider: str, arg: str, expected: str, got: object) -> OpInputError:
    # the catalog's one error builder and message format
    return input_error(op, provider, arg, expected, got)


# one tensor on another device (a meta weight among CPU tensors) would otherwise make the
# dispatcher run the fake and return uninitialised memory (#11 item 3)
_tensor = check_tensor
_same_device = check_same_device


def _float_2d(op: str, provider: str, name: str, t: Tensor, cols: str) -> tuple[int, int]:
    """``t`` is a floating 2-D ``[tokens, cols]`` tensor; returns its two sizes."""
    if t.dim() != 2:
        raise _err(op, provider, name, f"a 2-D [tokens, {cols}] tensor", f"shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise _err(op, provider, name, "a floating-point tensor", t.dtype)
    return t.shape[0], t.shape[1]


def _check_gating(op: str, provider: str, gating_output: Tensor, topk: int
                  ) -> tuple[int, int]:
    gating_output = _tensor(op, provider, "gating_output", gating_output)
    tokens, num_experts = _float_2d(op, provider, "gating_output", gating_output, "experts")
    check_int(op, provider, "topk", topk)
    if not 1 <= topk <= num_experts:
        raise _err(op, provider, "topk", f"1 <= topk <= {num_experts} (the number of experts)",
                   topk)
    return tokens, num_experts


def check_topk_softmax(gating_output: Tensor, topk: int, renormalize: bool, *,
                       provider: str = "native") -> tuple[int, int]:
    """Validate a ``topk_softmax`` call (no data is read).

    :returns: ``(tokens, experts)``.
    :raises OpInputError: naming op, provider, argument, expected and got.
    """
    sizes = _check_gating("topk_softmax", provider, gating_output, topk)
    check_bool("topk_softmax", provider, "renormalize", renormalize)
    return sizes


def check_grouped_topk(gating_output: Tensor, topk: int, renormalize: bool,
                       num_expert_group: int, topk_group: int, scoring_func: str = "softmax",
                       e_score_correction_bias: Optional[Tensor] = None,
                       routed_scaling_factor: float = 1.0, *,
                       provider: str = "native") -> tuple[int, int, int]:
    """Validate a ``grouped_topk`` call (no data is read).

    :returns: ``(tokens, experts, experts per group)``.
    :raises OpInputError: naming op, provider, argument, expected and got.
    """
    op = "grouped_topk"
    tokens, num_experts = _check_gating(op, provider, gating_output, topk)
    check_bool(op, provider, "renormalize", renormalize)
    check_int(op, provider, "num_expert_group", num_expert_group)
    check_int(op, provider, "topk_group", topk_group)
    check_real(op, provider, "routed_scaling_factor", routed_scaling_factor)
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise _err(op, provider, "num_expert_group",
                   f"a positive divisor of the number of experts {num_experts}",
                   num_expert_group)
    per_group = num_experts // num_expert_group
    if not 1 <= topk_group <= num_expert_group:
        raise _err(op, provider, "topk_group", f"1 <= topk_group <= {num_expert_group}",
                   topk_group)
    if topk > topk_group * per_group:
        raise _err(op, provider, "topk",
                   f"at most topk_group * experts per group = {topk_group * per_group}", topk)
    if scoring_func not in _SCORING_FUNCS:
        raise _err(op, provider, "scoring_func", f"one of {list(_SCORING_FUNCS)}",
                   repr(scoring_func))
    if e_score_correction_bias is not None:
        bias = _tensor(op, provider, "e_score_correction_bias", e_score_correction_bias)
        if tuple(bias.shape) != (num_experts,):
            raise _err(op, provider, "e_score_correction_bias", f"shape ({num_experts},)",
                       f"shape {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise _err(op, provider, "e_score_correction_bias", "a floating-point tensor",
                       bias.dtype)
        _same_device(op, provider, gating_output, e_score_correction_bias=bias)
    return tokens, num_experts, per_group


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


@topk_softmax.register_fake
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


@grouped_topk.register_fake
def _grouped_topk_fake(gating_output: Tensor, topk: int, renormalize: bool,
                       num_expert_group: int, topk_group: int, scoring_func: str = "softmax",
                       e_score_correction_bias: Optional[Tensor] = None,
                       routed_scaling_factor: float = 1.0) -> tuple[Tensor, Tensor]:
    tokens, _, _ = check_grouped_topk(gating_output, topk, renormalize, num_expert_group,
                                      topk_group, scoring_func, e_score_correction_bias,
                                      routed_scaling_factor, provider="native")
    return (gating_output.new_empty((tokens, topk), dtype=torch.float32),
            gating_output.new_empty((tokens, topk), dtype=torch.int32))


_ID_DTYPES = (torch.int32, torch.int64)


def check_fused_moe_args(provider: str, hidden_states: Tensor, w1: Tensor, w2: Tensor,
                         topk_weights: Tensor, topk_ids: Tensor) -> tuple[int, int, int, int]:
    """Validate the shapes and dtypes of a ``fused_moe`` call (no data is read).

    :param provider: named in the error messages.
    :returns: ``(tokens, hidden, experts, intermediate)``.
    :raises OpInputError: naming op, provider, argument, expected and got.
    """
    op = "fused_moe"
    hidden_states = _tensor(op, provider, "hidden_states", hidden_states)
    w1 = _tensor(op, provider, "w1", w1)
    w2 = _tensor(op, provider, "w2", w2)
    topk_weights = _tensor(op, provider, "topk_weights", topk_weights)
    topk_ids = _tensor(op, provider, "topk_ids", topk_ids)
    tokens, hidden = _float_2d(op, provider, "hidden_states", hidden_states, "hidden")
    if w1.dim() != 3 or w1.shape[2] != hidden or w1.shape[1] % 2:
        raise _err(op, provider, "w1", f"shape [experts, 2 * intermediate, {hidden}]",
                   f"shape {tuple(w1.shape)}")
    experts, intermediate = w1.shape[0], w1.shape[1] // 2
    if tuple(w2.shape) != (experts, hidden, intermediate):
        raise _err(op, provider, "w2", f"shape {(experts, hidden, intermediate)} "
                   f"([experts, hidden, intermediate], matching w1)", f"shape {tuple(w2.shape)}")
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != hidden_states.dtype:
            raise _err(op, provider, name, f"dtype {hidden_states.dtype} (as hidden_states)",
                       w.dtype)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise _err(op, provider, "topk_ids", f"shape [{tokens}, topk]",
                   f"shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise _err(op, provider, "topk_ids", "dtype torch.int32 or torch.int64", topk_ids.dtype)
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise _err(op, provider, "topk_weights", f"shape {tuple(topk_ids.shape)} (as topk_ids)",
                   f"shape {tuple(topk_weights.shape)}")
    if not topk_weights.is_floating_point():
        raise _err(op, provider, "topk_weights", "a floating-point tensor", topk_weights.dtype)
    _same_device(op, provider, hidden_states, w1=w1, w2=w2, topk_weights=topk_weights,
                 topk_ids=topk_ids)
    return tokens, hidden, experts, intermediate


def check_expert_ids(provider: str, lowest: int, highest: int, experts: int) -> None:
    """Reject expert ids outside ``[0, experts)`` (the caller reads the extremes).

    :raises OpInputError: naming the offending id.
    """
    if lowest < 0 or highest >= experts:
        bad = lowest if lowest < 0 else highest
        raise _err("fused_moe", provider, "topk_ids", f"expert ids in [0, {experts})",
                   f"id {bad}")


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
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    for e in range(experts):
        hit = topk_ids == e  # [T, k]
        selected = hit.any(dim=-1, keepdim=True)
        weight = (weights * hit).sum(dim=-1, keepdim=True)
        gate_up = F.linear(hidden_states, w1[e])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = F.linear(act, w2[e]).float()
        out += torch.where(selected, y * weight, 0.0)
    return out.to(hidden_states.dtype)


@fused_moe.register_fake
def _fused_moe_fake(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                    topk_ids: Tensor) -> Tensor:
    check_fused_moe_args("native", hidden_states, w1, w2, topk_weights, topk_ids)
    return torch.empty_like(hidden_states)

