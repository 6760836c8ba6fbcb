"""The :class:`FusedMoE` layer: router, experts, optional shared experts, one opaque op.

On a platform path (``forward_cpu``, ``forward_cuda``, ...) the layer computes the router
logits and then calls one *layer op*, ``opmux::moe_forward`` (or
``opmux::moe_forward_shared`` when it has shared experts), passing its ``layer_name``.
The op resolves the layer in the active :func:`~opmux.core.forward_context.forward_context`
when it executes and runs routing, experts and shared experts there. Under
``torch.compile(fullgraph=True)`` the whole mixture is one node: no data-dependent
shapes reach the compiler. ``forward_native`` (the layer disabled with
``opmux.set_custom_ops("all,-fused_moe")``) runs the same computation in line.

The layer returns ``(shared_output, fused_output)`` as engines do; ``shared_output`` is
``None`` without shared experts.

Tensor parallelism: each TP rank of :mod:`opmux.distributed` holds every expert
with a ``1/tp`` slice of its intermediate dimension (``w13_weight [E, 2I/tp, d]``: this
rank's gate rows, then its up rows; ``w2_weight [E, d, I/tp]``), and the shared experts
likewise; each rank computes partial sums that are all-reduced through the catalog op
:func:`~opmux.ops.communication.all_reduce_` (``reduce_results=True``, outside the layer
op, so a compiled graph shows the collective). The router is replicated.
:meth:`FusedMoE.weight_loader` takes full checkpoint tensors and keeps this rank's slice.

>>> import torch, opmux
>>> from opmux.core.forward_context import forward_context
>>> from opmux.layers.moe import FusedMoE
>>> moe = FusedMoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16,
...                layer_name="model.layers.0.mlp")
>>> with forward_context(layers={moe.layer_name: moe}):
...     shared, fused = moe(torch.randn(3, 8))
>>> shared is None, tuple(fused.shape)
(True, (3, 8))
"""

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.errors import ConfigError, OpInputError
from opmux.core.forward_context import register_layer_op
from opmux.distributed import divide
from opmux.layers._tensor_parallel import copy_checked, narrow_full, tp_coords
from opmux.layers.custom_op import CustomOp, _runs
from opmux.layers.moe_methods import experts_native
from opmux.ops.communication import all_reduce_
from opmux.ops.moe import fused_moe, grouped_topk, topk_softmax

__all__ = ["FusedMoE", "MoEOutput", "SharedExpertsMLP", "TransformersFusedMoE", "moe_forward",
           "moe_forward_shared", "transformers_moe_forward"]

#: What :class:`FusedMoE` returns: one tensor when called with ``router_logits`` (vLLM's
#: form), else ``(shared_output, fused_output)``.
MoEOutput = Tensor | tuple[Optional[Tensor], Tensor]


class SharedExpertsMLP(torch.nn.Module):
    """The always-on experts of a MoE block: one SiLU-and-mul MLP.

    :param hidden_size: d.
    :param intermediate_size: width of the shared MLP (all shared experts together).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *,
                 dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        #: gate and up projections stacked, ``[2 * intermediate, hidden]``.
        self.gate_up_weight = torch.nn.Parameter(
            torch.empty(2 * intermediate_size, hidden_size, dtype=dtype, device=device))
        #: down projection, ``[hidden, intermediate]``.
        self.down_weight = torch.nn.Parameter(
            torch.empty(hidden_size, intermediate_size, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal init scaled by fan-in."""
        with torch.no_grad():
            self.gate_up_weight.normal_(0.0, self.gate_up_weight.shape[1] ** -0.5)
            self.down_weight.normal_(0.0, self.down_weight.shape[1] ** -0.5)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = F.linear(x, self.gate_up_weight)
        inter = self.intermediate_size
        return F.linear(F.silu(gate_up[..., :inter]) * gate_up[..., inter:], self.down_weight)


