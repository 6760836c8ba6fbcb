"""The ``cpp`` provider's impls of the state-space ops (``csrc/cpu/ssm.cpp``).

Same contract as :mod:`opmux.plugins.cpu.cpp_ops`: each ``supports_args`` runs native's
static check on metadata (:func:`opmux.ops.checks.with_static_check`) before its own
conditions; each impl checks the index values (query offsets, state slots: native's value
checks), allocates its output and calls the out-variant kernel. Strided inputs are made
contiguous first (a copy only when needed); ``A``, ``D`` and the time-step bias are handed
over in fp32, as the reference computes with them. ``supports_args`` accepts CPU tensors whose
activations share one of fp32/bf16/fp16, states in fp32 or that dtype, convolution widths up
to 8 and state sizes up to 256; anything else falls through to the next provider.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
from typing import Optional

import torch
from torch import Tensor

from opmux.ops.checks import (
    check_causal_conv1d,
    check_causal_conv1d_update,
    check_selective_scan,
    check_selective_state_update,
    check_ssm_index_values,
    with_static_check,
)
from opmux.plugins.cpu._kernels import FLOATS, PROVIDER, K, call
from opmux.plugins.registration import OpTable, op_table, predicate

__all__ = ["OPS", "causal_conv1d", "causal_conv1d_update", "selective_scan",
           "selective_state_update"]

_MAX_WIDTH = 8
_MAX_STATE = 256


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _f32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to(torch.float32).contiguous()


def _like(ref: Tensor, *ts: Optional[Tensor]) -> bool:
    return all(t is None or (t.is_cpu and t.dtype == ref.dtype) for t in ts)


def _state_ok(ref: Tensor, state: Tensor) -> bool:
    return state.is_cpu and state.is_contiguous() and state.dtype in (torch.float32, ref.dtype)


def _index_ok(*ts: Optional[Tensor]) -> bool:
    return all(t is None or (t.is_cpu and t.is_contiguous()) for t in ts)


def _slots_ok(t: Optional[Tensor]) -> bool:
    """State-slot indices the kernels can take: contiguous, no slot used twice (the sequences
    run in parallel here, while native runs them in order: a shared slot would differ)."""
    if t is None:
        return True
    if not (t.is_cpu and t.is_contiguous()):
        return False
    used = t[t >= 0]
    return bool(used.numel() == torch.unique(used).numel())


# ----------------------------------------------------------------------------- convolution
def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_states: Tensor,
                  query_start_loc: Optional[Tensor] = None,
                  cache_indices: Optional[Tensor] = None,
                  has_initial_state: Optional[Tensor] = None,
                  activation: Optional[str] = "silu") -> Tensor:
    check_ssm_index_values("causal_conv1d", PROVIDER, conv_states, "cache_indices",
                           cache_indices, query_start_loc, x.shape[0])
    if query_start_loc is None:  # one sequence
        query_start_loc = torch.tensor([0, x.shape[0]], dtype=torch.int64)
    out = torch.empty(x.shape, dtype=x.dtype)
    call("causal_conv1d", K.causal_conv1d_out, out, x.contiguous(), weight.contiguous(), _c(bias),
         conv_states, query_start_loc.contiguous(), _c(cache_indices), _c(has_initial_state),
         activation is not None)
    return out


def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor,
                         bias: Optional[Tensor] = None, activation: Optional[str] = None,
                         conv_state_indices: Optional[Tensor] = None) -> Tensor:
    check_ssm_index_values("causal_conv1d_update", PROVIDER, conv_state, "conv_state_indices",
                           conv_state_indices)
    out = torch.empty(x.shape, dtype=x.dtype)
    call("causal_conv1d_update", K.causal_conv1d_out, out, x.contiguous(), weight.contiguous(),
         _c(bias), conv_state, None, _c(conv_state_indices), None, activation is not None)
    return out


# ----------------------------------------------------------------------------- scan
def selective_scan(u: Tensor, ssm_states: Tensor, delta: Tensor, A: Tensor, B: Tensor,
                   C: Tensor, D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                   delta_bias: Optional[Tensor] = None, delta_softplus: bool = False,
                   query_start_loc: Optional[Tensor] = None,
                   cache_indices: Optional[Tensor] = None,
                   has_initial_state: Optional[Tensor] = None) -> Tensor:
    check_ssm_index_values("selective_scan", PROVIDER, ssm_states, "cache_indices",
                           cache_indices, query_start_loc, u.shape[0])
    if query_start_loc is None:  # one sequence
        query_start_loc = torch.tensor([0, u.shape[0]], dtype=torch.int64)
    out = torch.empty(u.shape, dtype=u.dtype)
    call("selective_scan", K.selective_scan_out, out, u.contiguous(), ssm_states,
         delta.contiguous(), _f32(A), B.contiguous(), C.contiguous(), _f32(D), _c(z),
         _f32(delta_bias), delta_softplus, query_start_loc.contiguous(), _c(cache_indices),
         _c(has_initial_state))
    return out


def selective_state_update(ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                           C: Tensor, D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, dt_softplus: bool = False,
                           state_batch_indices: Optional[Tensor] = None) -> Tensor:
    check_ssm_index_values("selective_state_update", PROVIDER, ssm_states,
                           "state_batch_indices", state_batch_indices)
    out = torch.empty(x.shape, dtype=x.dtype)
    call("selective_state_update", K.selective_scan_out, out, x.contiguous(), ssm_states,
         dt.contiguous(), _f32(A), B.contiguous(), C.contiguous(), _f32(D), _c(z), _f32(dt_bias),
         dt_softplus, None, _c(state_batch_indices), None)
    return out


def _conv_ok(x: Tensor, weight: Tensor, bias: Optional[Tensor], states: Tensor,
             slots: Optional[Tensor], *index: Optional[Tensor]) -> bool:
    return (x.is_cpu and x.dtype in FLOATS and _like(x, weight, bias)
            and weight.dim() == 2 and weight.shape[1] <= _MAX_WIDTH
            and _state_ok(x, states) and _index_ok(*index) and _slots_ok(slots))


def _scan_ok(u: Tensor, states: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
             z: Optional[Tensor], slots: Optional[Tensor], *index: Optional[Tensor]) -> bool:
    return (u.is_cpu and u.dtype in FLOATS and _like(u, delta, B, C, z)
            and A.is_cpu and A.dim() == 2 and A.shape[1] <= _MAX_STATE
            and _state_ok(u, states) and _index_ok(*index) and _slots_ok(slots))


causal_conv1d_supports = with_static_check(
    causal_conv1d, check_causal_conv1d, PROVIDER, predicate(
        causal_conv1d,
        lambda x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state:
        _conv_ok(x, weight, bias, conv_states, cache_indices, query_start_loc,
                 has_initial_state)))
causal_conv1d_update_supports = with_static_check(
    causal_conv1d_update, check_causal_conv1d_update, PROVIDER, predicate(
        causal_conv1d_update,
        lambda x, conv_state, weight, bias, conv_state_indices:
        _conv_ok(x, weight, bias, conv_state, conv_state_indices)))
selective_scan_supports = with_static_check(
    selective_scan, check_selective_scan, PROVIDER, predicate(
        selective_scan,
        lambda u, ssm_states, delta, A, B, C, z, query_start_loc, cache_indices,
        has_initial_state:
        _scan_ok(u, ssm_states, delta, A, B, C, z, cache_indices, query_start_loc,
                 has_initial_state)))
selective_state_update_supports = with_static_check(
    selective_state_update, check_selective_state_update, PROVIDER, predicate(
        selective_state_update,
        lambda ssm_states, x, dt, A, B, C, z, state_batch_indices:
        _scan_ok(x, ssm_states, dt, A, B, C, z, state_batch_indices)))

OPS: OpTable = op_table(
    (causal_conv1d, causal_conv1d_supports),
    (causal_conv1d_update, causal_conv1d_update_supports),
    (selective_scan, selective_scan_supports),
    (selective_state_update, selective_state_update_supports),
)
"""Op name -> (impl, supports_args) of the state-space ops this provider serves."""
