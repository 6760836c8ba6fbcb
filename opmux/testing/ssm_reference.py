"""Sequential references of the state-space ops: plain per-token loops.

They restate the recurrences of :mod:`opmux.ops.ssm` one token at a time (a rolling window for
the convolution, ``h <- exp(dt*A)*h + dt*u*B`` for the scan), independently of the vectorised
native references, so tests can pin every provider, native included, against them. They
return the output and a new state cache (the input caches are left untouched).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["sequential_causal_conv1d", "sequential_selective_scan"]


def _sequences(states: Tensor, tokens: int, qsl: Tensor | None, idx: Tensor | None,
               init: Tensor | None) -> Iterator[tuple[range, int, Tensor]]:
    """``(token range, state slot, fp32 starting state)`` of each packed sequence that is not
    padding (slot ``-1``); the starting state is zeros where the sequence starts fresh."""
    starts = [0, tokens] if qsl is None else [int(v) for v in qsl]
    for i in range(len(starts) - 1):
        slot = i if idx is None else int(idx[i])
        if slot < 0:
            continue
        fresh = init is None or not bool(init[i])
        yield (range(starts[i], starts[i + 1]), slot,
               torch.zeros(states.shape[1:]) if fresh else states[slot].float())


def sequential_causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, states: Tensor,
                             query_start_loc: Tensor | None = None,
                             cache_indices: Tensor | None = None,
                             has_initial_state: Tensor | None = None,
                             activation: str | None = "silu") -> tuple[Tensor, Tensor]:
    """``causal_conv1d`` token by token; returns ``(out, new_states)``."""
    states = states.clone()
    out = torch.zeros(x.shape, dtype=x.dtype)
    w = weight.float()
    for span, slot, window in _sequences(states, x.shape[0], query_start_loc, cache_indices,
                                         has_initial_state):
        for t in span:
            full = torch.cat([window, x[t].float().unsqueeze(1)], dim=1)
            y = (full * w).sum(1)
            if bias is not None:
                y = y + bias.float()
            if activation is not None:
                y = F.silu(y)
            out[t] = y.to(x.dtype)
            window = full[:, 1:]
        states[slot] = window.to(states.dtype)
    return out, states


def sequential_selective_scan(u: Tensor, states: Tensor, delta: Tensor, A: Tensor, B: Tensor,
                              C: Tensor, D: Tensor | None = None, z: Tensor | None = None,
                              delta_bias: Tensor | None = None, delta_softplus: bool = False,
                              query_start_loc: Tensor | None = None,
                              cache_indices: Tensor | None = None,
                              has_initial_state: Tensor | None = None
                              ) -> tuple[Tensor, Tensor]:
    """``selective_scan`` token by token; returns ``(out, new_states)``."""
    out = torch.zeros(u.shape, dtype=u.dtype)
    states = states.clone()
    a = A.float()
    for span, slot, h in _sequences(states, u.shape[0], query_start_loc, cache_indices,
                                    has_initial_state):
        for t in span:
            dt = delta[t].float()
            if delta_bias is not None:
                dt = dt + delta_bias.float()
            if delta_softplus:
                dt = torch.where(dt <= 20.0, torch.log1p(torch.exp(dt)), dt)
            ut = u[t].float()
            h = torch.exp(dt[:, None] * a) * h + (dt * ut)[:, None] * B[t].float()[None, :]
            y = (h * C[t].float()[None, :]).sum(1)
            if D is not None:
                y = y + D.float() * ut
            if z is not None:
                y = y * F.silu(z[t].float())
            out[t] = y.to(u.dtype)
        states[slot] = h.to(states.dtype)
    return out, states
