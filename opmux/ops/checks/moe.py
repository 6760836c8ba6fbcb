"""Input checks of the mixture-of-experts ops (:mod:`opmux.ops.moe`): ``topk_softmax``,
``grouped_topk`` and ``fused_moe``.

The checks read no data: shapes, dtypes, devices and scalars only. A provider that reads the
expert ids passes their extremes to :func:`check_expert_ids`. One tensor on another device
(a meta weight among CPU tensors) is refused, since the dispatcher would otherwise run the
fake and return uninitialised memory.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from opmux.ops.checks.input_errors import input_error
from opmux.ops.checks.single_arguments import (
    check_bool,
    check_int,
    check_real,
    check_same_device,
    check_tensor,
)

__all__ = [
    "check_expert_ids",
    "check_fused_moe_args",
    "check_grouped_topk",
    "check_topk_softmax",
]

_SCORING_FUNCS = ("sigmoid", "softmax")


def _float_2d(op: str, provider: str, name: str, t: Tensor, cols: str) -> tuple[int, int]:
    """``t`` is a floating 2-D ``[tokens, cols]`` tensor; returns its two sizes."""
    if t.dim() != 2:
        raise input_error(op, provider, name,
                          f"a 2-D [tokens, {cols}] tensor", f"shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise input_error(op, provider, name, "a floating-point tensor", t.dtype)
    return t.shape[0], t.shape[1]


def _check_gating(op: str, provider: str, gating_output: Tensor, topk: int
                  ) -> tuple[int, int]:
    gating_output = check_tensor(op, provider, "gating_output", gating_output)
    tokens, num_experts = _float_2d(op, provider, "gating_output", gating_output, "experts")
    check_int(op, provider, "topk", topk)
    if not 1 <= topk <= num_experts:
        raise input_error(op, provider, "topk",
                          f"1 <= topk <= {num_experts} (the number of experts)",
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
        raise input_error(op, provider, "num_expert_group",
                          f"a positive divisor of the number of experts {num_experts}",
                          num_expert_group)
    per_group = num_experts // num_expert_group
    if not 1 <= topk_group <= num_expert_group:
        raise input_error(op, provider, "topk_group", f"1 <= topk_group <= {num_expert_group}",
                          topk_group)
    if topk > topk_group * per_group:
        raise input_error(op, provider, "topk",
                          f"at most topk_group * experts per group = {topk_group * per_group}",
                          topk)
    if scoring_func not in _SCORING_FUNCS:
        raise input_error(op, provider, "scoring_func", f"one of {list(_SCORING_FUNCS)}",
                          repr(scoring_func))
    if e_score_correction_bias is not None:
        bias = check_tensor(op, provider, "e_score_correction_bias", e_score_correction_bias)
        if tuple(bias.shape) != (num_experts,):
            raise input_error(op, provider, "e_score_correction_bias", f"shape ({num_experts},)",
                              f"shape {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise input_error(op, provider, "e_score_correction_bias", "a floating-point tensor",
                              bias.dtype)
        check_same_device(op, provider, gating_output, e_score_correction_bias=bias)
    return tokens, num_experts, per_group


_ID_DTYPES = (torch.int32, torch.int64)


def check_fused_moe_args(provider: str, hidden_states: Tensor, w1: Tensor, w2: Tensor,
                         topk_weights: Tensor, topk_ids: Tensor) -> tuple[int, int, int, int]:
    """Validate the shapes and dtypes of a ``fused_moe`` call (no data is read).

    :param provider: named in the error messages.
    :returns: ``(tokens, hidden, experts, intermediate)``.
    :raises OpInputError: naming op, provider, argument, expected and got.
    """
    op = "fused_moe"
    hidden_states = check_tensor(op, provider, "hidden_states", hidden_states)
    w1 = check_tensor(op, provider, "w1", w1)
    w2 = check_tensor(op, provider, "w2", w2)
    topk_weights = check_tensor(op, provider, "topk_weights", topk_weights)
    topk_ids = check_tensor(op, provider, "topk_ids", topk_ids)
    tokens, hidden = _float_2d(op, provider, "hidden_states", hidden_states, "hidden")
    if w1.dim() != 3 or w1.shape[2] != hidden or w1.shape[1] % 2:
        raise input_error(op, provider, "w1", f"shape [experts, 2 * intermediate, {hidden}]",
                          f"shape {tuple(w1.shape)}")
    experts, intermediate = w1.shape[0], w1.shape[1] // 2
    if tuple(w2.shape) != (experts, hidden, intermediate):
        raise input_error(op, provider, "w2", f"shape {(experts, hidden, intermediate)} "
                          f"([experts, hidden, intermediate], matching w1)",
                          f"shape {tuple(w2.shape)}")
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != hidden_states.dtype:
            raise input_error(op, provider, name,
                              f"dtype {hidden_states.dtype} (as hidden_states)", w.dtype)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise input_error(op, provider, "topk_ids", f"shape [{tokens}, topk]",
                          f"shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise input_error(op, provider, "topk_ids",
                          "dtype torch.int32 or torch.int64", topk_ids.dtype)
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise input_error(op, provider, "topk_weights",
                          f"shape {tuple(topk_ids.shape)} (as topk_ids)",
                          f"shape {tuple(topk_weights.shape)}")
    if not topk_weights.is_floating_point():
        raise input_error(op, provider, "topk_weights",
                          "a floating-point tensor", topk_weights.dtype)
    check_same_device(op, provider, hidden_states, w1=w1, w2=w2, topk_weights=topk_weights,
                      topk_ids=topk_ids)
    return tokens, hidden, experts, intermediate


def check_expert_ids(provider: str, lowest: int, highest: int, experts: int) -> None:
    """Reject expert ids outside ``[0, experts)`` (the caller reads the extremes).

    :raises OpInputError: naming the offending id.
    """
    if lowest < 0 or highest >= experts:
        bad = lowest if lowest < 0 else highest
        raise input_error("fused_moe", provider, "topk_ids", f"expert ids in [0, {experts})",
                   f"id {bad}")
