"""Triton kernels of the RMS norms.

``rms_norm`` and ``fused_add_rms_norm``: one program per row. Rows up to
:data:`MAX_SINGLE_PASS_ROW` elements stay in registers (one read of ``x``); longer rows take
two passes over the row (sum of squares, then normalise). Math in fp32, one rounding to
``x.dtype``. ``fused_add_rms_norm`` rounds ``x + residual`` to the input dtype before
normalising, exactly as the native reference does.

``gemma_rms_norm``, ``gemma_fused_add_rms_norm`` and ``rms_norm_gated``: one program per row
(per row and group for the gated norm), looping over the row in chunks of at most
``_MAX_BLOCK``: a pass for the sum of squares, a pass for the output. Math in fp32, one rounding
to ``x.dtype``. The Gemma residual variant recomputes the fp32 sum in the second pass, so the
output normalises the unrounded sum exactly as the native reference does. Inputs whose rows are
not unit-stride are copied to contiguous rows first.

Checked once: each ``supports_args`` is the whole acceptance test on metadata (native's static
conditions inline for ``rms_norm`` and ``fused_add_rms_norm``, native's static check itself
for the others), so the provider never accepts what native refuses and a call it declines
runs native, whose check gives the error; the impls launch their kernels directly."""

from typing import Optional

import torch
import triton
import triton.language as tl

from opmux.ops.checks import (
    check_gemma_fused_add_rms_norm,
    check_gemma_rms_norm,
    check_rms_norm_gated,
    static_check_passes,
)
from opmux.plugins.cuda.triton_runtime import DTYPES, PROVIDER, next_pow2

__all__ = [
    "MAX_SINGLE_PASS_ROW", "fused_add_rms_norm", "fused_add_rms_norm_supports",
    "gemma_fused_add_rms_norm", "gemma_fused_add_rms_norm_supports", "gemma_rms_norm",
    "gemma_rms_norm_supports", "rms_norm", "rms_norm_gated", "rms_norm_gated_supports",
    "rms_norm_supports",
]

MAX_SINGLE_PASS_ROW = 16384
"""Longest row ``rms_norm`` and ``fused_add_rms_norm`` normalise from registers in one pass;
longer rows take two passes, in chunks of this many elements."""


