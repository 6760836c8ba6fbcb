"""Triton kernels for ``quant_fp8`` (float8_e4m3fn), bit for bit as the native reference.

Static scales: one program per row reads its ``1/scale`` per element from the ``[a, b]`` scale
tile. Dynamic per-token: one program per row, a pass for ``max|x|`` and a pass to quantise.
Dynamic per-tensor: the per-row maxima come from the same kernel (no quantise pass), their
maximum and the scale are two small device ops, then every row is quantised with it. Dynamic
per-group: one program per (row, group). Divisions use round-to-nearest (``div_rn``; Triton's
``/`` is approximate on GPUs) and power-of-two scales are found from the bits, so the results
match native run on the CPU exactly: checked under the interpreter on every conformance case,
and on an H100 against the CPU reference over all modes and dtypes. (Native itself run on a
CUDA device can differ in the last bit of a dynamic scale: torch divides a CUDA tensor by a
Python scalar through its reciprocal.)
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from opmux.ops.checks import check_quant_fp8, static_check_passes
from opmux.ops.quant import FP8_MAX, FP8_MIN_SCALE
from opmux.plugins.cuda import triton_runtime
from opmux.plugins.cuda.triton_runtime import DTYPES, PROVIDER, interpreting, next_pow2

__all__ = ["quant_fp8", "quant_fp8_supports"]

_MAX_BLOCK = 4096
_FP8_CAPABILITY = (8, 9)
"""Triton lowers ``float8_e4m3fn`` (its ``fp8e4nv``) for NVIDIA GPUs of compute capability 8.9
and newer only ("type fp8e4nv not supported in this architecture" on an A100, sm_80); there the
provider declines and native runs. ROCm GPUs lower it (gfx942 checked)."""
_ROUND = interpreting()
"""Round to the e4m3 grid before the cast (the interpreter's cast rounds wrongly; a GPU's
``cvt.rn.satfinite`` is exact and gets the plain cast). Fixed at import, as ``@triton.jit``."""


@triton.jit  # type: ignore[untyped-decorator]
def _store_fp8(ptr, v, mask, ROUND: tl.constexpr):  # type: ignore[no-untyped-def]
    v = tl.clamp(v, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if ROUND:
        # Interpreter only: its cast does not carry a rounded-up mantissa into the exponent,
        # so round to the e4m3 grid in fp32 first (nearest even) and the cast is exact.
        # Normal range: keep 3 mantissa bits; below 2**-6: multiples of 2**-9 (add trick).
        bits = v.to(tl.int32, bitcast=True)
        a = tl.abs(v)
        mag = a.to(tl.int32, bitcast=True)
        normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & ~0xFFFFF
        sub = ((a + 16384.0) - 16384.0).to(tl.int32, bitcast=True)
        r = (tl.where(a >= 0.015625, normal, sub) | (bits & -2147483648)).to(tl.float32,
                                                                              bitcast=True)
        v = tl.where(v != v, v, r)
    tl.store(ptr, v.to(tl.float8e4nv), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _row_absmax(x_row, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    m = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < n, other=0.0).to(tl.float32)
        m = tl.maximum(m, tl.abs(v))
    return tl.max(m, axis=0)


@triton.jit  # type: ignore[untyped-decorator]
def _static_kernel(  # type: ignore[no-untyped-def]
    x_ptr, q_ptr, s_ptr, n, m, b, row_tile, col_tile, x_stride, BLOCK: tl.constexpr,
    ROUND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + ((row % m) // row_tile) * b
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_row + cols // col_tile, mask=mask, other=1.0)
        _store_fp8(q_ptr + row * n + cols, x * tl.math.div_rn(1.0, s), mask, ROUND)


@triton.jit  # type: ignore[untyped-decorator]
def _token_kernel(  # type: ignore[no-untyped-def]
    x_ptr, q_ptr, s_ptr, ub_ptr, n, x_stride, min_scale,
    HAS_UB: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr,
    ROUND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    amax = _row_absmax(x_row, n, BLOCK)
    if not QUANTIZE:  # per-tensor: the row maxima only
        tl.store(s_ptr + row, amax)
        return
    if HAS_UB:
        amax = tl.minimum(amax, tl.load(ub_ptr))
    s = tl.maximum(tl.math.div_rn(amax, 448.0), min_scale)
    tl.store(s_ptr + row, s)
    inv = tl.math.div_rn(1.0, s)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        _store_fp8(q_ptr + row * n + cols, x * inv, mask, ROUND)


@triton.jit  # type: ignore[untyped-decorator]
def _group_kernel(  # type: ignore[no-untyped-def]
    x_ptr, q_ptr, s_ptr, n, group, groups, x_stride, min_scale,
    UE8M0: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    g0 = g * group
    x_row = x_ptr + row * x_stride + g0
    length = tl.minimum(group, n - g0)
    raw = tl.math.div_rn(_row_absmax(x_row, length, BLOCK), 448.0)
    if UE8M0:  # the next power of two >= raw, exactly (raw >= 0)
        bits = raw.to(tl.int32, bitcast=True)
        up = ((bits & 0x7F800000) + 0x00800000).to(tl.float32, bitcast=True)
        raw = tl.where((bits & 0x007FFFFF) == 0, raw, up)
    s = tl.maximum(raw, min_scale)
    tl.store(s_ptr + row * groups + g, s)
    for start in range(0, length, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < length
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        _store_fp8(q_ptr + row * n + g0 + cols, tl.math.div_rn(x, s), mask, ROUND)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def quant_fp8(x: torch.Tensor, scale: Optional[torch.Tensor] = None, per_token: bool = False,
              scale_ub: Optional[torch.Tensor] = None, group_size: Optional[int] = None,
              use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 quantisation (Triton); see the catalog op ``quant_fp8`` for the modes."""
    n = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    rows = x.numel() // n if n else 0
    x2 = _rows(x, n) if rows else x
    block = min(next_pow2(max(n, 1)), _MAX_BLOCK)
    warps = min(max(block // 256, 1), 8)
    if scale is not None:
        s2 = scale.float().reshape(1, 1) if scale.numel() == 1 else scale.float()
        s2 = s2.contiguous()
        m = x.shape[-2] if x.dim() >= 2 else 1
        if rows:
            _static_kernel[(rows,)](x2, q, s2, n, m, s2.shape[1], m // s2.shape[0],
                                    n // s2.shape[1], x2.stride(0), BLOCK=block,
                                    ROUND=_ROUND, num_warps=warps)
        return q, scale.clone()
    if group_size is not None:
        groups = (n + group_size - 1) // group_size
        scales = torch.empty((*x.shape[:-1], groups), dtype=torch.float32, device=x.device)
        gblock = min(next_pow2(group_size), _MAX_BLOCK)
        if rows:
            _group_kernel[(rows, groups)](x2, q, scales, n, group_size, groups, x2.stride(0),
                                          FP8_MIN_SCALE, UE8M0=use_ue8m0, BLOCK=gblock,
                                          ROUND=_ROUND, num_warps=min(max(gblock // 256, 1), 8))
        return q, scales
    if per_token:
        scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
        if rows:
            ub = scale_ub if scale_ub is not None else scales
            _token_kernel[(rows,)](x2, q, scales, ub, n, x2.stride(0), FP8_MIN_SCALE,
                                   HAS_UB=scale_ub is not None, QUANTIZE=True, BLOCK=block,
                                   ROUND=_ROUND, num_warps=warps)
        return q, scales
    maxima = torch.empty(rows, dtype=torch.float32, device=x.device)
    _token_kernel[(rows,)](x2, q, maxima, maxima, n, x2.stride(0), FP8_MIN_SCALE,
                           HAS_UB=False, QUANTIZE=False, BLOCK=block, ROUND=_ROUND,
                           num_warps=warps)
    # a tensor divisor: torch divides by a Python scalar on CUDA as a multiply by its
    # reciprocal, which is not the correctly rounded quotient native computes on the CPU
    fp8_max = torch.full((1,), FP8_MAX, dtype=torch.float32, device=x.device)
    dyn = (maxima.max().unsqueeze(0) / fp8_max).clamp(min=FP8_MIN_SCALE)
    _static_kernel[(rows,)](x2, q, dyn, n, 1, 1, 1, n, x2.stride(0), BLOCK=block, ROUND=_ROUND,
                            num_warps=warps)
    return q, dyn


def quant_fp8_supports(x: torch.Tensor, scale: Optional[torch.Tensor] = None,
                       per_token: bool = False, scale_ub: Optional[torch.Tensor] = None,
                       group_size: Optional[int] = None, use_ue8m0: bool = False) -> bool:
    """Native's static check (the provider's whole acceptance test: the impl launches its
    kernels directly); float32/16/bf16 ``x``, on a GPU that has fp8 e4m3 (not NVIDIA below
    sm_89)."""
    if not (static_check_passes(check_quant_fp8, x, scale, per_token, scale_ub, group_size,
                                use_ue8m0, provider=PROVIDER)
            and x.dtype in DTYPES):
        return False
    capability = triton_runtime.cuda_capability(x)
    return capability is None or capability >= _FP8_CAPABILITY
