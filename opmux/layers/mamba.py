"""State-space layers: vLLM 0.32's ``ShortConv`` (``short_conv``) and Mamba-1's
``MambaMixer`` (``mamba_mixer``).

Names, constructor arguments, parameter names (``conv1d.weight`` ``[dim, 1, width]``,
``in_proj``, ``x_proj``, ``dt_proj``, ``A``, ``D``, ``out_proj``; ShortConv's ``conv``) and
forward results follow vLLM 0.32: ``forward(hidden_states, output)`` writes the first
``num_decode_tokens + num_prefill_tokens`` rows of ``output`` in place and returns None.

**State caches and metadata (opmux's choice).** As in vLLM, a layer owns
``kv_cache`` — ``(conv_state,)`` for ShortConv, ``(conv_state, ssm_state)`` for MambaMixer,
shaped by :meth:`get_state_shape` (``[num_slots, dim, width-1]`` and
``[num_slots, intermediate_size, ssm_state_size]``) — which the engine allocates and assigns
(:meth:`allocate_state_cache` does both). The batch description is a :class:`MambaMetadata`
(vLLM's Mamba1/ShortConv attention metadata, reduced to what the layers read): decode tokens
first, then prefill tokens, with per-sequence state slots. A layer receives it as the
``attn_metadata`` argument of ``forward``, or else from the active
:func:`opmux.core.forward_context.forward_context` whose ``metadata`` is a dict keyed by the
layer's ``prefix`` (vLLM's per-layer ``attn_metadata`` dict). Under ``torch.compile`` pass it
as the argument: the token counts are Python ints (one graph per batch composition, as vLLM
captures per size), the index tensors are graph inputs. Without metadata (vLLM's profile
run) no state is touched.

``forward_native`` runs the native (plain PyTorch) references of the ops; the platform paths
call the catalog ops ``causal_conv1d``/``causal_conv1d_update``/``selective_scan``/
``selective_state_update``, so every provider serves the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn import Parameter

from opmux.layers.custom_op import CustomOp, _runs
from opmux.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from opmux.layers.norm import RMSNorm
from opmux.ops import ssm as _ssm

__all__ = ["MambaMetadata", "MambaMixer", "ShortConv"]


@dataclass(frozen=True)
class MambaMetadata:
    """One batch of a state-space layer: ``num_decode_tokens`` decode rows first (one token
    per sequence), then ``num_prefill_tokens`` packed prefill tokens.

    :ivar num_prefills: prefill sequences.
    :ivar num_prefill_tokens: tokens of the prefill sequences.
    :ivar num_decode_tokens: decode sequences (= tokens).
    :ivar query_start_loc_p: ``[num_prefills + 1]`` offsets into the prefill tokens.
    :ivar state_indices_tensor_p: ``[num_prefills]`` state slot of each prefill sequence.
    :ivar has_initial_states_p: ``[num_prefills]`` bool: continue from the slot's state.
    :ivar state_indices_tensor_d: ``[num_decode_tokens]`` state slot of each decode row.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    query_start_loc_p: Tensor | None = None
    state_indices_tensor_p: Tensor | None = None
    has_initial_states_p: Tensor | None = None
    state_indices_tensor_d: Tensor | None = None


class _Kernels(NamedTuple):
    conv: Any
    conv_update: Any
    scan: Any
    state_update: Any


def _kernel_sets(scan: Any, state_update: Any) -> tuple[_Kernels, _Kernels]:
    """``(native references, catalog ops)`` of the causal conv ops and the given scan ops."""
    ops = _Kernels(_ssm.causal_conv1d, _ssm.causal_conv1d_update, scan, state_update)
    return _Kernels(*(op.native for op in ops)), ops


_NATIVE, _OPS = _kernel_sets(_ssm.selective_scan, _ssm.selective_state_update)


def _metadata(layer: Any, given: MambaMetadata | None) -> MambaMetadata | None:
    if given is not None:
        return given
    from opmux.core.errors import OpmuxError
    from opmux.core.forward_context import get_forward_context

    try:
        meta = get_forward_context().metadata
    except OpmuxError:  # no active context: a profile run
        return None
    found = meta.get(layer.prefix) if isinstance(meta, dict) else None
    return found if isinstance(found, MambaMetadata) else None


