"""Triton kernels for the Mamba-2 ops ``ssd_chunk_scan`` and ``ssd_state_update``.

Program ``(i, h, pb)`` owns sequence ``i``, head ``h`` and a block of ``BLOCK_P`` head
channels: it loads that block of the slot's state (or zeros), runs the per-token recurrence
over the sequence's tokens with the ``[BLOCK_P, state_size]`` state in registers, writes
``y`` for every token and stores the final state back into the slot. The decode update is
the same kernel with one token per sequence. Inputs are read through their strides; the
small per-head parameters (``A``, ``D``, ``dt_bias``) are handed over as float32.

This is the recurrent form (work linear in tokens, no intra-chunk matmuls); ``chunk_size``
only affects the native reference's rounding.

Checked once: each ``supports_args`` runs native's static check (metadata only) before its own
conditions, so a call it declines runs native, whose check gives the error. The kernel does
not check indices; the impls check their values only for CPU tensors (the interpreter): on a
GPU that would cost a sync per call.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from opmux.ops.checks import (
    check_ssd_chunk_scan,
    check_ssd_chunk_scan_values,
    check_ssd_state_update,
    check_ssd_state_update_values,
    static_check_passes,
)
from opmux.plugins.cuda.triton_runtime import DTYPES, PROVIDER, next_pow2

__all__ = [
    "ssd_chunk_scan",
    "ssd_chunk_scan_supports",
    "ssd_state_update",
    "ssd_state_update_supports",
]


@triton.jit  # type: ignore[untyped-decorator]
def _ssd_kernel(  # type: ignore[no-untyped-def]
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, state_ptr, slots_ptr,
    qsl_ptr, init_ptr, out_ptr, heads, head_dim, state_size, rep, dt_min, dt_max,
    sx0, sx1, sx2, sdt0, sdt1, sb0, sb1, sb2, sc0, sc1, sc2, sz0, sz1, sz2,
    ss0, ss1, ss2, ss3,
    HAS_QSL: tl.constexpr, HAS_INIT: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
    HAS_MAX: tl.constexpr,
    BLOCK_P: tl.constexpr, N_PAD: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N_PAD)
    pmask = p < head_dim
    nmask = n < state_size
    mask = pmask[:, None] & nmask[None, :]
    g = h // rep
    if HAS_QSL:
        lo = tl.load(qsl_ptr + i)
        hi = tl.load(qsl_ptr + i + 1)
    else:
        lo = i
        hi = i + 1
    slot = tl.load(slots_ptr + i)
    sptr = (state_ptr + slot * ss0 + h * ss1 + p[:, None].to(tl.int64) * ss2
            + n[None, :] * ss3)
    state = tl.load(sptr, mask=mask, other=0.0).to(tl.float32)
    if HAS_INIT:
        keep = tl.load(init_ptr + i).to(tl.int1)
        state = tl.where(keep, state, 0.0)
    a = tl.load(a_ptr + h)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h)
    dvec = tl.zeros((BLOCK_P,), dtype=tl.float32)
    if HAS_D:
        dvec = tl.load(d_ptr + h * head_dim + p, mask=pmask, other=0.0)
    for t in range(lo, hi):
        d = tl.load(dt_ptr + t * sdt0 + h * sdt1).to(tl.float32) + bias
        if SOFTPLUS:
            d = tl.where(d > 20.0, d, tl.log(1.0 + tl.exp(d)))
        if CLAMP:  # as vLLM: clamped (below at dt_min) only when a limit is set
            d = tl.maximum(d, dt_min)
        if HAS_MAX:
            d = tl.minimum(d, dt_max)
        x = tl.load(x_ptr + t * sx0 + h * sx1 + p * sx2, mask=pmask, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + t * sb0 + g * sb1 + n * sb2, mask=nmask, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + t * sc0 + g * sc1 + n * sc2, mask=nmask, other=0.0).to(tl.float32)
        state = state * tl.exp(d * a) + (d * x)[:, None] * bv[None, :]
        y = tl.sum(state * cv[None, :], axis=1) + dvec * x
        if HAS_Z:
            zv = tl.load(z_ptr + t * sz0 + h * sz1 + p * sz2, mask=pmask,
                         other=0.0).to(tl.float32)
            y = y * zv / (1.0 + tl.exp(-zv))
        tl.store(out_ptr + (t * heads + h) * head_dim + p,
                 y.to(out_ptr.dtype.element_ty), mask=pmask)
    tl.store(sptr, state.to(state_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
            C: torch.Tensor, ssm_state: torch.Tensor, state_indices: torch.Tensor,
            query_start_loc: Optional[torch.Tensor], has_initial_state: Optional[torch.Tensor],
            D: Optional[torch.Tensor], z: Optional[torch.Tensor],
            dt_bias: Optional[torch.Tensor], dt_softplus: bool, dt_min: float,
            dt_max: Optional[float]) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    batch = state_indices.shape[0]
    heads, head_dim = x.shape[1], x.shape[2]
    state_size = B.shape[2]
    if batch == 0 or heads == 0 or head_dim == 0:
        return out
    a = A.to(torch.float32).contiguous()
    d = None
    if D is not None:
        d = D.float()
        d = (d.unsqueeze(-1) if d.dim() == 1 else d).expand(heads, head_dim).contiguous()
    bias = None if dt_bias is None else dt_bias.to(torch.float32).contiguous()
    slots = state_indices.to(torch.int64).contiguous()
    qsl = None if query_start_loc is None else query_start_loc.to(torch.int64).contiguous()
    init = None if has_initial_state is None else has_initial_state.to(torch.int8).contiguous()
    block_p = min(next_pow2(head_dim), 32)
    zs = z.stride() if z is not None else (0, 0, 0)
    _ssd_kernel[(batch, heads, triton.cdiv(head_dim, block_p))](
        x, dt, a, B, C, d, z, bias, ssm_state, slots, qsl, init, out, heads, head_dim,
        state_size, heads // B.shape[1], float(dt_min),
        0.0 if dt_max is None else float(dt_max), *x.stride(), *dt.stride(), *B.stride(),
        *C.stride(), *zs, *ssm_state.stride(),
        HAS_QSL=qsl is not None, HAS_INIT=init is not None, HAS_D=d is not None,
        HAS_Z=z is not None, HAS_BIAS=bias is not None, SOFTPLUS=bool(dt_softplus),
        CLAMP=dt_min > 0.0 or dt_max is not None, HAS_MAX=dt_max is not None,
        BLOCK_P=block_p, N_PAD=next_pow2(state_size),
    )
    return out


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                   query_start_loc: torch.Tensor,
                   has_initial_state: Optional[torch.Tensor] = None,
                   D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                   dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                   dt_min: float = 0.0, dt_max: Optional[float] = None,
                   chunk_size: int = 256) -> torch.Tensor:
    """Mamba-2 scan over packed sequences (Triton); see :func:`opmux.ops.ssd_chunk_scan`."""
    if x.is_cpu:  # index values: the kernel does not check them
        check_ssd_chunk_scan_values(x, ssm_state, state_indices, query_start_loc,
                                    provider=PROVIDER)
    return _launch(x, dt, A, B, C, ssm_state, state_indices, query_start_loc,
                   has_initial_state, D, z, dt_bias, dt_softplus, dt_min, dt_max)


def ssd_chunk_scan_supports(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                            B: torch.Tensor, C: torch.Tensor, ssm_state: torch.Tensor,
                            state_indices: torch.Tensor, query_start_loc: torch.Tensor,
                            has_initial_state: Optional[torch.Tensor] = None,
                            D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                            dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                            dt_min: float = 0.0, dt_max: Optional[float] = None,
                            chunk_size: int = 256) -> bool:
    """Native's static check; float32/float16/bfloat16 ``x`` and state (any strides)."""
    return (static_check_passes(check_ssd_chunk_scan, x, dt, A, B, C, ssm_state, state_indices,
                                query_start_loc, has_initial_state, D, z, dt_bias, dt_softplus,
                                dt_min, dt_max, chunk_size, provider=PROVIDER)
            and x.dtype in DTYPES and ssm_state.dtype in DTYPES)


