"""Triton kernels of the state-space ops: ``causal_conv1d`` (+ ``_update``) and
``selective_scan`` (+ ``selective_state_update``).

One program per (sequence, block of channels); the recurrence runs over the sequence's tokens
in fp32 registers (the scan keeps a ``[BLOCK_D, dstate]`` state tile). Decode ops are the
same kernels with one row per sequence starting from its slot's state (``HAS_QSL`` false).
The convolution re-reads its ``width`` inputs per token instead of keeping a rolling window
(Triton has no register arrays); its final state is written in increasing position order,
which reads every old state value before it is overwritten. Strided inputs are made
contiguous first; ``A``, ``D`` and the time-step bias are handed over in fp32.

Checked once: each ``supports_args`` runs native's static check (metadata only) before its own
conditions, so a call it declines runs native, whose check gives the error. The kernels do not
check indices, so each impl checks the index values as native does (a device sync): a bad
slot never reaches the kernel.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from opmux.ops.checks import (
    check_causal_conv1d,
    check_causal_conv1d_update,
    check_selective_scan,
    check_selective_state_update,
    check_ssm_index_values,
    static_check_passes,
)
from opmux.plugins.cuda.triton_runtime import DTYPES, PROVIDER, next_pow2

__all__ = [
    "causal_conv1d", "causal_conv1d_supports", "causal_conv1d_update",
    "causal_conv1d_update_supports", "selective_scan", "selective_scan_supports",
    "selective_state_update", "selective_state_update_supports",
]

_BLOCK_D = 32
_MAX_STATE = 256


@triton.jit  # type: ignore[untyped-decorator]
def _segment(  # type: ignore[no-untyped-def]
    pid, qsl_ptr, idx_ptr, init_ptr, HAS_QSL: tl.constexpr, HAS_IDX: tl.constexpr,
    HAS_INIT: tl.constexpr,
):
    if HAS_QSL:
        t0 = tl.load(qsl_ptr + pid).to(tl.int64)
        t1 = tl.load(qsl_ptr + pid + 1).to(tl.int64)
    else:
        t0 = pid.to(tl.int64)
        t1 = t0 + 1
    if HAS_IDX:
        slot = tl.load(idx_ptr + pid).to(tl.int64)
    else:
        slot = pid.to(tl.int64)
    # 1: start from the slot's state, 0: from zeros (an int, so masks stay integer compares)
    if HAS_INIT:
        init = tl.load(init_ptr + pid).to(tl.int32)
    elif HAS_QSL:
        init = 0
    else:
        init = 1
    return t0, t1, slot, init


@triton.jit  # type: ignore[untyped-decorator]
def _zero_rows(out_ptr, t0, t1, dim, c, cm, BLOCK_D: tl.constexpr):  # type: ignore[no-untyped-def]
    """Columns ``c`` of output rows ``t0..t1`` become zero (a padding slot's tokens)."""
    for t in range(t0, t1):
        tl.store(out_ptr + t * dim + c, tl.zeros([BLOCK_D], tl.float32)
                 .to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit  # type: ignore[untyped-decorator]
def _conv_kernel(  # type: ignore[no-untyped-def]
    out_ptr, x_ptr, w_ptr, b_ptr, st_ptr, qsl_ptr, idx_ptr, init_ptr, dim,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_QSL: tl.constexpr,
    HAS_IDX: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = c < dim
    t0, t1, slot, init = _segment(pid, qsl_ptr, idx_ptr, init_ptr, HAS_QSL, HAS_IDX, HAS_INIT)
    if slot < 0:
        _zero_rows(out_ptr, t0, t1, dim, c, cm, BLOCK_D)
    else:
        hist = WIDTH - 1
        zero = tl.zeros([BLOCK_D], tl.int64)
        st = st_ptr + (slot * dim + c) * hist
        for t in range(t0, t1):
            if HAS_BIAS:
                acc = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
            else:
                acc = tl.zeros([BLOCK_D], tl.float32)
            for k in tl.static_range(WIDTH):
                # position in the sequence, per lane (vector masks); < 0 reads the state
                j = zero + (t - t0 + k - hist)
                xv = tl.load(x_ptr + (t0 + j) * dim + c, mask=cm & (j >= 0), other=0.0)
                sv = tl.load(st + hist + j, mask=cm & (j < 0) & (j >= -hist * init), other=0.0)
                wk = tl.load(w_ptr + c * WIDTH + k, mask=cm, other=0.0).to(tl.float32)
                acc += wk * (xv.to(tl.float32) + sv.to(tl.float32))
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(out_ptr + t * dim + c, acc.to(out_ptr.dtype.element_ty), mask=cm)
        length = t1 - t0
        for i in tl.static_range(WIDTH - 1):
            j = zero + (length - hist + i)
            xv = tl.load(x_ptr + (t0 + j) * dim + c, mask=cm & (j >= 0), other=0.0)
            sv = tl.load(st + hist + j, mask=cm & (j < 0) & (j >= -hist * init), other=0.0)
            tl.store(st + i, (xv.to(tl.float32) + sv.to(tl.float32))
                     .to(st_ptr.dtype.element_ty), mask=cm)


@triton.jit  # type: ignore[untyped-decorator]
def _scan_kernel(  # type: ignore[no-untyped-def]
    out_ptr, u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, st_ptr,
    qsl_ptr, idx_ptr, init_ptr, dim, nstate,
    SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_QSL: tl.constexpr, HAS_IDX: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    cm = c < dim
    nm = n < nstate
    m2 = cm[:, None] & nm[None, :]
    t0, t1, slot, init = _segment(pid, qsl_ptr, idx_ptr, init_ptr, HAS_QSL, HAS_IDX, HAS_INIT)
    if slot < 0:
        _zero_rows(out_ptr, t0, t1, dim, c, cm, BLOCK_D)
    else:
        st = st_ptr + slot * dim * nstate + c[:, None] * nstate + n[None, :]
        h = tl.load(st, mask=m2 & (n[None, :] < nstate * init), other=0.0).to(tl.float32)
        a = tl.load(a_ptr + c[:, None] * nstate + n[None, :], mask=m2, other=0.0)
        if HAS_D:
            dv = tl.load(d_ptr + c, mask=cm, other=0.0)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + c, mask=cm, other=0.0)
        for t in range(t0, t1):
            row = t * dim + c
            dt = tl.load(dt_ptr + row, mask=cm, other=0.0).to(tl.float32)
            if HAS_BIAS:
                dt += bias
            if SOFTPLUS:
                dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
            u = tl.load(u_ptr + row, mask=cm, other=0.0).to(tl.float32)
            bt = tl.load(b_ptr + t * nstate + n, mask=nm, other=0.0).to(tl.float32)
            ct = tl.load(c_ptr + t * nstate + n, mask=nm, other=0.0).to(tl.float32)
            h = tl.exp(dt[:, None] * a) * h + (dt * u)[:, None] * bt[None, :]
            y = tl.sum(h * ct[None, :], axis=1)
            if HAS_D:
                y += dv * u
            if HAS_Z:
                zv = tl.load(z_ptr + row, mask=cm, other=0.0).to(tl.float32)
                y = y * (zv * tl.sigmoid(zv))
            tl.store(out_ptr + row, y.to(out_ptr.dtype.element_ty), mask=cm)
        tl.store(st, h.to(st_ptr.dtype.element_ty), mask=m2)


def _c(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _f32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.to(torch.float32).contiguous()


def _conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
          states: torch.Tensor, qsl: Optional[torch.Tensor], idx: Optional[torch.Tensor],
          init: Optional[torch.Tensor], silu: bool, seqs: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    if seqs == 0 or x.shape[1] == 0:
        return out
    dummy = x
    grid = (seqs, triton.cdiv(x.shape[1], _BLOCK_D))
    _conv_kernel[grid](
        out, x, weight.contiguous(), dummy if bias is None else bias.contiguous(), states,
        dummy if qsl is None else qsl.contiguous(), dummy if idx is None else idx.contiguous(),
        dummy if init is None else init.contiguous(), x.shape[1],
        WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu, HAS_QSL=qsl is not None,
        HAS_IDX=idx is not None, HAS_INIT=init is not None, BLOCK_D=_BLOCK_D,
    )
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  conv_states: torch.Tensor, query_start_loc: Optional[torch.Tensor] = None,
                  cache_indices: Optional[torch.Tensor] = None,
                  has_initial_state: Optional[torch.Tensor] = None,
                  activation: Optional[str] = "silu") -> torch.Tensor:
    """Packed-prefill causal convolution (Triton)."""
    # index values: the kernel does not check them
    check_ssm_index_values("causal_conv1d", PROVIDER, conv_states, "cache_indices",
                           cache_indices, query_start_loc, x.shape[0])
    if query_start_loc is None:
        query_start_loc = torch.tensor([0, x.shape[0]], dtype=torch.int64, device=x.device)
    return _conv(x, weight, bias, conv_states, query_start_loc, cache_indices,
                 has_initial_state, activation is not None, query_start_loc.shape[0] - 1)


def _conv_ok(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             states: torch.Tensor) -> bool:
    return (x.dtype in DTYPES and weight.dtype in DTYPES and states.is_contiguous()
            and states.dtype in DTYPES and (bias is None or bias.dtype in DTYPES))


def causal_conv1d_supports(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           conv_states: torch.Tensor,
                           query_start_loc: Optional[torch.Tensor] = None,
                           cache_indices: Optional[torch.Tensor] = None,
                           has_initial_state: Optional[torch.Tensor] = None,
                           activation: Optional[str] = "silu") -> bool:
    """Native's static check; fp32/bf16/fp16 tensors and a contiguous state cache."""
    return (static_check_passes(check_causal_conv1d, x, weight, bias, conv_states,
                                query_start_loc, cache_indices, has_initial_state, activation,
                                provider=PROVIDER)
            and _conv_ok(x, weight, bias, conv_states))


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                         conv_state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode step of the causal convolution (Triton)."""
    # index values: the kernel does not check them
    check_ssm_index_values("causal_conv1d_update", PROVIDER, conv_state, "conv_state_indices",
                           conv_state_indices)
    return _conv(x, weight, bias, conv_state, None, conv_state_indices, None,
                 activation is not None, x.shape[0])


def causal_conv1d_update_supports(x: torch.Tensor, conv_state: torch.Tensor,
                                  weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                                  activation: Optional[str] = None,
                                  conv_state_indices: Optional[torch.Tensor] = None) -> bool:
    """Native's static check; fp32/bf16/fp16 tensors and a contiguous state cache."""
    return (static_check_passes(check_causal_conv1d_update, x, conv_state, weight, bias,
                                activation, conv_state_indices, provider=PROVIDER)
            and _conv_ok(x, weight, bias, conv_state))


def _scan(u: torch.Tensor, states: torch.Tensor, delta: torch.Tensor, A: torch.Tensor,
          B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor],
          z: Optional[torch.Tensor], bias: Optional[torch.Tensor], softplus: bool,
          qsl: Optional[torch.Tensor], idx: Optional[torch.Tensor],
          init: Optional[torch.Tensor], seqs: int) -> torch.Tensor:
    u = u.contiguous()
    out = torch.empty_like(u)
    if seqs == 0 or u.shape[1] == 0:
        return out
    dummy = u
    nstate = A.shape[1]
    grid = (seqs, triton.cdiv(u.shape[1], _BLOCK_D))
    _scan_kernel[grid](
        out, u, delta.contiguous(), _f32(A), B.contiguous(), C.contiguous(),
        dummy if D is None else _f32(D), dummy if z is None else z.contiguous(),
        dummy if bias is None else _f32(bias), states,
        dummy if qsl is None else qsl.contiguous(), dummy if idx is None else idx.contiguous(),
        dummy if init is None else init.contiguous(), u.shape[1], nstate,
        SOFTPLUS=softplus, HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=bias is not None,
        HAS_QSL=qsl is not None, HAS_IDX=idx is not None, HAS_INIT=init is not None,
        BLOCK_D=_BLOCK_D, BLOCK_N=next_pow2(max(nstate, 2)),
    )
    return out


def selective_scan(u: torch.Tensor, ssm_states: torch.Tensor, delta: torch.Tensor,
                   A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                   delta_bias: Optional[torch.Tensor] = None, delta_softplus: bool = False,
                   query_start_loc: Optional[torch.Tensor] = None,
                   cache_indices: Optional[torch.Tensor] = None,
                   has_initial_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed-prefill Mamba-1 selective scan (Triton)."""
    # index values: the kernel does not check them
    check_ssm_index_values("selective_scan", PROVIDER, ssm_states, "cache_indices",
                           cache_indices, query_start_loc, u.shape[0])
    if query_start_loc is None:
        query_start_loc = torch.tensor([0, u.shape[0]], dtype=torch.int64, device=u.device)
    return _scan(u, ssm_states, delta, A, B, C, D, z, delta_bias, delta_softplus,
                 query_start_loc, cache_indices, has_initial_state,
                 query_start_loc.shape[0] - 1)


def _scan_ok(u: torch.Tensor, states: torch.Tensor, A: torch.Tensor,
             *acts: Optional[torch.Tensor]) -> bool:
    return (u.dtype in DTYPES and states.dtype in DTYPES and states.is_contiguous()
            and A.dim() == 2 and A.shape[1] <= _MAX_STATE
            and all(t is None or t.dtype in DTYPES for t in acts))


def selective_scan_supports(u: torch.Tensor, ssm_states: torch.Tensor, delta: torch.Tensor,
                            A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                            D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                            delta_bias: Optional[torch.Tensor] = None,
                            delta_softplus: bool = False,
                            query_start_loc: Optional[torch.Tensor] = None,
                            cache_indices: Optional[torch.Tensor] = None,
                            has_initial_state: Optional[torch.Tensor] = None) -> bool:
    """Native's static check; fp32/bf16/fp16 tensors, a contiguous state cache,
    ``dstate <= 256``."""
    return (static_check_passes(check_selective_scan, u, ssm_states, delta, A, B, C, D, z,
                                delta_bias, delta_softplus, query_start_loc, cache_indices,
                                has_initial_state, provider=PROVIDER)
            and _scan_ok(u, ssm_states, A, delta, B, C, z))


def selective_state_update(ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                           A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                           dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                           state_batch_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode step of the Mamba-1 scan (Triton)."""
    # index values: the kernel does not check them
    check_ssm_index_values("selective_state_update", PROVIDER, ssm_states,
                           "state_batch_indices", state_batch_indices)
    return _scan(x, ssm_states, dt, A, B, C, D, z, dt_bias, dt_softplus, None,
                 state_batch_indices, None, x.shape[0])


def selective_state_update_supports(ssm_states: torch.Tensor, x: torch.Tensor,
                                    dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                    C: torch.Tensor, D: Optional[torch.Tensor] = None,
                                    z: Optional[torch.Tensor] = None,
                                    dt_bias: Optional[torch.Tensor] = None,
                                    dt_softplus: bool = False,
                                    state_batch_indices: Optional[torch.Tensor] = None) -> bool:
    """Native's static check; fp32/bf16/fp16 tensors, a contiguous state cache,
    ``dstate <= 256``."""
    return (static_check_passes(check_selective_state_update, ssm_states, x, dt, A, B, C, D,
                                z, dt_bias, dt_softplus, state_batch_indices,
                                provider=PROVIDER)
            and _scan_ok(x, ssm_states, A, dt, B, C, z))
