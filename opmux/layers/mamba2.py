"""Mamba-2 layers: vLLM 0.32's ``MambaMixer2`` (``mamba_mixer2``) and ``Mixer2RMSNormGated``
(``mixer2_gated_rms_norm``), and PLaMo 2's ``Plamo2MambaMixer`` (``plamo2_mamba_mixer``).

``Plamo2MambaMixer`` is no longer in vLLM 0.32; it follows ``vllm/model_executor/models/
plamo2.py`` of vLLM's main branch at commit ``002fb907`` (the last version that had it).

Parameter names follow vLLM (``in_proj``, ``conv1d.weight`` ``[conv_dim, 1, width]``, ``A``
(stored as vLLM stores it after loading, ``-exp(A_log)``, fp32), ``D``, ``dt_bias``,
``norm.weight``, ``out_proj``; PLaMo 2: ``bcdt_proj``, ``dt_proj``, ``dt_norm``, ``B_norm``,
``C_norm``), so ``load_state_dict`` of a vLLM layer's state works.

**States and batches.** As :mod:`opmux.layers.mamba` (same :class:`MambaMetadata`, same
forward-context lookup by ``prefix``): ``kv_cache = (conv_state, ssm_state)`` shaped by
:meth:`get_state_shape` (``[slots, conv_dim, width-1]`` and ``[slots, heads, head_dim,
state_size]``), decode rows first, then packed prefill tokens, each sequence with its own
state slot. Without metadata (a profile run) no state is touched and the layer projects the
unconvolved, unscanned activations, as vLLM does.

``forward_native`` runs the native references of the ops; the platform paths call the
catalog ops ``causal_conv1d``/``causal_conv1d_update``/``ssd_chunk_scan``/
``ssd_state_update`` (and ``rms_norm_gated`` for the gated norm), so every provider serves
the layers. Tensor parallelism: the projections shard as vLLM's when ``n_groups`` divides the
TP size (``n_groups`` replication for ``n_groups == 1`` with TP > 1 is not supported; the
constructor says so).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter

from opmux.core.errors import ConfigError
from opmux.layers._tensor_parallel import tp_coords
from opmux.layers.custom_op import CustomOp
from opmux.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from opmux.layers.mamba import MambaMetadata, _conv_weight, _kernel_sets, _Kernels, _metadata
from opmux.layers.norm import RMSNorm
from opmux.ops import ssd as _ssd
from opmux.ops.communication import all_reduce
from opmux.ops.layernorm import rms_norm_gated

__all__ = ["MambaMixer2", "Mixer2RMSNormGated", "Plamo2MambaMixer"]


_NATIVE, _OPS = _kernel_sets(_ssd.ssd_chunk_scan, _ssd.ssd_state_update)


@CustomOp.register("mixer2_gated_rms_norm")
class Mixer2RMSNormGated(CustomOp):
    """``weight * rms_norm(x * silu(gate))`` over groups of ``full_hidden_size //
    full_n_groups`` channels (vLLM 0.32). The gate is applied in fp32; without
    ``use_rms_norm`` only the gate is applied (no ``weight``). The platform paths call the
    ``rms_norm_gated`` catalog op (one rounding, where native rounds the normalised ``x`` to
    its dtype before the weight product; equal within the dtype's tolerance)."""

    def __init__(self, full_hidden_size: int, full_n_groups: int, use_rms_norm: bool = True,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self._group = tp_coords(False)
        self.full_hidden_size = full_hidden_size
        self.group_size = full_hidden_size // full_n_groups
        self.per_rank_hidden_size = full_hidden_size // self.tp_size
        self.n_groups = full_hidden_size // self.group_size
        self.variance_epsilon = eps
        self.use_rms_norm = use_rms_norm
        if full_hidden_size % self.tp_size != 0:
            raise ConfigError(f"Mixer2RMSNormGated: the TP size {self.tp_size} must divide "
                              f"full_hidden_size={full_hidden_size}")
        if self.n_groups != 1 and self.n_groups % self.tp_size != 0:
            raise ConfigError(f"Mixer2RMSNormGated: n_groups={self.n_groups} must be 1 or a "
                              f"multiple of the TP size {self.tp_size}")
        if use_rms_norm:
            self.weight: Parameter | None = Parameter(torch.ones(self.per_rank_hidden_size))
        else:
            self.register_parameter("weight", None)

    def forward_native(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        h = x * F.silu(gate.to(torch.float32))
        if self.weight is None:
            return h.to(dtype)
        if self.n_groups == 1:
            sums = h.pow(2).sum(dim=-1, keepdim=True)
            if self.tp_size > 1:
                sums = all_reduce(sums, self._group)
            variance = sums / (self.tp_size * h.shape[-1])
            h = h * torch.rsqrt(variance + self.variance_epsilon)
        else:
            g = h.unflatten(-1, (-1, self.group_size))
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            h = g.flatten(-2)
        return self.weight * h.to(dtype)

    def forward_op(self, x: Tensor, gate: Tensor) -> Tensor:
        if self.weight is None or (self.n_groups == 1 and self.tp_size > 1):
            return self.forward_native(x, gate)
        out: Tensor = rms_norm_gated(x, self.weight.to(x.dtype), gate.to(x.dtype),
                                     self.variance_epsilon,
                                     None if self.n_groups == 1 else self.group_size,
                                     False, "silu")
        return out.to(torch.promote_types(self.weight.dtype, x.dtype))

    forward_cpu = forward_cuda = forward_hip = forward_xla = forward_npu = forward_op


class _Mamba2Base(CustomOp):
    """Shared plumbing of the Mamba-2 mixers: state shapes and caches, the conv + SSD
    sequence of a batch mixing decode rows and prefill sequences."""

    prefix: str
    kv_cache: tuple[Tensor, ...]
    num_heads: int
    head_dim: int
    ssm_state_size: int
    conv_kernel_size: int
    conv_dim: int
    tp_size: int
    activation: str
    chunk_size: int
    conv1d: ColumnParallelLinear
    A: Parameter
    D: Parameter
    dt_bias: Parameter

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        """``((conv_dim, conv_kernel - 1), (heads, head_dim, ssm_state_size))`` per slot
        (this rank's share under TP)."""
        return ((self.conv_dim // self.tp_size, self.conv_kernel_size - 1),
                (self.num_heads // self.tp_size, self.head_dim, self.ssm_state_size))

    def allocate_state_cache(self, num_slots: int, dtype: torch.dtype | None = None,
                             ssm_dtype: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
        """Zeroed ``(conv_state, ssm_state)`` of ``num_slots`` slots, assigned to
        ``kv_cache`` and returned (conv state in ``dtype``, default the parameters' dtype)."""
        dev = self.A.device
        conv_shape, ssm_shape = self.get_state_shape()
        self.kv_cache = (
            torch.zeros((num_slots, *conv_shape), dtype=dtype or self.conv1d.weight.dtype,
                        device=dev),
            torch.zeros((num_slots, *ssm_shape), dtype=ssm_dtype, device=dev))
        return self.kv_cache

    def _ssm_inputs(self, h: Tensor, dt: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Convolved activations (and the rows' projected ``dt``, where the layer has one)
        -> ``(x [t, H, P], B [t, G, N], C [t, G, N], dt [t, H])``."""
        raise NotImplementedError

    def _conv_ssm(self, k: _Kernels, xbc: Tensor, gate: Tensor | None, dt: Tensor | None,
                  m: MambaMetadata) -> Tensor:
        """Conv + SSD over the batch (decode rows, then prefill tokens); ``[t, H * P]``."""
        nd, npt = m.num_decode_tokens, m.num_prefill_tokens
        conv_state, ssm_state = self.kv_cache
        weight = _conv_weight(self.conv1d)
        bias = self.conv1d.bias
        heads = self.num_heads // self.tp_size
        parts = []
        if nd > 0:
            h = k.conv_update(xbc[:nd], conv_state, weight, bias, self.activation,
                              m.state_indices_tensor_d)
            x, b, c, d = self._ssm_inputs(h, None if dt is None else dt[:nd])
            z = None if gate is None else gate[:nd].view(nd, heads, self.head_dim)
            parts.append(k.state_update(x, d, self.A, b, c, ssm_state,
                                        m.state_indices_tensor_d, self.D, z, self.dt_bias,
                                        True))
        if npt > 0:
            h = k.conv(xbc[nd:nd + npt], weight, bias, conv_state, m.query_start_loc_p,
                       m.state_indices_tensor_p, m.has_initial_states_p, self.activation)
            x, b, c, d = self._ssm_inputs(h, None if dt is None else dt[nd:nd + npt])
            z = None if gate is None else gate[nd:nd + npt].view(npt, heads, self.head_dim)
            parts.append(k.scan(x, d, self.A, b, c, ssm_state, m.state_indices_tensor_p,
                                m.query_start_loc_p, m.has_initial_states_p, self.D, z,
                                self.dt_bias, True, 0.0, None, self.chunk_size))
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.flatten(1)


@CustomOp.register("mamba_mixer2")
class MambaMixer2(_Mamba2Base):
    """Mamba-2 mixer (vLLM 0.32): ``in_proj`` to ``[gate | x B C | dt]``, causal conv over
    ``x B C``, the SSD scan (``D`` skip, ``dt_bias`` + softplus), the gated grouped RMS norm
    with ``gate``, ``out_proj``. ``forward(hidden_states, mup_vector=None, attn_metadata=None)``
    returns the output (``[tokens, hidden_size]``; rows past the batch's tokens, if any, are
    the projection of zeros). ``model_config``/``cache_config`` are kept, unused;
    ``chunk_size`` is the SSD block of the native scan (vLLM reads it from the metadata)."""

    intermediate_size: int
    n_groups: int

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int,
                 intermediate_size: int, use_conv_bias: bool, use_bias: bool,
                 n_groups: int = 1, num_heads: int = 128, head_dim: int = 64,
                 rms_norm_eps: float = 1e-5, activation: str = "silu",
                 use_rms_norm: bool = True, model_config: Any = None,
                 cache_config: Any = None, quant_config: Any = None, prefix: str = "",
                 chunk_size: int = 256) -> None:
        super().__init__()
        _, self.tp_size, _ = tp_coords(False)
        if n_groups % self.tp_size != 0:
            raise ConfigError(f"MambaMixer2: n_groups={n_groups} must be a multiple of the TP "
                              f"size {self.tp_size} (group replication is not supported)")
        if num_heads % n_groups != 0 or intermediate_size != num_heads * head_dim:
            raise ConfigError(f"MambaMixer2: need num_heads ({num_heads}) divisible by "
                              f"n_groups ({n_groups}) and intermediate_size "
                              f"({intermediate_size}) == num_heads * head_dim ({head_dim})")
        self.ssm_state_size = ssm_state_size
        self.conv_kernel_size = conv_kernel_size
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.n_groups = n_groups
        self.chunk_size = chunk_size
        self.groups_ssm_state_size = n_groups * ssm_state_size
        self.conv_dim = intermediate_size + 2 * self.groups_ssm_state_size
        gss = self.groups_ssm_state_size
        self.conv1d = MergedColumnParallelLinear(
            input_size=conv_kernel_size, output_sizes=[intermediate_size, gss, gss],
            bias=use_conv_bias, prefix=f"{prefix}.conv1d")
        self.in_proj = MergedColumnParallelLinear(
            input_size=hidden_size,
            output_sizes=[intermediate_size, intermediate_size, gss, gss, num_heads],
            bias=use_bias, quant_config=quant_config, prefix=f"{prefix}.in_proj")
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)
        heads = num_heads // self.tp_size
        self.A = Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.D = Parameter(torch.ones(heads), requires_grad=False)
        self.dt_bias = Parameter(torch.ones(heads), requires_grad=False)
        self.use_rms_norm = use_rms_norm
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=use_bias,
                                          input_is_parallel=True, quant_config=quant_config,
                                          prefix=f"{prefix}.out_proj")
        self.norm = Mixer2RMSNormGated(intermediate_size, n_groups, use_rms_norm,
                                       eps=rms_norm_eps)
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        self.model_config = model_config
        self.cache_config = cache_config
        self.prefix = prefix

    def _ssm_inputs(self, h: Tensor, dt: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        inter = self.intermediate_size // self.tp_size
        gss = self.groups_ssm_state_size // self.tp_size
        x, b, c = torch.split(h, [inter, gss, gss], dim=-1)
        t, groups = h.shape[0], self.n_groups // self.tp_size
        assert dt is not None
        return (x.view(t, self.num_heads // self.tp_size, self.head_dim),
                b.view(t, groups, self.ssm_state_size), c.view(t, groups, self.ssm_state_size),
                dt)

    def _forward(self, k: _Kernels, hidden_states: Tensor, mup_vector: Tensor | None,
                 attn_metadata: MambaMetadata | None) -> Tensor:
        projected = self.in_proj(hidden_states)[0]
        if mup_vector is not None:
            projected = projected * mup_vector
        inter = self.intermediate_size // self.tp_size
        gss = self.groups_ssm_state_size // self.tp_size
        heads = self.num_heads // self.tp_size
        gate = projected[..., :inter]
        xbc, dt = torch.split(projected[..., inter:], [inter + 2 * gss, heads], dim=-1)
        m = _metadata(self, attn_metadata)
        if m is None:  # profile run: no state touched
            ssm_out = xbc[..., :inter]
        else:
            n = m.num_decode_tokens + m.num_prefill_tokens
            ssm_out = torch.zeros_like(gate)
            if n > 0:
                ssm_out[:n] = self._conv_ssm(k, xbc, None, dt, m)
        out: Tensor = self.out_proj(self.norm(ssm_out, gate))[0]
        return out

    def forward_native(self, hidden_states: Tensor, mup_vector: Tensor | None = None,
                       attn_metadata: MambaMetadata | None = None) -> Tensor:
        return self._forward(_NATIVE, hidden_states, mup_vector, attn_metadata)

    def forward_op(self, hidden_states: Tensor, mup_vector: Tensor | None = None,
                   attn_metadata: MambaMetadata | None = None) -> Tensor:
        return self._forward(_OPS, hidden_states, mup_vector, attn_metadata)

    forward_cpu = forward_cuda = forward_hip = forward_xla = forward_npu = forward_op


def _hf_config(vllm_config: Any) -> Any:
    model_config = getattr(vllm_config, "model_config", None)
    return getattr(model_config, "hf_config", None) or vllm_config


@CustomOp.register("plamo2_mamba_mixer")
class Plamo2MambaMixer(_Mamba2Base):
    """PLaMo 2's Mamba mixer: ``in_proj`` to ``[gate | x]``, causal conv (SiLU) over ``x``,
    ``bcdt_proj`` to ``B, C, time_step`` (each RMS-normed), ``dt = dt_proj(time_step)``, the
    SSD scan with one group and the gate inside (``y * silu(gate)``), ``out_proj``.

    :param vllm_config: an object with ``model_config.hf_config``, or the HF config itself:
        ``hidden_size``, ``mamba_d_state``, ``mamba_d_conv``, ``mamba_num_heads``,
        ``hidden_size_per_head``, ``rms_norm_eps``, ``mamba_chunk_size``.
    :param prefix: the layer's name (key of its metadata in the forward context).

    ``forward(hidden_states, output, attn_metadata=None)`` writes the batch's rows of
    ``output`` in place and returns None (as vLLM's).
    """

    def __init__(self, vllm_config: Any, *, prefix: str = "", **kwargs: Any) -> None:
        super().__init__()
        config = self.config = _hf_config(vllm_config)
        _, self.tp_size, _ = tp_coords(False)
        self.hidden_size = int(config.hidden_size)
        self.ssm_state_size = int(config.mamba_d_state)
        self.conv_kernel_size = int(config.mamba_d_conv)
        self.head_dim = int(config.hidden_size_per_head)
        self.num_heads = int(config.mamba_num_heads)
        self.intermediate_size = self.num_heads * self.head_dim
        self.conv_dim = self.intermediate_size
        self.time_step_rank = max(64, self.hidden_size // 16)
        self.chunk_size = int(config.mamba_chunk_size)
        self.conv1d = ColumnParallelLinear(self.conv_kernel_size, self.intermediate_size,
                                           bias=False, prefix=f"{prefix}.conv1d")
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)
        self.in_proj = MergedColumnParallelLinear(self.hidden_size,
                                                  [self.intermediate_size] * 2, bias=False,
                                                  prefix=f"{prefix}.in_proj")
        self.bcdt_proj = RowParallelLinear(self.intermediate_size,
                                           self.time_step_rank + self.ssm_state_size * 2,
                                           bias=False, prefix=f"{prefix}.bcdt_proj")
        self.dt_proj = ColumnParallelLinear(self.time_step_rank, self.num_heads, bias=False,
                                            prefix=f"{prefix}.dt_proj")
        heads = self.num_heads // self.tp_size
        self.A = Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.D = Parameter(torch.ones(heads), requires_grad=False)
        self.dt_bias = Parameter(torch.ones(heads), requires_grad=False)
        self.out_proj = RowParallelLinear(self.intermediate_size, self.hidden_size,
                                          bias=False, input_is_parallel=True,
                                          prefix=f"{prefix}.out_proj")
        self.activation = "silu"
        eps = float(config.rms_norm_eps)
        self.dt_norm = RMSNorm(self.time_step_rank, eps=eps)
        self.B_norm = RMSNorm(self.ssm_state_size, eps=eps)
        self.C_norm = RMSNorm(self.ssm_state_size, eps=eps)
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        self.prefix = prefix

    def _ssm_inputs(self, xbc: Tensor, dt: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        params = self.bcdt_proj(xbc.contiguous())[0]
        b, c, time_step = torch.split(
            params, [self.ssm_state_size, self.ssm_state_size, self.time_step_rank], dim=-1)
        time_step = self.dt_norm(time_step.contiguous())
        b = self.B_norm(b.contiguous())
        c = self.C_norm(c.contiguous())
        t = xbc.shape[0]
        return (xbc.view(t, self.num_heads // self.tp_size, self.head_dim),
                b.unsqueeze(1), c.unsqueeze(1), self.dt_proj(time_step)[0])

    def _forward(self, k: _Kernels, hidden_states: Tensor, output: Tensor,
                 attn_metadata: MambaMetadata | None) -> None:
        gate, hidden = self.in_proj(hidden_states)[0].chunk(2, dim=-1)
        m = _metadata(self, attn_metadata)
        if m is None:  # profile run
            output[:] = self.out_proj(hidden.contiguous())[0]
            return
        n = m.num_decode_tokens + m.num_prefill_tokens
        if n > 0:
            output[:n] = self.out_proj(self._conv_ssm(k, hidden, gate, None, m))[0]

    def forward_native(self, hidden_states: Tensor, output: Tensor,
                       attn_metadata: MambaMetadata | None = None) -> None:
        self._forward(_NATIVE, hidden_states, output, attn_metadata)

    def forward_op(self, hidden_states: Tensor, output: Tensor,
                   attn_metadata: MambaMetadata | None = None) -> None:
        self._forward(_OPS, hidden_states, output, attn_metadata)

    forward_cpu = forward_cuda = forward_hip = forward_xla = forward_npu = forward_op