@CustomOp.register("fused_moe")
class FusedMoE(CustomOp):
    """Mixture-of-experts block with a router, routed experts and optional shared experts.

    :param num_experts: E routed experts.
    :param top_k: experts per token.
    :param hidden_size: d.
    :param intermediate_size: I, per routed expert.
    :param layer_name: unique name of this layer in the model (the key the layer op
        resolves in the forward context).
    :param renormalize: renormalise the top-k routing weights to sum 1.
    :param num_expert_group: with ``topk_group``, route DeepSeek-style through
        :func:`~opmux.ops.moe.grouped_topk`; ``None``: plain top-k softmax.
    :param topk_group: groups kept per token (grouped routing only).
    :param scoring_func: ``"softmax"`` or ``"sigmoid"`` (grouped routing only).
    :param use_correction_bias: add an ``e_score_correction_bias`` parameter (DeepSeek-V3).
    :param routed_scaling_factor: multiplies the routing weights (grouped routing only).
    :param shared_intermediate_size: width of the shared-experts MLP; ``0``: none.
    :param reduce_results: all-reduce the TP ranks' partial outputs (default); otherwise
        each rank returns its partial sums (the caller reduces).
    :param disable_tp: do not shard (every rank holds the full experts).

    vLLM 0.32's ``FusedMoE`` (``FusedMoEFactory``) arguments are accepted under its names:

    :param params_dtype: the parameters' dtype (same as ``dtype``).
    :param prefix: the layer's name in the model, used as ``layer_name`` when that is empty.
    :param use_grouped_topk: route through ``grouped_topk``; ``False`` keeps plain top-k
        softmax even with ``num_expert_group`` / ``topk_group`` given (vLLM's meaning);
        ``None``: grouped iff the group sizes are given.
    :param e_score_correction_bias: a ``[E]`` tensor owned by the caller (vLLM's form;
        DeepSeek-V3 keeps it on its gate) instead of ``use_correction_bias``.
    :param shared_experts: a module computing the shared experts' output from the hidden
        states (vLLM's form), instead of ``shared_intermediate_size``. Under TP it must return
        this rank's partial sums (as vLLM's, built with ``reduce_results=False``).
    :param activation: ``"silu"`` (the only expert activation of the ``fused_moe`` op).
    :param tp_size: ``None`` (the TP group's size) or ``1`` (no sharding, as ``disable_tp``).

    The forward takes vLLM's ``(hidden_states, router_logits)`` and then returns one tensor,
    shared plus routed output (reduced across TP ranks once); called with the hidden states
    alone it routes through its own ``gate_weight`` and returns
    ``(shared_output, fused_output)``. vLLM 0.32 keeps the expert weights on a
    ``routed_experts`` submodule; opmux keeps them on the layer (``w13_weight``,
    ``w2_weight``), as vLLM's ``FusedMoE`` layer class did before.

    :raises ConfigError: inconsistent sizes or routing options.
    :raises opmux.distributed.ParallelSizeError: the TP size does not divide
        ``intermediate_size`` or ``shared_intermediate_size``.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    layer_name: str
    renormalize: bool
    num_expert_group: Optional[int]
    topk_group: Optional[int]
    scoring_func: str
    routed_scaling_factor: float
    use_grouped_topk: bool
    activation: str
    reduce_results: bool

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 *, layer_name: str = "", renormalize: bool = True,
                 num_expert_group: Optional[int] = None, topk_group: Optional[int] = None,
                 scoring_func: str = "softmax", use_correction_bias: bool = False,
                 routed_scaling_factor: float = 1.0, shared_intermediate_size: int = 0,
                 dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None, reduce_results: bool = True,
                 disable_tp: bool = False, params_dtype: Optional[torch.dtype] = None,
                 prefix: str = "", use_grouped_topk: Optional[bool] = None,
                 e_score_correction_bias: Optional[Tensor] = None,
                 shared_experts: Optional[torch.nn.Module] = None,
                 activation: str = "silu", tp_size: Optional[int] = None) -> None:
        super().__init__()
        layer_name = layer_name or prefix
        dtype = _merge_dtype(layer_name, dtype, params_dtype)
        grouped = _grouped_routing(layer_name, use_grouped_topk, num_expert_group, topk_group)
        _check_config(num_experts, top_k, hidden_size, intermediate_size, layer_name,
                      num_expert_group if grouped else None, topk_group if grouped else None,
                      scoring_func,
                      use_correction_bias or e_score_correction_bias is not None)
        _check_vllm_extras(layer_name, num_experts, activation, e_score_correction_bias,
                           shared_experts, shared_intermediate_size)
        self.tp_rank, self.tp_size, self.tp_group_name = tp_coords(
            disable_tp or tp_size == 1)
        if tp_size is not None and tp_size != self.tp_size:
            raise ConfigError(f"FusedMoE(layer_name={layer_name!r}): tp_size={tp_size} differs "
                              f"from the tensor-parallel group's size {self.tp_size}; pass "
                              f"None (the group's size) or 1 (no sharding)")
        where = f"FusedMoE(layer_name={layer_name!r})"
        #: this rank's slice of the expert intermediate size
        self.intermediate_size_per_partition = divide(
            intermediate_size, self.tp_size, f"{where} intermediate_size")
        shared_per_partition = divide(shared_intermediate_size, self.tp_size,
                                      f"{where} shared_intermediate_size")
        self.use_grouped_topk = grouped
        self.activation = activation
        self.reduce_results = reduce_results
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.layer_name = layer_name
        self.renormalize = renormalize
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.scoring_func = scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        #: router, ``[E, d]``.
        self.gate_weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        inter = self.intermediate_size_per_partition
        #: routed experts' gate and up projections, ``[E, 2I/tp, d]``.
        self.w13_weight = torch.nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size, **factory))
        #: routed experts' down projections, ``[E, d, I/tp]``.
        self.w2_weight = torch.nn.Parameter(
            torch.empty(num_experts, hidden_size, inter, **factory))
        self.e_score_correction_bias: Optional[Tensor] = (
            e_score_correction_bias if e_score_correction_bias is not None
            else torch.nn.Parameter(torch.zeros(num_experts, dtype=torch.float32,
                                                device=device))
            if use_correction_bias else None)
        self.shared_experts: Optional[torch.nn.Module] = (
            shared_experts if shared_experts is not None
            else SharedExpertsMLP(hidden_size, shared_per_partition, **factory)
            if shared_intermediate_size else None)
        self.reset_parameters()
        for param in self.parameters():
            if not hasattr(param, "weight_loader"):  # a given shared_experts keeps its own
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def reset_parameters(self) -> None:
        """Normal init scaled by fan-in (router, experts, shared experts)."""
        with torch.no_grad():
            if isinstance(getattr(self, "gate_weight", None), torch.nn.Parameter):
                self.gate_weight.normal_(0.0, self.hidden_size ** -0.5)
            self.w13_weight.normal_(0.0, self.hidden_size ** -0.5)
            self.w2_weight.normal_(0.0, self.intermediate_size ** -0.5)
        if isinstance(self.shared_experts, SharedExpertsMLP):
            self.shared_experts.reset_parameters()

    # ----------------------------------------------------------- weight loading
    def weight_loader(self, param: torch.nn.Parameter, loaded_weight: Tensor,
                      weight_name: str = "", shard_id: Optional[str] = None,
                      expert_id: Optional[int] = None) -> None:
        """Load a FULL checkpoint tensor into ``param``, keeping this rank's slice.

        * ``w13_weight``: with ``expert_id`` and ``shard_id`` ``"w1"`` (gate) or ``"w3"``
          (up), one expert's ``[I, d]`` projection; with neither, all experts stacked
          ``[E, 2I, d]`` (gate rows first).
        * ``w2_weight``: with ``expert_id`` (``shard_id`` ``"w2"`` or ``None``), one
          expert's ``[d, I]``; with neither, ``[E, d, I]``.
        * shared experts: ``gate_up_weight [2I_s, d]`` and ``down_weight [d, I_s]`` in full.
        * the router (``gate_weight``) and ``e_score_correction_bias``: copied whole.

        ``weight_name`` is accepted for vLLM's call convention and not used.

        :raises opmux.OpInputError: a shape that is not the full tensor, or a bad
            ``shard_id`` / ``expert_id``.
        """
        name = "FusedMoE"
        rank, inter = self.tp_rank, self.intermediate_size_per_partition
        shared = (self.shared_experts if isinstance(self.shared_experts, SharedExpertsMLP)
                  else None)
        if param is self.w13_weight or (shared is not None and param is shared.gate_up_weight):
            per = inter if param is self.w13_weight else shared.intermediate_size  # type: ignore[union-attr]
            if param is self.w13_weight and expert_id is not None:
                half = {"w1": 0, "w3": 1}.get(shard_id or "")
                if half is None:
                    raise OpInputError(f"{name}.weight_loader: argument 'shard_id': expected "
                                       f"'w1' or 'w3' for w13_weight, got {shard_id!r}",
                                       op=name, argument="shard_id")
                src = narrow_full(name, loaded_weight, 0, per * self.tp_size, rank * per, per)
                copy_checked(name, param.data[self._expert(expert_id)]
                             .narrow(0, half * per, per), src)
                return
            dim = param.dim() - 2  # the 2I dimension
            full = narrow_full(name, loaded_weight, dim, 2 * per * self.tp_size, 0,
                               2 * per * self.tp_size)
            gate, up = full.chunk(2, dim)
            copy_checked(name, param.data, torch.cat(
                [gate.narrow(dim, rank * per, per), up.narrow(dim, rank * per, per)], dim))
            return
        if param is self.w2_weight or (shared is not None and param is shared.down_weight):
            per = inter if param is self.w2_weight else shared.intermediate_size  # type: ignore[union-attr]
            dst = param.data
            if param is self.w2_weight and expert_id is not None:
                if shard_id not in (None, "w2"):
                    raise OpInputError(f"{name}.weight_loader: argument 'shard_id': expected "
                                       f"'w2' for w2_weight, got {shard_id!r}",
                                       op=name, argument="shard_id")
                dst = dst[self._expert(expert_id)]
            src = narrow_full(name, loaded_weight, loaded_weight.dim() - 1,
                              per * self.tp_size, rank * per, per)
            copy_checked(name, dst, src)
            return
        copy_checked(name, param.data, loaded_weight)

    def _expert(self, expert_id: int) -> int:
        if not 0 <= expert_id < self.num_experts:
            raise OpInputError(f"FusedMoE.weight_loader: argument 'expert_id': expected an "
                               f"expert in [0, {self.num_experts}), got {expert_id}",
                               op="FusedMoE", argument="expert_id")
        return expert_id

    # ------------------------------------------------------------------ compute
    def route(self, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(topk_weights, topk_ids)`` for ``router_logits [T, E]``."""
        if (self.use_grouped_topk and self.num_expert_group is not None
                and self.topk_group is not None):
            return grouped_topk(router_logits, self.top_k, self.renormalize,  # type: ignore[no-any-return]
                                self.num_expert_group, self.topk_group, self.scoring_func,
                                self.e_score_correction_bias, self.routed_scaling_factor)
        return topk_softmax(router_logits, self.top_k, self.renormalize)  # type: ignore[no-any-return]

    def forward_impl(self, hidden_states: Tensor, router_logits: Tensor
                     ) -> tuple[Optional[Tensor], Tensor]:
        """Routing, routed experts and shared experts for 2-D ``hidden_states [T, d]``."""
        topk_weights, topk_ids = self.route(router_logits)
        fused = fused_moe(hidden_states, self.w13_weight, self.w2_weight, topk_weights,
                          topk_ids)
        shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        return shared, fused

    def _flatten(self, hidden_states: Tensor, router_logits: Optional[Tensor]
                 ) -> tuple[Tensor, Tensor]:
        x = hidden_states.reshape(-1, self.hidden_size)
        if router_logits is not None:
            return x, router_logits.reshape(-1, self.num_experts)
        return x, F.linear(x, self.gate_weight)

    def _reduce(self, t: Tensor) -> Tensor:
        if self.reduce_results and self.tp_size > 1:
            all_reduce_(t, self.tp_group_name)  # the experts' fresh partial sums: no copy
        return t

    def _finish(self, shape: torch.Size, shared: Optional[Tensor], fused: Tensor,
                combined: bool) -> MoEOutput:
        if combined:  # vLLM's form: one tensor, shared + routed, one all-reduce
            return self._reduce(fused if shared is None else shared + fused).view(shape)
        return (None if shared is None else self._reduce(shared).view(shape),
                self._reduce(fused).view(shape))

    def forward_native(self, hidden_states: Tensor, router_logits: Optional[Tensor] = None
                       ) -> MoEOutput:
        """The computation in line (ops still dispatch to their providers).

        :param hidden_states: ``[..., d]``.
        :param router_logits: ``[T, E]`` computed by the caller's gate (vLLM's form): the
            result is one tensor, shared plus routed output. ``None``: this layer's
            ``gate_weight`` routes and the result is ``(shared_output, fused_output)``.
        """
        x, logits = self._flatten(hidden_states, router_logits)
        shared, fused = self.forward_impl(x, logits)
        return self._finish(hidden_states.shape, shared, fused, router_logits is not None)

    def forward_layer_op(self, hidden_states: Tensor, router_logits: Optional[Tensor] = None
                         ) -> MoEOutput:
        """Through the layer op: one opaque node resolved by ``layer_name`` at run time."""
        x, logits = self._flatten(hidden_states, router_logits)
        if self.shared_experts is None:
            shared, fused = None, moe_forward(self.layer_name, x, logits)
        else:
            shared, fused = moe_forward_shared(self.layer_name, x, logits)
        return self._finish(hidden_states.shape, shared, fused, router_logits is not None)

    forward_cuda = forward_xla = forward_npu = forward_cpu = _runs("forward_layer_op")

    def extra_repr(self) -> str:
        routing = (f"grouped(groups={self.num_expert_group}, keep={self.topk_group}, "
                   f"{self.scoring_func})" if self.num_expert_group is not None else "softmax")
        shared = (self.shared_experts.intermediate_size
                  if isinstance(self.shared_experts, SharedExpertsMLP)
                  else -1 if self.shared_experts is not None else 0)
        return (f"layer_name={self.layer_name!r}, experts={self.num_experts}, "
                f"top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, routing={routing}, "
                f"shared_intermediate={shared}, tp_size={self.tp_size}")


