"""The ``cpp`` provider's Mamba-2 ops (``csrc/cpu/ssd.cpp``): ``ssd_chunk_scan`` and
``ssd_state_update``.

Same contract as :mod:`opmux.plugins.cpu.cpp_ops`. Each ``supports_args`` runs native's
static check on metadata (:func:`opmux.ops.checks.with_static_check`), so ``cpp`` never
accepts what native refuses; each impl checks the index values (slots in range and
distinct, query offsets: native's value checks, before anything is written), hands the
small per-head parameters (``A``, ``D``, ``dt_bias``) over as float32 and the index tensors as
int64, and calls one kernel (the decode update is the scan with one token per slot).
``supports_args`` accepts CPU tensors of one float dtype for ``x``, ``dt``, ``B``, ``C``,
``z``, unit-stride ``B``/``C`` rows and a state cache in float32 or x's dtype with contiguous
``[head_dim, state_size]`` blocks; anything else runs native.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
from typing import Optional

import torch
from torch import Tensor

from opmux.ops.checks import (
    check_ssd_chunk_scan,
    check_ssd_chunk_scan_values,
    check_ssd_state_update,
    check_ssd_state_update_values,
    with_static_check,
)
from opmux.plugins.cpu._kernels import FLOATS, PROVIDER, K, call
from opmux.plugins.registration import OpTable, op_table, predicate

__all__ = ["OPS", "ssd_chunk_scan", "ssd_state_update"]



def _f32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to(torch.float32).contiguous()


def _d(D: Optional[Tensor], x: Tensor) -> Optional[Tensor]:
    if D is None:
        return None
    d = D.float()
    return (d.unsqueeze(-1) if d.dim() == 1 else d).expand(x.shape[1], x.shape[2]).contiguous()


def _ok(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, ssm_state: Tensor,
        z: Optional[Tensor]) -> bool:
    dtype = x.dtype
    return (x.is_cpu and dtype in FLOATS and x.dim() == 3 and dt.dtype == dtype
            and B.dtype == dtype and C.dtype == dtype and B.dim() == 3 and C.dim() == 3
            and B.stride(2) == 1 and C.stride(2) == 1
            and (z is None or z.dtype == dtype)
            and ssm_state.dtype in (torch.float32, dtype) and ssm_state.dim() == 4
            and ssm_state.stride(3) == 1 and ssm_state.stride(2) == ssm_state.shape[3])


def ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_state: Tensor,
                   state_indices: Tensor, query_start_loc: Tensor,
                   has_initial_state: Optional[Tensor] = None, D: Optional[Tensor] = None,
                   z: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                   dt_softplus: bool = False, dt_min: float = 0.0,
                   dt_max: Optional[float] = None, chunk_size: int = 256) -> Tensor:
    check_ssd_chunk_scan_values(x, ssm_state, state_indices, query_start_loc,
                                provider=PROVIDER)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    his = None if has_initial_state is None else has_initial_state.contiguous()
    call("ssd_chunk_scan", K.ssd_scan_out, out, ssm_state, x, dt, _f32(A), B, C, _d(D, x), z,
         _f32(dt_bias), state_indices.to(torch.int64).contiguous(),
         query_start_loc.to(torch.int64).contiguous(), his, dt_softplus, dt_min,
         -1.0 if dt_max is None else dt_max)
    return out


ssd_chunk_scan_supports = with_static_check(ssd_chunk_scan, check_ssd_chunk_scan, PROVIDER,
                                            predicate(ssd_chunk_scan, _ok))


def ssd_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                     ssm_state: Tensor, state_indices: Tensor, D: Optional[Tensor] = None,
                     z: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                     dt_softplus: bool = False, dt_min: float = 0.0,
                     dt_max: Optional[float] = None) -> Tensor:
    check_ssd_state_update_values(ssm_state, state_indices, provider=PROVIDER)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    call("ssd_state_update", K.ssd_scan_out, out, ssm_state, x, dt, _f32(A), B, C, _d(D, x), z,
         _f32(dt_bias), state_indices.to(torch.int64).contiguous(), None, None, dt_softplus, dt_min,
         -1.0 if dt_max is None else dt_max)
    return out


ssd_state_update_supports = with_static_check(ssd_state_update, check_ssd_state_update,
                                              PROVIDER, predicate(ssd_state_update, _ok))


OPS: OpTable = op_table(
    (ssd_chunk_scan, ssd_chunk_scan_supports),
    (ssd_state_update, ssd_state_update_supports),
)
"""Op name -> (impl, supports_args) of the Mamba-2 ops this provider serves."""