@triton.jit  # type: ignore[untyped-decorator]
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, d, x_stride, res_stride, out_stride,
    res_out_stride, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    out_row = out_ptr + row * out_stride
    res_row = res_ptr + row * res_stride
    res_out_row = res_out_ptr + row * res_out_stride
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            s = (x.to(tl.float32) + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32))
            s = s.to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_row + cols, s, mask=mask)
            xf = s.to(tl.float32)
        else:
            xf = x.to(tl.float32)
        ms = tl.sum(xf * xf, axis=0) / d
        inv = 1.0 / tl.sqrt(ms + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, d, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < d
            xf = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                s = xf + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
                s = s.to(res_out_ptr.dtype.element_ty)
                tl.store(res_out_row + cols, s, mask=mask)
                xf = s.to(tl.float32)
            acc += xf * xf
        inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / d + eps)
        for start in range(0, d, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < d
            if HAS_RESIDUAL:
                xf = tl.load(res_out_row + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                xf = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x2: torch.Tensor, res2: torch.Tensor | None, weight: torch.Tensor,
            out2: torch.Tensor, res_out2: torch.Tensor | None, eps: float) -> None:
    rows, d = x2.shape
    if rows == 0 or d == 0:
        return
    block = min(next_pow2(d), MAX_SINGLE_PASS_ROW)
    single = block >= d
    num_warps = min(max(block // 512, 1), 16)
    has_res = res2 is not None
    _rms_norm_kernel[(rows,)](
        x2, res2 if has_res else x2, weight.contiguous(), out2,
        res_out2 if has_res else out2, d, x2.stride(0),
        res2.stride(0) if res2 is not None else 0, out2.stride(0),
        res_out2.stride(0) if res_out2 is not None else 0, float(eps),
        HAS_RESIDUAL=has_res, BLOCK=block, SINGLE=single, num_warps=num_warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` in fp32, returned in ``x.dtype`` (Triton)."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    _launch(_rows(x, d), None, weight, out.view(-1, d), None, eps)
    return out


def rms_norm_supports(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> bool:
    """Float ``x`` and ``weight`` on one device, ``weight`` of shape ``(x.shape[-1],)``, a
    real ``eps >= 0`` (native's static conditions, and the kernel's dtypes)."""
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and x.dtype in DTYPES and weight.dtype in DTYPES and x.dim() >= 1
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
            and weight.device == x.device
            and type(eps) in (float, int) and eps >= 0)  # NaN fails the comparison


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual; (rms_norm(r, weight, eps), r)`` as new tensors (Triton)."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out, new_res
    _launch(_rows(x, d), _rows(residual, d), weight,
            out.view(-1, d), new_res.view(-1, d), eps)
    return out, new_res


def fused_add_rms_norm_supports(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float = 1e-6) -> bool:
    """As :func:`rms_norm_supports`, plus ``residual`` matching ``x`` in shape, dtype and
    device."""
    return (rms_norm_supports(x, weight, eps) and isinstance(residual, torch.Tensor)
            and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.device == x.device)


_MAX_BLOCK = 8192


"""Widest chunk of a row one program holds in registers."""


@triton.jit  # type: ignore[untyped-decorator]
def _f32(ptr, cols, mask):  # type: ignore[no-untyped-def]
    return tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit  # type: ignore[untyped-decorator]
def _chunk(row_ptr, start, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Columns ``start..start+BLOCK`` of a row of ``n`` values: the columns, their mask and
    the row's values there in fp32."""
    cols = start + tl.arange(0, BLOCK)
    mask = cols < n
    return cols, mask, _f32(row_ptr, cols, mask)


@triton.jit  # type: ignore[untyped-decorator]
def _gemma_kernel(  # type: ignore[no-untyped-def]
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, d, x_stride, res_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    res_row = res_ptr + row * res_stride
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, d, BLOCK):
        cols, mask, s = _chunk(x_row, start, d, BLOCK)
        if HAS_RESIDUAL:
            s += _f32(res_row, cols, mask)
            tl.store(res_out_ptr + row * d + cols, s.to(res_out_ptr.dtype.element_ty), mask=mask)
        acc += s * s
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / d + eps)
    for start in range(0, d, BLOCK):
        cols, mask, s = _chunk(x_row, start, d, BLOCK)
        if HAS_RESIDUAL:
            s += _f32(res_row, cols, mask)
        w = _f32(w_ptr, cols, mask) + 1.0
        tl.store(out_ptr + row * d + cols, (s * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _act(z, SIGMOID: tl.constexpr):  # type: ignore[no-untyped-def]
    den = 1.0 + tl.exp(-z)
    if SIGMOID:
        return 1.0 / den
    return z / den


@triton.jit  # type: ignore[untyped-decorator]
def _gated_kernel(  # type: ignore[no-untyped-def]
    x_ptr, z_ptr, w_ptr, out_ptr, d, group, x_stride, z_stride, eps,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, SIGMOID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * group
    x_row = x_ptr + row * x_stride + g0
    z_row = z_ptr + row * z_stride + g0
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, group, BLOCK):
        cols, mask, v = _chunk(x_row, start, group, BLOCK)
        if HAS_Z and not NORM_BEFORE_GATE:
            v = v * _act(_f32(z_row, cols, mask), SIGMOID)
        acc += v * v
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / group + eps)
    for start in range(0, group, BLOCK):
        cols, mask, v = _chunk(x_row, start, group, BLOCK)
        if HAS_Z:
            gate = _act(_f32(z_row, cols, mask), SIGMOID)
            if not NORM_BEFORE_GATE:
                v = v * gate
        v = v * inv * _f32(w_ptr + g0, cols, mask)
        if HAS_Z and NORM_BEFORE_GATE:
            v = v * gate
        tl.store(out_ptr + row * d + g0 + cols, v.to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return min(max(block // 512, 1), 16)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps) * (1 + weight)`` in fp32 (Triton)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    d = x.shape[-1]
    if x.numel() == 0:
        return out
    x2 = _rows(x, d)
    block = min(next_pow2(d), _MAX_BLOCK)
    _gemma_kernel[(x2.shape[0],)](x2, x2, weight.contiguous(), out, out, d, x2.stride(0), 0,
                                  float(eps), HAS_RESIDUAL=False, BLOCK=block,
                                  num_warps=_warps(block))
    return out


def gemma_rms_norm_supports(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> bool:
    """Native's static check; float32/16/bf16 ``x`` and ``weight``."""
    return (static_check_passes(check_gemma_rms_norm, x, weight, eps, provider=PROVIDER)
            and x.dtype in DTYPES and weight.dtype in DTYPES)


def gemma_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` in fp32; ``(gemma_rms_norm(s), s rounded)`` (Triton)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    d = x.shape[-1]
    if x.numel() == 0:
        return out, new_res
    x2, r2 = _rows(x, d), _rows(residual, d)
    block = min(next_pow2(d), _MAX_BLOCK)
    _gemma_kernel[(x2.shape[0],)](x2, r2, weight.contiguous(), out, new_res, d, x2.stride(0),
                                  r2.stride(0), float(eps), HAS_RESIDUAL=True, BLOCK=block,
                                  num_warps=_warps(block))
    return out, new_res


def gemma_fused_add_rms_norm_supports(x: torch.Tensor, residual: torch.Tensor,
                                      weight: torch.Tensor, eps: float = 1e-6) -> bool:
    """Native's static check; float32/16/bf16 ``x`` and ``weight``."""
    return (static_check_passes(check_gemma_fused_add_rms_norm, x, residual, weight, eps,
                                provider=PROVIDER)
            and x.dtype in DTYPES and weight.dtype in DTYPES)


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, z: Optional[torch.Tensor] = None,
                   eps: float = 1e-5, group_size: Optional[int] = None,
                   norm_before_gate: bool = False, activation: str = "swish") -> torch.Tensor:
    """Gated, grouped RMS norm in fp32 (Triton); see the catalog op for the semantics."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    d = x.shape[-1]
    if x.numel() == 0:
        return out
    group = d if group_size is None else group_size
    x2 = _rows(x, d)
    z2 = _rows(z, d) if z is not None else x2
    block = min(next_pow2(group), _MAX_BLOCK)
    _gated_kernel[(x2.shape[0], d // group)](
        x2, z2, weight.contiguous(), out, d, group, x2.stride(0), z2.stride(0), float(eps),
        HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate,
        SIGMOID=activation == "sigmoid", BLOCK=block, num_warps=_warps(block))
    return out


def rms_norm_gated_supports(x: torch.Tensor, weight: torch.Tensor,
                            z: Optional[torch.Tensor] = None, eps: float = 1e-5,
                            group_size: Optional[int] = None, norm_before_gate: bool = False,
                            activation: str = "swish") -> bool:
    """Native's static check; float32/16/bf16 ``x``, ``weight`` and ``z``."""
    return (static_check_passes(check_rms_norm_gated, x, weight, z, eps, group_size,
                                norm_before_gate, activation, provider=PROVIDER)
            and x.dtype in DTYPES and weight.dtype in DTYPES
            and (z is None or z.dtype in DTYPES))