@CustomOp.register("transformers_fused_moe")
class TransformersFusedMoE(FusedMoE):
    """The experts of a Hugging Face Transformers MoE block, routed by the model itself.

    vLLM's Transformers backend replaces a model's ``experts`` module with this layer; the
    model computes the routing and calls ``experts(hidden_states, topk_ids, topk_weights)``.
    Semantics follow vLLM's ``TransformersFusedMoE`` as last shipped
    (``vllm/model_executor/models/transformers/moe.py``, after v0.11.0; it is gone in 0.32):
    the constructor is :class:`FusedMoE`'s, the forward runs the routed experts with the
    given routing (ids as int32, weights as float32) and all-reduces the result across TP
    ranks when ``reduce_results``. It has no router (``gate_weight``) and no shared
    experts: the model keeps both.

    The platform paths call the layer op ``opmux::transformers_moe_forward`` (one opaque
    node resolved by ``layer_name`` in the forward context, as vLLM does); the disabled
    path runs the same math in plain PyTorch in line.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.shared_experts is not None:
            raise ConfigError(f"TransformersFusedMoE(layer_name={self.layer_name!r}): shared "
                              f"experts belong to the Transformers model, not this layer")
        del self.gate_weight  # the model routes

    def _routed(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                native: bool) -> Tensor:
        x = hidden_states.reshape(-1, self.hidden_size)
        ids = topk_ids.reshape(x.shape[0], -1).to(torch.int32)
        weights = topk_weights.reshape(x.shape[0], -1).to(torch.float32)
        out = (experts_native(x, self.w13_weight, self.w2_weight, weights, ids) if native
               else transformers_moe_forward(self.layer_name, x, ids, weights))
        return self._reduce(out).view(hidden_states.shape)

    def forward_native(self, hidden_states: Tensor, topk_ids: Tensor,  # type: ignore[override]
                       topk_weights: Tensor, **kwargs: Any) -> Tensor:
        """Experts for ``hidden_states [..., d]`` routed by ``topk_ids`` / ``topk_weights``
        ``[T, k]``; extra keyword arguments of the Transformers call are ignored."""
        return self._routed(hidden_states, topk_ids, topk_weights, native=True)

    def forward_layer_op(self, hidden_states: Tensor,  # type: ignore[override]
                         topk_ids: Tensor, topk_weights: Tensor, **kwargs: Any) -> Tensor:
        return self._routed(hidden_states, topk_ids, topk_weights, native=False)


def _merge_dtype(layer_name: str, dtype: Optional[torch.dtype],
                 params_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    if dtype is not None and params_dtype is not None and dtype != params_dtype:
        raise ConfigError(f"FusedMoE(layer_name={layer_name!r}): dtype={dtype} and "
                          f"params_dtype={params_dtype} disagree; give one")
    return dtype if dtype is not None else params_dtype


def _grouped_routing(layer_name: str, use_grouped_topk: Optional[bool],
                     num_expert_group: Optional[int], topk_group: Optional[int]) -> bool:
    """vLLM's ``use_grouped_topk``; ``None`` (opmux's form): grouped iff both group sizes."""
    if use_grouped_topk is None:
        return num_expert_group is not None or topk_group is not None
    if use_grouped_topk and (num_expert_group is None or topk_group is None):
        raise ConfigError(f"FusedMoE(layer_name={layer_name!r}): use_grouped_topk=True needs "
                          f"num_expert_group and topk_group, got num_expert_group="
                          f"{num_expert_group}, topk_group={topk_group}")
    return use_grouped_topk


def _check_vllm_extras(layer_name: str, num_experts: int, activation: str,
                       e_score_correction_bias: Optional[Tensor],
                       shared_experts: Optional[torch.nn.Module],
                       shared_intermediate_size: int) -> None:
    where = f"FusedMoE(layer_name={layer_name!r})"
    if activation != "silu":
        raise ConfigError(f"{where}: activation must be 'silu' (the fused_moe op's "
                          f"SiLU-and-mul experts), got {activation!r}")
    if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (
            num_experts,):
        raise ConfigError(f"{where}: e_score_correction_bias must have shape "
                          f"({num_experts},), got {tuple(e_score_correction_bias.shape)}")
    if shared_experts is not None and shared_intermediate_size:
        raise ConfigError(f"{where}: give shared_experts (a module) or "
                          f"shared_intermediate_size, not both")


def _check_config(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                  layer_name: str, num_expert_group: Optional[int], topk_group: Optional[int],
                  scoring_func: str, use_correction_bias: bool) -> None:
    where = f"FusedMoE(layer_name={layer_name!r})"
    if not isinstance(layer_name, str) or not layer_name:
        raise ConfigError(f"{where}: layer_name must be a non-empty string")
    for arg, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                       ("intermediate_size", intermediate_size)):
        if value < 1:
            raise ConfigError(f"{where}: {arg} must be >= 1, got {value}")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"{where}: top_k must be in [1, num_experts={num_experts}], "
                          f"got {top_k}")
    if (num_expert_group is None) != (topk_group is None):
        raise ConfigError(f"{where}: give both num_expert_group and topk_group for grouped "
                          f"routing, or neither; got num_expert_group={num_expert_group}, "
                          f"topk_group={topk_group}")
    if num_expert_group is not None and topk_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ConfigError(f"{where}: num_expert_group must divide num_experts="
                              f"{num_experts}, got {num_expert_group}")
        if not 1 <= topk_group <= num_expert_group:
            raise ConfigError(f"{where}: topk_group must be in [1, {num_expert_group}], "
                              f"got {topk_group}")
        if top_k > topk_group * (num_experts // num_expert_group):
            kept = topk_group * (num_experts // num_expert_group)
            raise ConfigError(f"{where}: top_k={top_k} exceeds the {kept} experts of "
                              f"topk_group={topk_group} groups")
    elif scoring_func != "softmax" or use_correction_bias:
        raise ConfigError(f"{where}: scoring_func and use_correction_bias apply to grouped "
                          f"routing only; set num_expert_group and topk_group")
    if scoring_func not in ("softmax", "sigmoid"):
        raise ConfigError(f"{where}: scoring_func must be 'softmax' or 'sigmoid', "
                          f"got {scoring_func!r}")


# ------------------------------------------------------------------ layer ops
def _fake_fused(layer_name: str, hidden_states: Tensor, router_logits: Tensor) -> Tensor:
    return torch.empty_like(hidden_states)


def _fake_shared(layer_name: str, hidden_states: Tensor, router_logits: Tensor
                 ) -> tuple[Tensor, Tensor]:
    return torch.empty_like(hidden_states), torch.empty_like(hidden_states)


@register_layer_op("moe_forward", fake=_fake_fused)
def moe_forward(layer: FusedMoE, hidden_states: Tensor, router_logits: Tensor) -> Tensor:
    """Routed experts of the layer ``layer_name`` (resolved at run time)."""
    return layer.forward_impl(hidden_states, router_logits)[1]


@register_layer_op("moe_forward_shared", fake=_fake_shared)
def moe_forward_shared(layer: FusedMoE, hidden_states: Tensor, router_logits: Tensor
                       ) -> tuple[Tensor, Tensor]:
    """``(shared_output, fused_output)`` of the layer ``layer_name`` (resolved at run time)."""
    shared, fused = layer.forward_impl(hidden_states, router_logits)
    if shared is None:
        from opmux.core.errors import OpmuxError

        raise OpmuxError(f"moe_forward_shared: layer {layer.layer_name!r} has no shared "
                         f"experts; call moe_forward")
    return shared, fused


def _fake_transformers(layer_name: str, hidden_states: Tensor, topk_ids: Tensor,
                       topk_weights: Tensor) -> Tensor:
    return torch.empty_like(hidden_states)


@register_layer_op("transformers_moe_forward", fake=_fake_transformers)
def transformers_moe_forward(layer: TransformersFusedMoE, hidden_states: Tensor,
                             topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
    """Routed experts of the layer ``layer_name`` with the model's routing (catalog op)."""
    return fused_moe(hidden_states, layer.w13_weight,  # type: ignore[no-any-return]
                     layer.w2_weight, topk_weights, topk_ids)
