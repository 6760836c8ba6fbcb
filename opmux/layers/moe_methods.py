"""MoE methods: vLLM's ``UnquantizedFusedMoEMethod`` and its modular-kernel split.

vLLM 0.32 separates a MoE layer's *weights and experts math* (a "method" object that
creates the weights on the layer and applies the experts to routed tokens) from the layer.
opmux follows it:

* :class:`UnquantizedFusedMoEMethod` (``unquantized_fused_moe``): ``create_weights``
  registers ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` on a layer; ``apply``
  runs the catalog op :func:`opmux.ops.moe.fused_moe` (enabled) or its native reference in
  line (disabled).
* The modular kernel: a :class:`FusedMoEPrepareAndFinalizeModular` (quantize and dispatch
  tokens before the experts; combine after) and a :class:`FusedMoEExpertsModular` (the
  expert GEMMs), joined by :class:`FusedMoEKernel`. opmux ships the no-EP
  prepare/finalize (:class:`MoEPrepareAndFinalizeNoDPEPModular`) and experts that run the
  catalog op (:class:`FusedMoECatalogExperts`); any object with the same methods plugs in.
* :class:`FusedMoEModularMethod` (``modular_fused_moe``): a method that applies a
  :class:`FusedMoEKernel`.

Where opmux differs from vLLM (written down here, not hidden): the objects take ``activation``
as a string (only ``"silu"``, the experts activation of ``fused_moe``); experts *return*
their output instead of writing caller-allocated workspaces (no data-dependent buffers reach
``torch.compile``); shared experts run in the layer (:class:`~opmux.layers.moe.FusedMoE`),
so ``apply`` takes ``shared_experts`` only as ``None``; expert parallelism (``expert_map``)
is not supported.

>>> import torch
>>> from opmux.layers.moe_methods import UnquantizedFusedMoEMethod
>>> layer = torch.nn.Module()
>>> method = UnquantizedFusedMoEMethod()
>>> method.create_weights(layer, num_experts=4, hidden_size=8,
...                       intermediate_size_per_partition=6, params_dtype=torch.float32)
>>> tuple(layer.w13_weight.shape), tuple(layer.w2_weight.shape)
((4, 12, 8), (4, 8, 6))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.errors import ConfigError
from opmux.layers._tensor_parallel import set_weight_attrs
from opmux.layers.custom_op import CustomOp, _runs
from opmux.ops.checks import input_error
from opmux.ops.moe import fused_moe

__all__ = [
    "FusedMoECatalogExperts",
    "FusedMoEConfig",
    "FusedMoEExpertsModular",
    "FusedMoEKernel",
    "FusedMoEModularMethod",
    "FusedMoEPrepareAndFinalizeModular",
    "MoEPrepareAndFinalizeNoDPEPModular",
    "PrepareResult",
    "TopKWeightAndReduce",
    "TopKWeightAndReduceContiguous",
    "TopKWeightAndReduceNoOP",
    "UnquantizedFusedMoEMethod",
    "experts_native",
]

#: ``(a1q, a1q_scale, expert_tokens_meta, topk_ids, topk_weights)`` as vLLM's prepare
#: returns it; ``None`` ids / weights mean "unchanged by dispatch".
PrepareResult = tuple[Tensor, Optional[Tensor], Optional[Any], Optional[Tensor],
                      Optional[Tensor]]


@dataclass(frozen=True)
class FusedMoEConfig:
    """What a MoE method needs to know about its layer (vLLM's ``FusedMoEConfig``, reduced).

    :param num_experts: E (global).
    :param experts_per_token: top-k.
    :param hidden_dim: H.
    :param intermediate_size_per_partition: this rank's I.
    :param activation: the experts' activation; opmux's ``fused_moe`` computes ``"silu"``.
    :param has_bias: expert biases (not supported: ``fused_moe`` has none).
    """

    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size_per_partition: int
    activation: str = "silu"
    has_bias: bool = False

    def __post_init__(self) -> None:
        if self.activation != "silu":
            raise ConfigError(f"FusedMoEConfig: activation must be 'silu' (the fused_moe "
                              f"op's experts), got {self.activation!r}")
        if self.has_bias:
            raise ConfigError("FusedMoEConfig: has_bias=True is not supported (fused_moe "
                              "experts have no biases)")


def _no_extras(who: str, activation: str, expert_map: Optional[Tensor],
               shared_experts: Optional[object] = None) -> None:
    if activation != "silu":
        raise input_error("fused_moe", who, "activation", "'silu'", repr(activation))
    if expert_map is not None:
        raise input_error("fused_moe", who, "expert_map",
                          "None (expert parallelism is not supported)", "a tensor")
    if shared_experts is not None:
        raise input_error("fused_moe", who, "shared_experts",
                          "None (FusedMoE runs the shared experts)", type(shared_experts).__name__)


# --------------------------------------------------------------- weight and reduce
class TopKWeightAndReduce(ABC):
    """How finalize turns the experts' output into ``[M, K]``."""

    @abstractmethod
    def apply(self, fused_expert_output: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              apply_router_weight_on_input: bool) -> Tensor:
        """The weighted, reduced ``[M, K]`` output."""


class TopKWeightAndReduceNoOP(TopKWeightAndReduce):
    """The experts already weighted and reduced: ``[M, K]`` passes through."""

    def apply(self, fused_expert_output: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              apply_router_weight_on_input: bool) -> Tensor:
        return fused_expert_output


class TopKWeightAndReduceContiguous(TopKWeightAndReduce):
    """Experts that return ``[M, topk, K]`` unweighted: weight (unless applied on the
    input) and sum over the top-k slots, in float32."""

    def apply(self, fused_expert_output: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              apply_router_weight_on_input: bool) -> Tensor:
        out = fused_expert_output.float()
        if not apply_router_weight_on_input:
            out = out * topk_weights.float().unsqueeze(-1)
        return out.sum(dim=1).to(fused_expert_output.dtype)


# --------------------------------------------------------------- prepare / finalize
class FusedMoEPrepareAndFinalizeModular(ABC):
    """Before the experts: quantize and dispatch tokens; after: combine into the output."""

    @abstractmethod
    def prepare(self, a1: Tensor, topk_weights: Tensor, topk_ids: Tensor, num_experts: int,
                expert_map: Optional[Tensor], apply_router_weight_on_input: bool
                ) -> PrepareResult:
        """Tokens as the experts take them (see :data:`PrepareResult`)."""

    @abstractmethod
    def finalize(self, output: Tensor, fused_expert_output: Tensor, topk_weights: Tensor,
                 topk_ids: Tensor, apply_router_weight_on_input: bool,
                 weight_and_reduce_impl: TopKWeightAndReduce) -> None:
        """Combine the experts' output into ``output [M, K]`` (written in place)."""

    def output_is_reduced(self) -> bool:
        """Whether finalize already reduced across ranks (no EP here: nothing to reduce)."""
        return False


class MoEPrepareAndFinalizeNoDPEPModular(FusedMoEPrepareAndFinalizeModular):
    """No data or expert parallelism: every token stays on this rank, unquantized.

    ``apply_router_weight_on_input`` scales the tokens by their routing weight before the
    experts; as in vLLM this needs ``topk == 1`` (a token's one weight).
    """

    def prepare(self, a1: Tensor, topk_weights: Tensor, topk_ids: Tensor, num_experts: int,
                expert_map: Optional[Tensor], apply_router_weight_on_input: bool
                ) -> PrepareResult:
        who = type(self).__name__
        _no_extras(who, "silu", expert_map)
        if apply_router_weight_on_input:
            if topk_weights.dim() != 2 or topk_weights.shape[1] != 1:
                raise input_error("fused_moe", who, "topk_weights",
                                  "[M, 1] with apply_router_weight_on_input",
                                  f"shape {tuple(topk_weights.shape)}")
            a1 = a1 * topk_weights.to(a1.dtype)
        return a1, None, None, None, None

    def finalize(self, output: Tensor, fused_expert_output: Tensor, topk_weights: Tensor,
                 topk_ids: Tensor, apply_router_weight_on_input: bool,
                 weight_and_reduce_impl: TopKWeightAndReduce) -> None:
        output.copy_(weight_and_reduce_impl.apply(fused_expert_output, topk_weights,
                                                  topk_ids, apply_router_weight_on_input))


# --------------------------------------------------------------------- experts
class FusedMoEExpertsModular(ABC):
    """The expert GEMMs over prepared tokens."""

    @abstractmethod
    def apply(self, hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, activation: str, global_num_experts: int,
              expert_map: Optional[Tensor], apply_router_weight_on_input: bool) -> Tensor:
        """The experts' output, in the layout :meth:`finalize_weight_and_reduce_impl` reads."""

    @abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        """How finalize weights and reduces this object's output."""


class FusedMoECatalogExperts(FusedMoEExpertsModular):
    """Experts through the catalog op :func:`opmux.ops.moe.fused_moe` (weighted and reduced
    there, so finalize passes the ``[M, K]`` result through)."""

    def apply(self, hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, activation: str, global_num_experts: int,
              expert_map: Optional[Tensor], apply_router_weight_on_input: bool) -> Tensor:
        _no_extras(type(self).__name__, activation, expert_map)
        if apply_router_weight_on_input:  # the weights are in the tokens already
            topk_weights = torch.ones_like(topk_weights)
        return fused_moe(hidden_states, w1, w2, topk_weights, topk_ids)  # type: ignore[no-any-return]

    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()


class FusedMoEKernel:
    """prepare → experts → finalize.

    :param prepare_finalize: dispatch and combine.
    :param fused_experts: the expert GEMMs.
    """

    def __init__(self, prepare_finalize: FusedMoEPrepareAndFinalizeModular,
                 fused_experts: FusedMoEExpertsModular) -> None:
        self.prepare_finalize = prepare_finalize
        self.fused_experts = fused_experts

    def apply(self, hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, activation: str = "silu", global_num_experts: int = -1,
              expert_map: Optional[Tensor] = None, apply_router_weight_on_input: bool = False,
              shared_experts: Optional[object] = None,
              shared_experts_input: Optional[Tensor] = None) -> Tensor:
        """The routed experts' output ``[M, K]`` in ``hidden_states.dtype``."""
        _no_extras(type(self).__name__, activation, expert_map, shared_experts)
        experts = w1.shape[0] if global_num_experts == -1 else global_num_experts
        a1q, _scale, _meta, ids, weights = self.prepare_finalize.prepare(
            hidden_states, topk_weights, topk_ids, experts, expert_map,
            apply_router_weight_on_input)
        ids = topk_ids if ids is None else ids
        weights = topk_weights if weights is None else weights
        expert_out = self.fused_experts.apply(a1q, w1, w2, weights, ids, activation, experts,
                                              expert_map, apply_router_weight_on_input)
        output = torch.empty_like(hidden_states)
        self.prepare_finalize.finalize(output, expert_out, weights, ids,
                                       apply_router_weight_on_input,
                                       self.fused_experts.finalize_weight_and_reduce_impl())
        return output


# ----------------------------------------------------------------------- methods
def _weights(layer: torch.nn.Module) -> tuple[Tensor, Tensor]:
    w13, w2 = layer.w13_weight, layer.w2_weight
    assert isinstance(w13, Tensor) and isinstance(w2, Tensor)
    return w13, w2


def experts_native(hidden_states: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor,
                   topk_ids: Tensor) -> Tensor:
    """The ``fused_moe`` op's math in plain PyTorch, for layers' ``forward_native``.

    Dense over experts (every expert sees every token, unselected rows are dropped with
    ``where``), float32 accumulation, no data-dependent shapes or checks, so it traces
    under ``torch.compile(fullgraph=True)``; the op's native reference checks its inputs.
    """
    inter = w2.shape[-1]
    weights = topk_weights.float()
    out = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=torch.float32,
                      device=hidden_states.device)
    for e in range(w13.shape[0]):
        hit = topk_ids == e
        gate_up = F.linear(hidden_states, w13[e])
        y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e]).float()
        out = out + torch.where(hit.any(dim=-1, keepdim=True),
                                y * (weights * hit).sum(dim=-1, keepdim=True), 0.0)
    return out.to(hidden_states.dtype)


