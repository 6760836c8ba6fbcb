"""The :class:`GroupedTopk` router layer (DeepSeek-V2/V3 grouped expert selection).

vLLM 0.32's ``GroupedTopk`` (``fused_moe/router/grouped_topk_router.py``): same name
(``grouped_topk``), constructor and forward. ``forward_native`` is the catalog op's
native reference run in line (plain PyTorch); the platform paths call the catalog op
:func:`opmux.ops.moe.grouped_topk`, so every provider of that op serves the layer.

>>> import torch
>>> from opmux.layers.moe_router import GroupedTopk
>>> router = GroupedTopk(topk=2, renormalize=True, num_expert_group=4, topk_group=2)
>>> weights, ids = router(torch.randn(3, 16), torch.randn(3, 16))
>>> tuple(weights.shape), weights.dtype, ids.dtype
((3, 2), torch.float32, torch.int32)
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from opmux.core.errors import ConfigError
from opmux.layers.custom_op import CustomOp, _runs
from opmux.ops.checks import input_error
from opmux.ops.moe import grouped_topk

__all__ = ["GroupedTopk"]


@CustomOp.register("grouped_topk")
class GroupedTopk(CustomOp):
    """Pick ``topk_group`` groups of experts per token, then ``topk`` experts inside them.

    :param topk: experts per token.
    :param renormalize: renormalise the chosen weights to sum 1.
    :param num_expert_group: groups the experts are split into (consecutive, equal).
    :param topk_group: groups kept per token.
    :param scoring_func: ``"softmax"`` or ``"sigmoid"``.
    :param routed_scaling_factor: multiplies the routing weights.
    :param num_fused_shared_experts: shared experts fused into the routed GEMM by some
        vLLM backends (ROCm); the reference semantics ignore it, so only ``0`` is taken.
    :raises ConfigError: a size below 1 or a scoring function other than the two above.

    ``forward(hidden_states, gating_output, e_score_correction_bias=None)`` returns
    ``(topk_weights [T, topk] float32, topk_ids [T, topk] int32)``; ``hidden_states`` only
    fixes the token count (as in vLLM), and a bias (DeepSeek-V3) steers the selection while
    the weights stay the unbiased scores.
    """

    topk: int
    renormalize: bool
    num_expert_group: int
    topk_group: int
    scoring_func: str
    routed_scaling_factor: float
    num_fused_shared_experts: int

    def __init__(self, topk: int, renormalize: bool, num_expert_group: int = 0,
                 topk_group: int = 0, scoring_func: str = "softmax",
                 routed_scaling_factor: float = 1.0, num_fused_shared_experts: int = 0) -> None:
        super().__init__()
        where = "GroupedTopk"
        for arg, value in (("topk", topk), ("num_expert_group", num_expert_group),
                           ("topk_group", topk_group)):
            if value < 1:
                raise ConfigError(f"{where}: {arg} must be >= 1, got {value}")
        if topk_group > num_expert_group:
            raise ConfigError(f"{where}: topk_group must be in [1, num_expert_group="
                              f"{num_expert_group}], got {topk_group}")
        if scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"{where}: scoring_func must be 'softmax' or 'sigmoid', "
                              f"got {scoring_func!r}")
        if num_fused_shared_experts:
            raise ConfigError(f"{where}: num_fused_shared_experts must be 0 (fused shared "
                              f"experts are a ROCm kernel feature), got "
                              f"{num_fused_shared_experts}")
        self.topk = topk
        self.renormalize = renormalize
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.scoring_func = scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        self.num_fused_shared_experts = num_fused_shared_experts

    def _check_tokens(self, hidden_states: Tensor, gating_output: Tensor) -> None:
        if hidden_states.shape[0] != gating_output.shape[0]:
            raise input_error("grouped_topk", "GroupedTopk", "gating_output",
                              f"{hidden_states.shape[0]} rows (the tokens of hidden_states)",
                              f"{gating_output.shape[0]} rows")

    def forward_native(self, hidden_states: Tensor, gating_output: Tensor,
                       e_score_correction_bias: Optional[Tensor] = None
                       ) -> tuple[Tensor, Tensor]:
        """The op's native reference in line (plain PyTorch)."""
        self._check_tokens(hidden_states, gating_output)
        return grouped_topk.native(  # type: ignore[no-any-return]
            gating_output, self.topk, self.renormalize, self.num_expert_group,
            self.topk_group, self.scoring_func, e_score_correction_bias,
            self.routed_scaling_factor)

    def forward_op(self, hidden_states: Tensor, gating_output: Tensor,
                   e_score_correction_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Through the catalog op (dispatches to the best provider)."""
        self._check_tokens(hidden_states, gating_output)
        return grouped_topk(  # type: ignore[no-any-return]
            gating_output, self.topk, self.renormalize, self.num_expert_group,
            self.topk_group, self.scoring_func, e_score_correction_bias,
            self.routed_scaling_factor)

    forward_cuda = forward_xla = forward_npu = forward_cpu = _runs("forward_op")

    def extra_repr(self) -> str:
        return (f"topk={self.topk}, renormalize={self.renormalize}, "
                f"num_expert_group={self.num_expert_group}, topk_group={self.topk_group}, "
                f"scoring_func={self.scoring_func!r}, "
                f"routed_scaling_factor={self.routed_scaling_factor}")
