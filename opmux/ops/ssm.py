"""State-space ops of Mamba-style layers: causal short convolutions and the Mamba-1 scan.

Semantics follow vLLM's ``mamba/ops/causal_conv1d.py`` and ``mamba/ops/mamba_ssm.py``, with
one layout choice of ours: activations are **token-major** (``[T, dim]``, as the projections
produce them; vLLM passes the transposed ``[dim, T]`` views of the same data), and ``B``/``C``
are ``[T, dstate]`` (Mamba-1 has one group). State caches keep vLLM's layout:
``conv_states[num_slots, dim, width-1]`` (oldest input first) and
``ssm_states[num_slots, dim, dstate]``.

Packed prefill: sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]`` and
the state slot ``cache_indices[i]``; its initial state is read from that slot when
``has_initial_state[i]`` (zeros otherwise) and its final state is written back there. A slot
index of ``-1`` marks a padding entry (no state read or written, output rows zero; vLLM 0.32
uses a null block 0 for this, opmux keeps ``-1`` as ``reshape_and_cache`` does). Without
``query_start_loc`` the tokens form one sequence; without ``cache_indices`` sequence ``i``
uses slot ``i``; without ``has_initial_state`` every sequence starts from zeros.

Math is fp32; outputs are rounded once to the input's dtype, states to the cache's dtype.
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks import (
    check_causal_conv1d,
    check_causal_conv1d_update,
    check_selective_scan,
    check_selective_state_update,
    checked_fake,
)

__all__ = ["causal_conv1d", "causal_conv1d_update", "selective_scan", "selective_state_update"]

_SCAN_CHUNK = 256  # tokens whose decay terms are materialised at once by the reference


def _segments(tokens: int, query_start_loc: Optional[Tensor], cache_indices: Optional[Tensor],
              has_initial_state: Optional[Tensor]) -> list[tuple[int, int, int, bool]]:
    """``(start, end, slot, use_initial_state)`` of each packed sequence."""
    starts = [0, tokens] if query_start_loc is None else [int(v) for v in query_start_loc.tolist()]
    n = len(starts) - 1
    slots = list(range(n)) if cache_indices is None else [int(v) for v in cache_indices.tolist()]
    init = [False] * n if has_initial_state is None else [bool(v) for v in
                                                           has_initial_state.tolist()]
    return [(starts[i], starts[i + 1], slots[i], init[i]) for i in range(n)]


def _row_slots(batch: int, indices: Optional[Tensor], device: torch.device
               ) -> tuple[Tensor, Tensor]:
    """``(slot of each row with padding rows at 0, mask of the real rows)``; no indices: row
    ``i`` uses slot ``i``."""
    slots = torch.arange(batch, device=device) if indices is None else indices.long()
    return slots.clamp(min=0), slots >= 0


def _write_rows(states: Tensor, idx: Tensor, valid: Tensor, new: Tensor, y: Tensor,
                dtype: torch.dtype) -> Tensor:
    """Store ``new`` of the real rows into their ``states`` slots; return ``y`` with the
    padding rows zeroed, in ``dtype``."""
    keep = valid.nonzero().squeeze(1)
    states.index_copy_(0, idx[keep], new[keep].to(states.dtype))
    return torch.where(valid.unsqueeze(1), y, 0.0).to(dtype)


def _activate(y: Tensor, activation: Optional[str]) -> Tensor:
    return F.silu(y) if activation is not None else y


@register_op(mutates_args=("conv_states",))
def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_states: Tensor,
                  query_start_loc: Optional[Tensor] = None,
                  cache_indices: Optional[Tensor] = None,
                  has_initial_state: Optional[Tensor] = None,
                  activation: Optional[str] = "silu") -> Tensor:
    """Depthwise causal convolution over packed sequences, with per-sequence state slots.

    For each sequence, with ``s`` its initial state (``[dim, width-1]``) and ``xs`` its
    tokens: ``out[t, c] = act(bias[c] + sum_k weight[c, k] * cat(s, xs)[c, t + k])``; the last
    ``width-1`` columns of ``cat(s, xs)`` become the slot's new state.

    :param x: ``[T, dim]`` packed tokens.
    :param weight: ``[dim, width]``, ``width >= 2``.
    :param bias: ``[dim]`` or None.
    :param conv_states: ``[num_slots, dim, width-1]``; written in place.
    :param query_start_loc: ``[S+1]`` int32/int64 offsets, or None (one sequence).
    :param cache_indices: ``[S]`` slot of each sequence (``-1``: padding), or None.
    :param has_initial_state: ``[S]`` bool, or None (all False).
    :param activation: None, ``"silu"`` or ``"swish"``.
    :returns: ``[T, dim]`` in ``x.dtype``.
    :raises opmux.OpInputError: bad shapes, dtypes, offsets or slots; nothing is written then.
    """
    check_causal_conv1d(x, weight, bias, conv_states, query_start_loc, cache_indices,
                        has_initial_state, activation)
    dim, width = weight.shape
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    w = weight.float().unsqueeze(1)
    b = None if bias is None else bias.float()
    for start, end, slot, init in _segments(x.shape[0], query_start_loc, cache_indices,
                                            has_initial_state):
        if slot < 0:
            continue
        prev = conv_states[slot].float() if init else x.new_zeros((dim, width - 1),
                                                                  dtype=torch.float32)
        xp = torch.cat([prev, x[start:end].float().t()], dim=1)
        if end > start:
            y = F.conv1d(xp.unsqueeze(0), w, b, groups=dim)[0]
            out[start:end] = _activate(y, activation).t().to(x.dtype)
        conv_states[slot] = xp[:, xp.shape[1] - (width - 1):].to(conv_states.dtype)
    return out


causal_conv1d.register_meta(checked_fake(check_causal_conv1d, "x", 0))


@register_op(mutates_args=("conv_state",))
def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor,
                         bias: Optional[Tensor] = None, activation: Optional[str] = None,
                         conv_state_indices: Optional[Tensor] = None) -> Tensor:
    """One decode step of :func:`causal_conv1d` per row, rolling each row's state.

    Row ``r`` uses slot ``conv_state_indices[r]`` (``r`` when None; ``-1``: padding, output
    zero, state untouched): ``out[r] = act(bias + sum_k weight[:, k] * cat(state, x[r])[:, k])``
    and the state shifts left by one, ``x[r]`` entering last.

    :param x: ``[batch, dim]``.
    :param conv_state: ``[num_slots, dim, width-1]``; written in place.
    :returns: ``[batch, dim]`` in ``x.dtype``.
    """
    check_causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices)
    idx, valid = _row_slots(x.shape[0], conv_state_indices, x.device)
    xp = torch.cat([conv_state[idx].float(), x.float().unsqueeze(2)], dim=2)  # [b, dim, width]
    y = (xp * weight.float().unsqueeze(0)).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return _write_rows(conv_state, idx, valid, xp[:, :, 1:], _activate(y, activation), x.dtype)


causal_conv1d_update.register_meta(checked_fake(check_causal_conv1d_update, "x", 0))


def _dt(delta: Tensor, bias: Optional[Tensor], softplus: bool) -> Tensor:
    dt = delta.float()
    if bias is not None:
        dt = dt + bias.float()
    # vLLM's softplus: log1p(exp(dt)) below 20, dt itself above
    return F.softplus(dt, threshold=20.0) if softplus else dt


def _gate(y: Tensor, u: Tensor, D: Optional[Tensor], z: Optional[Tensor]) -> Tensor:
    if D is not None:
        y = y + u.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


@register_op(mutates_args=("ssm_states",))
def selective_scan(u: Tensor, ssm_states: Tensor, delta: Tensor, A: Tensor, B: Tensor,
                   C: Tensor, D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                   delta_bias: Optional[Tensor] = None, delta_softplus: bool = False,
                   query_start_loc: Optional[Tensor] = None,
                   cache_indices: Optional[Tensor] = None,
                   has_initial_state: Optional[Tensor] = None) -> Tensor:
    """Mamba-1 selective scan over packed sequences, with per-sequence state slots.

    Per token ``t`` of a sequence, with ``dt = softplus?(delta[t] + delta_bias)``:
    ``h = exp(dt[:, None] * A) * h + (dt * u[t])[:, None] * B[t][None, :]``,
    ``y[t] = h @ C[t] + D * u[t]``, then ``y[t] *= silu(z[t])``. ``h`` starts from the slot's
    state (``has_initial_state``) or zeros; the final ``h`` is written to the slot.

    :param u: ``[T, dim]``.
    :param ssm_states: ``[num_slots, dim, dstate]``; written in place.
    :param delta: ``[T, dim]``.
    :param A: ``[dim, dstate]`` (fp32 in Mamba).
    :param B: ``[T, dstate]``.
    :param C: ``[T, dstate]``.
    :param D: ``[dim]`` or None.
    :param z: ``[T, dim]`` gate or None.
    :param delta_bias: ``[dim]`` or None.
    :returns: ``[T, dim]`` in ``u.dtype``.
    :raises opmux.OpInputError: bad shapes, dtypes, offsets or slots; nothing is written then.
    """
    check_selective_scan(u, ssm_states, delta, A, B, C, D, z, delta_bias, delta_softplus,
                         query_start_loc, cache_indices, has_initial_state)
    dim, n = A.shape
    out = torch.zeros_like(u, memory_format=torch.contiguous_format)
    a = A.float()
    for start, end, slot, init in _segments(u.shape[0], query_start_loc, cache_indices,
                                            has_initial_state):
        if slot < 0:
            continue
        h = ssm_states[slot].float() if init else u.new_zeros((dim, n), dtype=torch.float32)
        for c0 in range(start, end, _SCAN_CHUNK):
            c1 = min(c0 + _SCAN_CHUNK, end)
            dt = _dt(delta[c0:c1], delta_bias, delta_softplus)           # [L, dim]
            decay = torch.exp(dt.unsqueeze(2) * a)                          # [L, dim, n]
            inject = (dt * u[c0:c1].float()).unsqueeze(2) * B[c0:c1].float().unsqueeze(1)
            hs = torch.empty_like(decay)
            for i in range(c1 - c0):
                h = decay[i] * h + inject[i]
                hs[i] = h
            y = torch.einsum("ldn,ln->ld", hs, C[c0:c1].float())
            y = _gate(y, u[c0:c1], D, None if z is None else z[c0:c1])
            out[c0:c1] = y.to(u.dtype)
        ssm_states[slot] = h.to(ssm_states.dtype)
    return out


selective_scan.register_meta(checked_fake(check_selective_scan, "u", 0))


@register_op(mutates_args=("ssm_states",))
def selective_state_update(ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                           C: Tensor, D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, dt_softplus: bool = False,
                           state_batch_indices: Optional[Tensor] = None) -> Tensor:
    """One decode step of :func:`selective_scan` per row (Mamba-1, one group).

    Row ``r`` updates slot ``state_batch_indices[r]`` (``r`` when None; ``-1``: padding,
    output zero, state untouched) with the recurrence of :func:`selective_scan`.

    :param ssm_states: ``[num_slots, dim, dstate]``; written in place.
    :param x: ``[batch, dim]``; ``dt``: ``[batch, dim]``; ``B``, ``C``: ``[batch, dstate]``.
    :returns: ``[batch, dim]`` in ``x.dtype``.
    """
    check_selective_state_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                 state_batch_indices)
    idx, valid = _row_slots(x.shape[0], state_batch_indices, x.device)
    d = _dt(dt, dt_bias, dt_softplus)                                       # [b, dim]
    h = ssm_states[idx].float()
    h = torch.exp(d.unsqueeze(2) * A.float()) * h \
        + (d * x.float()).unsqueeze(2) * B.float().unsqueeze(1)
    y = _gate(torch.einsum("bdn,bn->bd", h, C.float()), x, D, z)
    return _write_rows(ssm_states, idx, valid, h, y, x.dtype)


selective_state_update.register_meta(checked_fake(check_selective_state_update, "x", 1))