class _MoEMethod(CustomOp):
    """What the MoE methods share: ``apply`` and the native experts."""

    def apply(self, layer: Any, x: Optional[Tensor] = None,  # type: ignore[override]
              topk_weights: Optional[Tensor] = None, topk_ids: Optional[Tensor] = None,
              shared_experts: Optional[object] = None,
              shared_experts_input: Optional[Tensor] = None) -> Any:
        """Routed experts of ``layer`` for tokens ``x [M, H]``.

        Called with a function alone (``torch.nn.Module.apply``'s form, as a parent
        module's ``apply`` recursing into this one does), applies it as torch does.
        """
        name = type(self).__name__
        if x is None and topk_weights is None and topk_ids is None:
            return torch.nn.Module.apply(self, layer)
        if x is None or topk_weights is None or topk_ids is None:
            raise TypeError(f"{name}.apply(layer, x, topk_weights, topk_ids): give all three "
                            f"tensors")
        _no_extras(name, "silu", None, shared_experts)
        return self(layer, x, topk_weights, topk_ids)

    def forward_native(self, layer: torch.nn.Module, x: Tensor, topk_weights: Tensor,
                       topk_ids: Tensor) -> Tensor:
        w13, w2 = _weights(layer)
        return experts_native(x, w13, w2, topk_weights, topk_ids)


