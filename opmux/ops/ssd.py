"""Mamba-2 state-space duality (SSD) ops: ``ssd_chunk_scan`` (packed prefill) and
``ssd_state_update`` (decode), native references with vLLM 0.32 semantics.

The recurrence, per sequence, head ``h`` (group ``g = h // (heads // groups)``), head
channel ``p`` and state channel ``n``::

    dt'   = clamp(softplus?(dt[t, h] + dt_bias[h]), dt_min, dt_max)
    s     = exp(dt' * A[h]) * s + dt' * x[t, h, p] * B[t, g, n]
    y     = sum_n s[p, n] * C[t, g, n] + D[h(, p)] * x[t, h, p]
    y     = y * silu(z[t, h, p])                      (when z is given)

``ssd_chunk_scan`` is vLLM's ``mamba_chunk_scan_combined_varlen`` (its CPU entry point
``_mamba_chunk_scan_combined_fwd_cpu``) with the state cache handled inside: sequence ``i``
owns tokens ``query_start_loc[i]:query_start_loc[i+1]`` and state slot ``state_indices[i]``
of ``ssm_state``; it starts from that slot where ``has_initial_state[i]`` (all sequences
when ``None``) and from zeros otherwise, and its final state is written back to the slot.
``ssd_state_update`` is the Mamba-2 form of vLLM's ``selective_state_update`` (heads and
groups, one token per sequence, state read from and written to ``state_indices``).

Math runs in float32; ``y`` is returned in ``x``'s dtype and states are stored in
``ssm_state``'s dtype. The native scan is the chunked SSD form (``chunk_size`` tokens per
block: an intra-chunk quadratic term plus the carried state); it equals the per-token
recurrence up to float rounding.
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from opmux.core.registry import register_op
from opmux.ops.checks import check_ssd_chunk_scan, check_ssd_state_update, checked_fake

__all__ = ["ssd_chunk_scan", "ssd_state_update"]


def _dt(dt: Tensor, dt_bias: Optional[Tensor], dt_softplus: bool, dt_min: float,
        dt_max: Optional[float]) -> Tensor:
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = F.softplus(d)
    if dt_min > 0.0 or dt_max is not None:
        d = d.clamp(min=dt_min, max=dt_max)
    return d


def _finish(y: Tensor, x: Tensor, D: Optional[Tensor], z: Optional[Tensor]) -> Tensor:
    """``y + D * x``, gated by ``silu(z)``; fp32 in, fp32 out."""
    if D is not None:
        d = D.float()
        y = y + x.float() * (d.unsqueeze(-1) if d.dim() == 1 else d)
    if z is not None:
        y = y * F.silu(z.float())
    return y


def _chunk(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
           state: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of one sequence. x [L,H,P], dt [L,H] (processed), A [H], B/C [L,H,N]
    (expanded to heads), state [H,P,N]; all fp32. Returns (y [L,H,P], new state)."""
    length = x.shape[0]
    a = torch.cumsum(dt * A, dim=0).transpose(0, 1)                          # [H, L]
    seg = a.unsqueeze(-1) - a.unsqueeze(-2)                                  # [H, L(i), L(j)]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal, float("-inf")))              # [H, L, L]
    bh, ch = B.transpose(0, 1), C.transpose(0, 1)                            # [H, L, N]
    scores = torch.bmm(ch, bh.transpose(1, 2)) * decay * dt.transpose(0, 1).unsqueeze(1)
    y = torch.bmm(scores, x.transpose(0, 1))                                 # [H, L, P]
    y = y + torch.exp(a).unsqueeze(-1) * torch.bmm(ch, state.transpose(1, 2))
    to_end = torch.exp(a[:, -1:] - a) * dt.transpose(0, 1)                   # [H, L]
    new_state = torch.exp(a[:, -1]).view(-1, 1, 1) * state + torch.bmm(
        (x.transpose(0, 1) * to_end.unsqueeze(-1)).transpose(1, 2), bh)     # [H, P, N]
    return y.transpose(0, 1), new_state