def ssd_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                     D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                     dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                     dt_min: float = 0.0, dt_max: Optional[float] = None) -> torch.Tensor:
    """One Mamba-2 decode step (Triton); see :func:`opmux.ops.ssd_state_update`."""
    if x.is_cpu:  # index values: the kernel does not check them
        check_ssd_state_update_values(ssm_state, state_indices, provider=PROVIDER)
    return _launch(x, dt, A, B, C, ssm_state, state_indices, None, None, D, z, dt_bias,
                   dt_softplus, dt_min, dt_max)


def ssd_state_update_supports(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                              B: torch.Tensor, C: torch.Tensor, ssm_state: torch.Tensor,
                              state_indices: torch.Tensor, D: Optional[torch.Tensor] = None,
                              z: Optional[torch.Tensor] = None,
                              dt_bias: Optional[torch.Tensor] = None,
                              dt_softplus: bool = False, dt_min: float = 0.0,
                              dt_max: Optional[float] = None) -> bool:
    """Native's static check; float32/float16/bfloat16 ``x`` and state (any strides)."""
    return (static_check_passes(check_ssd_state_update, x, dt, A, B, C, ssm_state,
                                state_indices, D, z, dt_bias, dt_softplus, dt_min, dt_max,
                                provider=PROVIDER)
            and x.dtype in DTYPES and ssm_state.dtype in DTYPES)
