"""Sequential reference of the Mamba-2 ops: a plain per-token, per-head loop.

It restates the recurrence of :mod:`opmux.ops.ssd` one token and one head at a time
(``s <- exp(dt*A)*s + dt*x*B``, ``y = <s, C> + D*x``, ``y *= silu(z)``), independently of
the chunked native reference, so tests can pin every provider, native included, against it.
It returns the output and a new state cache (the input cache is left untouched).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["sequential_ssd"]


def sequential_ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_state: Tensor,
                   state_indices: Tensor, query_start_loc: Tensor | None = None,
                   has_initial_state: Tensor | None = None, D: Tensor | None = None,
                   z: Tensor | None = None, dt_bias: Tensor | None = None,
                   dt_softplus: bool = False, dt_min: float = 0.0,
                   dt_max: float | None = None) -> tuple[Tensor, Tensor]:
    """``ssd_chunk_scan`` (or, without ``query_start_loc``, ``ssd_state_update``) token by
    token in fp32; returns ``(y in x's dtype, new state cache)``."""
    states = ssm_state.clone()
    tokens, heads, head_dim = x.shape
    rep = heads // B.shape[1]
    bounds = list(range(tokens + 1)) if query_start_loc is None else [
        int(v) for v in query_start_loc]
    y = torch.zeros(x.shape, dtype=torch.float32)
    for i in range(len(bounds) - 1):
        slot = int(state_indices[i])
        init = True if has_initial_state is None else bool(has_initial_state[i])
        for h in range(heads):
            s = states[slot, h].float() if init else torch.zeros(head_dim, B.shape[2])
            for t in range(bounds[i], bounds[i + 1]):
                d = float(dt[t, h]) + (0.0 if dt_bias is None else float(dt_bias[h]))
                if dt_softplus:
                    d = d if d > 20.0 else math.log1p(math.exp(d))
                if dt_min > 0.0 or dt_max is not None:
                    d = max(d, dt_min)
                    d = d if dt_max is None else min(d, dt_max)
                s = math.exp(d * float(A[h])) * s + d * torch.outer(
                    x[t, h].float(), B[t, h // rep].float())
                out = s @ C[t, h // rep].float()
                if D is not None:
                    out = out + D[h].float() * x[t, h].float()  # D [H] or [H, P]
                if z is not None:
                    out = out * F.silu(z[t, h].float())
                y[t, h] = out
            states[slot, h] = s.to(states.dtype)
    return y.to(x.dtype), states