@register_op(mutates_args=("ssm_state",))
def ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_state: Tensor,
                   state_indices: Tensor, query_start_loc: Tensor,
                   has_initial_state: Optional[Tensor] = None, D: Optional[Tensor] = None,
                   z: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                   dt_softplus: bool = False, dt_min: float = 0.0,
                   dt_max: Optional[float] = None, chunk_size: int = 256) -> Tensor:
    """Mamba-2 chunked scan over packed sequences; returns ``y`` ``[T, H, P]`` in x's dtype
    and writes each sequence's final state to ``ssm_state[state_indices[i]]``.

    :param x: ``[T, H, P]`` packed tokens of every sequence.
    :param dt: ``[T, H]`` time steps (before ``dt_bias``, softplus and clamping).
    :param A: ``[H]`` (negative) decay rates.
    :param B: ``[T, G, N]``, ``G`` dividing ``H``; head ``h`` reads group ``h // (H // G)``.
    :param C: like ``B``.
    :param ssm_state: ``[slots, H, P, N]`` state cache, read and written in place.
    :param state_indices: ``[batch]`` int32/int64, distinct slots of the sequences.
    :param query_start_loc: ``[batch + 1]`` int32/int64 token offsets (0 ... T).
    :param has_initial_state: ``[batch]`` bool or ``None`` (every sequence continues its slot);
        a sequence without one starts from zeros.
    :param D: ``None``, ``[H]`` or ``[H, P]`` skip term.
    :param z: ``None`` or ``[T, H, P]`` gate (``y * silu(z)``).
    :param dt_bias: ``None`` or ``[H]``.
    :param dt_softplus: apply softplus to ``dt + dt_bias``.
    :param dt_min: lower clamp of the time step (``0`` = none).
    :param dt_max: upper clamp (``None`` = none).
    :param chunk_size: tokens per SSD block (affects rounding only).
    :raises opmux.OpInputError: bad shapes, dtypes, devices or index values; nothing is
        written then.
    """
    check_ssd_chunk_scan(x, dt, A, B, C, ssm_state, state_indices, query_start_loc,
                         has_initial_state, D, z, dt_bias, dt_softplus, dt_min, dt_max,
                         chunk_size)
    heads, groups = x.shape[1], B.shape[1]
    rep = heads // groups
    dts = _dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    a = A.float()
    xf = x.float()
    bf = B.float().repeat_interleave(rep, dim=1)
    cf = C.float().repeat_interleave(rep, dim=1)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    bounds = query_start_loc.tolist()
    slots = state_indices.tolist()
    starts = [True] * len(slots) if has_initial_state is None else has_initial_state.tolist()
    finals = []
    for i, slot in enumerate(slots):
        state = ssm_state[slot].float() if starts[i] else torch.zeros(
            ssm_state.shape[1:], dtype=torch.float32, device=x.device)
        for lo in range(bounds[i], bounds[i + 1], chunk_size):
            hi = min(lo + chunk_size, bounds[i + 1])
            y[lo:hi], state = _chunk(xf[lo:hi], dts[lo:hi], a, bf[lo:hi], cf[lo:hi], state)
        finals.append(state)
    if finals:
        ssm_state[state_indices.long()] = torch.stack(finals).to(ssm_state.dtype)
    return _finish(y, x, D, z).to(x.dtype)


ssd_chunk_scan.register_meta(checked_fake(check_ssd_chunk_scan, "x", 0))


@register_op(mutates_args=("ssm_state",))
def ssd_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                     ssm_state: Tensor, state_indices: Tensor, D: Optional[Tensor] = None,
                     z: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                     dt_softplus: bool = False, dt_min: float = 0.0,
                     dt_max: Optional[float] = None) -> Tensor:
    """One decode step of ``batch`` sequences (row ``i`` of ``x`` continues the state in slot
    ``state_indices[i]``); returns ``y`` ``[batch, H, P]`` and updates the slots in place.

    Arguments as :func:`ssd_chunk_scan` with ``T = batch`` and no ``query_start_loc``.

    :raises opmux.OpInputError: bad shapes, dtypes, devices or slots; nothing written then.
    """
    check_ssd_state_update(x, dt, A, B, C, ssm_state, state_indices, D, z, dt_bias,
                           dt_softplus, dt_min, dt_max)
    rep = x.shape[1] // B.shape[1]
    dts = _dt(dt, dt_bias, dt_softplus, dt_min, dt_max)                      # [b, H]
    idx = state_indices.long()
    state = ssm_state[idx].float()                                           # [b, H, P, N]
    bf = B.float().repeat_interleave(rep, dim=1)                            # [b, H, N]
    cf = C.float().repeat_interleave(rep, dim=1)
    decay = torch.exp(dts * A.float()).unsqueeze(-1).unsqueeze(-1)
    state = decay * state + (dts.unsqueeze(-1) * x.float()).unsqueeze(-1) * bf.unsqueeze(2)
    y = torch.einsum("bhpn,bhn->bhp", state, cf)
    ssm_state[idx] = state.to(ssm_state.dtype)
    return _finish(y, x, D, z).to(x.dtype)


ssd_state_update.register_meta(checked_fake(check_ssd_state_update, "x", 0))