class _StateLayer(CustomOp):
    """Shared plumbing: platform paths call the catalog ops, native the references."""

    prefix: str
    kv_cache: tuple[Tensor, ...]

    def _run(self, k: _Kernels, hidden_states: Tensor, output: Tensor,
             attn_metadata: MambaMetadata | None) -> None:
        raise NotImplementedError

    def forward_native(self, hidden_states: Tensor, output: Tensor,
                       attn_metadata: MambaMetadata | None = None) -> None:
        self._run(_NATIVE, hidden_states, output, _metadata(self, attn_metadata))

    def forward_op(self, hidden_states: Tensor, output: Tensor,
                   attn_metadata: MambaMetadata | None = None) -> None:
        self._run(_OPS, hidden_states, output, _metadata(self, attn_metadata))

    forward_cuda = forward_xla = forward_npu = forward_cpu = _runs("forward_op")

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def allocate_state_cache(self, num_slots: int, dtype: torch.dtype | None = None,
                             ssm_dtype: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
        """Zeroed state caches of ``num_slots`` slots, assigned to ``kv_cache`` and returned.

        :param dtype: conv state dtype (default: the layer's parameter dtype).
        :param ssm_dtype: SSM state dtype (Mamba keeps it in fp32).
        """
        dev = next(self.parameters()).device
        shapes = self.get_state_shape()
        dtypes = [dtype or next(self.parameters()).dtype, ssm_dtype][: len(shapes)]
        self.kv_cache = tuple(torch.zeros((num_slots, *s), dtype=dt, device=dev)
                              for s, dt in zip(shapes, dtypes, strict=True))
        return self.kv_cache


def _conv_weight(conv: ColumnParallelLinear) -> Tensor:
    return conv.weight.view(conv.weight.size(0), conv.weight.size(2))


@CustomOp.register("short_conv")
class ShortConv(_StateLayer):
    """Gated short convolution (LFM2): ``out_proj(C * conv(B * x))`` with ``B, C, x`` from
    ``in_proj``; the convolution is causal, per channel, without activation.

    :param config: an object with ``conv_L_cache`` (kernel width) and ``conv_bias``.
    :param dim: channels.
    :param layer_idx: index of the layer in the model (kept, as vLLM does).
    :param prefix: the layer's name (key of its metadata in the forward context).
    """

    def __init__(self, config: Any, dim: int, layer_idx: int, model_config: Any = None,
                 cache_config: Any = None, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.conv_dim = dim
        self.L_cache = int(config.conv_L_cache)
        self.bias = bool(config.conv_bias)
        self.conv = ColumnParallelLinear(input_size=self.L_cache, output_size=dim,
                                         bias=self.bias, prefix=f"{prefix}.conv1d")
        self.conv.weight.data = self.conv.weight.data.unsqueeze(1)
        self.in_proj = MergedColumnParallelLinear(input_size=dim, output_sizes=[dim] * 3,
                                                  bias=self.bias, quant_config=quant_config,
                                                  prefix=f"{prefix}.in_proj")
        self.out_proj = RowParallelLinear(input_size=dim, output_size=dim, bias=self.bias,
                                          quant_config=quant_config, prefix=f"{prefix}.out_proj")
        self.kv_cache = (torch.tensor([]),)
        self.model_config = model_config
        self.cache_config = cache_config
        self.prefix = prefix

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        """``((dim, L_cache - 1),)``: one conv state per slot."""
        return ((self.conv_dim, self.L_cache - 1),)

    def _run(self, k: _Kernels, hidden_states: Tensor, output: Tensor,
             attn_metadata: MambaMetadata | None) -> None:
        bcx = self.in_proj(hidden_states)[0]
        b, c, x = bcx.chunk(3, dim=-1)
        if attn_metadata is None:
            output[: hidden_states.shape[0]] = self.out_proj(c * (b * x))[0]
            return
        m = attn_metadata
        nd, npt = m.num_decode_tokens, m.num_prefill_tokens
        bx = b[: nd + npt] * x[: nd + npt]
        weight = _conv_weight(self.conv)
        parts = []
        if nd > 0:
            y = k.conv_update(bx[:nd], self.kv_cache[0], weight, self.conv.bias, None,
                              m.state_indices_tensor_d)
            parts.append(c[:nd] * y)
        if npt > 0:
            y = k.conv(bx[nd:], weight, self.conv.bias, self.kv_cache[0], m.query_start_loc_p,
                       m.state_indices_tensor_p, m.has_initial_states_p, None)
            parts.append(c[nd:nd + npt] * y)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        output[: nd + npt] = self.out_proj(out)[0]


@CustomOp.register("mamba_mixer")
class MambaMixer(_StateLayer):
    """Mamba-1 mixer: gated projection, causal conv, selective scan, output projection.

    Constructor as vLLM 0.32's (``model_config``/``cache_config`` kept, unused;
    ``is_lora_enabled`` accepted, no effect). ``A`` is stored as vLLM stores it after
    loading (``-exp(A_log)``), fp32.
    """

    time_step_rank: int
    ssm_state_size: int
    use_rms_norm: bool
    activation: str
    is_lora_enabled: bool
    conv_kernel_size: int
    intermediate_size: int

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int,
                 intermediate_size: int, time_step_rank: int, use_conv_bias: bool,
                 use_bias: bool, use_rms_norm: bool, rms_norm_has_weight: bool = True,
                 rms_norm_eps: float = 1e-5, activation: str = "silu",
                 is_lora_enabled: bool = False, model_config: Any = None,
                 cache_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.time_step_rank = time_step_rank
        self.ssm_state_size = ssm_state_size
        self.use_rms_norm = use_rms_norm
        self.activation = activation
        self.is_lora_enabled = is_lora_enabled
        self.conv_kernel_size = conv_kernel_size
        self.intermediate_size = intermediate_size
        self.conv1d = ColumnParallelLinear(input_size=conv_kernel_size,
                                           output_size=intermediate_size, bias=use_conv_bias,
                                           prefix=f"{prefix}.conv1d")
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)
        self.in_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                  bias=use_bias, prefix=f"{prefix}.in_proj")
        self.x_proj = RowParallelLinear(intermediate_size, time_step_rank + ssm_state_size * 2,
                                        bias=False, prefix=f"{prefix}.x_proj")
        self.dt_proj = ColumnParallelLinear(time_step_rank, intermediate_size, bias=True,
                                            skip_bias_add=True, prefix=f"{prefix}.dt_proj")
        tp = self.in_proj.tp_size
        self.A = Parameter(torch.empty(intermediate_size // tp, ssm_state_size,
                                       dtype=torch.float32), requires_grad=False)
        self.D = Parameter(torch.ones(intermediate_size // tp), requires_grad=False)
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=use_bias,
                                          input_is_parallel=True, prefix=f"{prefix}.out_proj")

        def norm(size: int) -> RMSNorm | None:
            return RMSNorm(size, eps=rms_norm_eps, has_weight=rms_norm_has_weight) \
                if use_rms_norm else None

        self.dt_layernorm = norm(time_step_rank)
        self.b_layernorm = norm(ssm_state_size)
        self.c_layernorm = norm(ssm_state_size)
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        self.model_config = model_config
        self.cache_config = cache_config
        self.prefix = prefix

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        """``((intermediate, conv_kernel - 1), (intermediate, ssm_state_size))`` per slot."""
        inter = self.intermediate_size // self.in_proj.tp_size
        return ((inter, self.conv_kernel_size - 1), (inter, self.ssm_state_size))

    def _ssm_transform(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        params = self.x_proj(x)[0]
        time_step, b, c = torch.split(
            params, [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        if self.dt_layernorm is not None and self.b_layernorm is not None \
                and self.c_layernorm is not None:
            time_step = self.dt_layernorm(time_step.contiguous())
            b = self.b_layernorm(b.contiguous())
            c = self.c_layernorm(c.contiguous())
        return self.dt_proj(time_step)[0], b, c

    def _dt_bias(self) -> Tensor | None:
        bias = self.dt_proj.bias
        return None if bias is None else bias.float()

    def _run(self, k: _Kernels, hidden_states: Tensor, output: Tensor,
             attn_metadata: MambaMetadata | None) -> None:
        projected = self.in_proj(hidden_states)[0]
        hidden_bc, gate = projected.chunk(2, dim=-1)
        if attn_metadata is None:  # profile run: no state
            output[: hidden_states.shape[0]] = self.out_proj(hidden_bc)[0]
            return
        m = attn_metadata
        nd, npt = m.num_decode_tokens, m.num_prefill_tokens
        conv_state, ssm_state = self.kv_cache
        weight = _conv_weight(self.conv1d)
        bias = self.conv1d.bias
        d = self.D.float()
        parts = []
        if nd > 0:
            x = k.conv_update(hidden_bc[:nd], conv_state, weight, bias, self.activation,
                              m.state_indices_tensor_d)
            dt, b, c = self._ssm_transform(x)
            parts.append(k.state_update(ssm_state, x, dt, self.A, b, c, d, gate[:nd],
                                        self._dt_bias(), True, m.state_indices_tensor_d))
        if npt > 0:
            x = k.conv(hidden_bc[nd:nd + npt], weight, bias, conv_state, m.query_start_loc_p,
                       m.state_indices_tensor_p, m.has_initial_states_p, self.activation)
            dt, b, c = self._ssm_transform(x)
            parts.append(k.scan(x, ssm_state, dt, self.A, b, c, d, gate[nd:nd + npt],
                                self._dt_bias(), True, m.query_start_loc_p,
                                m.state_indices_tensor_p, m.has_initial_states_p))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        output[: nd + npt] = self.out_proj(out)[0]