@CustomOp.register("unquantized_fused_moe")
class UnquantizedFusedMoEMethod(_MoEMethod):
    """Unquantized experts: bf16/fp16/fp32 weights, SiLU-and-mul experts.

    :param moe: the layer's :class:`FusedMoEConfig` (vLLM passes one); optional, since
        the unquantized method needs nothing from it beyond its checks.

    ``apply(layer, x, topk_weights, topk_ids)`` returns the routed output ``[M, H]``:
    enabled, through the catalog op ``fused_moe`` (the best provider for the device);
    disabled, through that op's native reference.
    """

    def __init__(self, moe: Optional[FusedMoEConfig] = None) -> None:
        super().__init__()
        self.moe = moe

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        """Register ``w13_weight [E, 2I, H]`` (gate rows, then up rows) and
        ``w2_weight [E, H, I]`` on ``layer``, uninitialised, with ``extra_weight_attrs``
        (e.g. ``weight_loader``) set on both."""
        for arg, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                           ("intermediate_size_per_partition",
                            intermediate_size_per_partition)):
            if value < 1:
                raise ConfigError(f"UnquantizedFusedMoEMethod.create_weights: {arg} must be "
                                  f">= 1, got {value}")
        inter = intermediate_size_per_partition
        w13 = torch.nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size,
                                             dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        set_weight_attrs(w13, extra_weight_attrs)
        w2 = torch.nn.Parameter(torch.empty(num_experts, hidden_size, inter,
                                            dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w2_weight", w2)
        set_weight_attrs(w2, extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing to repack: the catalog op takes the weights as loaded."""

    def forward_op(self, layer: torch.nn.Module, x: Tensor, topk_weights: Tensor,
                   topk_ids: Tensor) -> Tensor:
        """Through the catalog op ``fused_moe``."""
        w13, w2 = _weights(layer)
        return fused_moe(x, w13, w2, topk_weights, topk_ids)  # type: ignore[no-any-return]

    forward_cuda = forward_xla = forward_npu = forward_cpu = _runs("forward_op")


@CustomOp.register("modular_fused_moe")
class FusedMoEModularMethod(_MoEMethod):
    """A MoE method that applies a modular :class:`FusedMoEKernel`.

    :param old_quant_method: the method that created the layer's weights (as in vLLM, the
        one being swapped out); ``create_weights`` delegates to it.
    :param moe_kernel: the kernel; default: no-EP prepare/finalize and catalog experts.

    Enabled, ``apply`` runs the kernel (so a custom experts or prepare/finalize object
    serves the layer); disabled, the ``fused_moe`` op's native reference.
    """

    def __init__(self, old_quant_method: UnquantizedFusedMoEMethod,
                 moe_kernel: Optional[FusedMoEKernel] = None) -> None:
        super().__init__()
        self.old_quant_method = old_quant_method
        self.moe = old_quant_method.moe
        self.moe_kernel = moe_kernel if moe_kernel is not None else FusedMoEKernel(
            MoEPrepareAndFinalizeNoDPEPModular(), FusedMoECatalogExperts())

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        """The wrapped method's weights (vLLM raises here; delegating is kinder)."""
        self.old_quant_method.create_weights(layer, num_experts, hidden_size,
                                             intermediate_size_per_partition, params_dtype,
                                             **extra_weight_attrs)

    def forward_kernel(self, layer: torch.nn.Module, x: Tensor, topk_weights: Tensor,
                       topk_ids: Tensor) -> Tensor:
        """Through the modular kernel."""
        w13, w2 = _weights(layer)
        return self.moe_kernel.apply(x, w13, w2, topk_weights, topk_ids)

    forward_cuda = forward_xla = forward_npu = forward_cpu = _runs("forward_kernel")
