"""Triton kernels for ``rms_norm`` and ``fused_add_rms_norm``.

One program per row. Rows up to ``_MAX_SINGLE`` elements stay in registers (one read of
``x``); longer rows take two passes over the row (sum of squares, then normalise). Math in
fp32, one rounding to ``x.dtype``. ``fused_add_rms_norm`` rounds ``x + residual`` to the
input dtype before normalising, exactly as the native reference does.
"""

import torch
import triton
import triton.language as tl

from opmux.ops.checks import check_fused_add_rms_norm, check_rms_norm
from opmux.plugins.cuda.triton_runtime import DTYPES, PROVIDER, next_pow2

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_supports",
    "rms_norm",
    "rms_norm_supports",
]

_MAX_SINGLE = 16384
"""Longest row normalised from registers in one pass; longer rows loop in chunks of this."""


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
    block = min(next_pow2(d), _MAX_SINGLE)
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
    check_rms_norm(x, weight, eps, provider=PROVIDER)
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    _launch(_rows(x, d), None, weight, out.view(-1, d), None, eps)
    return out


def rms_norm_supports(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> bool:
    """Float ``x`` and ``weight``, ``weight`` of shape ``(x.shape[-1],)``."""
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and x.dtype in DTYPES and weight.dtype in DTYPES and x.dim() >= 1
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1])


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual; (rms_norm(r, weight, eps), r)`` as new tensors (Triton)."""
    check_fused_add_rms_norm(x, residual, weight, eps, provider=PROVIDER)
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
    """As :func:`rms_norm_supports`, plus ``residual`` matching ``x`` in shape and dtype."""
    return (rms_norm_supports(x, weight, eps) and isinstance(residual, torch.Tensor)
            and residual.shape == x.shape and residual.dtype == x.dtype)
