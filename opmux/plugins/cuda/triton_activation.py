"""Triton kernels for the gated activations ``silu_and_mul`` and ``gelu_and_mul``.

Both read ``x[..., 2d]`` once and write ``[..., d]``: one program per (row, column block),
math in fp32, one rounding to ``x.dtype`` at the store. Memory bound; the block size is
autotuned on a GPU.
"""

import torch
import triton
import triton.language as tl

from opmux.ops.checks import check_gelu_and_mul, check_silu_and_mul
from opmux.plugins.cuda.triton_runtime import DTYPES, PROVIDER, one_config_when_interpreting

__all__ = ["gelu_and_mul", "gelu_and_mul_supports", "silu_and_mul", "silu_and_mul_supports"]


_ACT_SILU = 0
_ACT_GELU = 1
_ACT_GELU_TANH = 2

_CONFIGS = one_config_when_interpreting(
    [
        triton.Config({"BLOCK": 1024}, num_warps=4),
        triton.Config({"BLOCK": 2048}, num_warps=8),
        triton.Config({"BLOCK": 4096}, num_warps=8),
        triton.Config({"BLOCK": 512}, num_warps=2),
    ]
)


@triton.jit  # type: ignore[untyped-decorator]
def _tanh(x):  # type: ignore[no-untyped-def]
    # from exp(-2|x|): runs under the interpreter and on every backend, never overflows
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.autotune(configs=_CONFIGS, key=["d"])  # type: ignore[untyped-decorator]
@triton.jit  # type: ignore[untyped-decorator]
def _act_and_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, d, x_row_stride, out_row_stride, ACT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    a = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = a * tl.sigmoid(a)
    elif ACT == 1:
        act = 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        act = 0.5 * a * (1.0 + _tanh(inner))
    tl.store(out_ptr + row * out_row_stride + cols, (act * b).to(out_ptr.dtype.element_ty),
             mask=mask)


def _launch(x: torch.Tensor, act: int) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return rows, triton.cdiv(d, meta["BLOCK"])

    _act_and_mul_kernel[grid](x2, out, d, x2.stride(0), d, ACT=act)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` (Triton)."""
    check_silu_and_mul(x, provider=PROVIDER)
    return _launch(x, _ACT_SILU)


def silu_and_mul_supports(x: torch.Tensor) -> bool:
    """Float dtypes (not float64) and an even last dimension."""
    return (isinstance(x, torch.Tensor) and x.dtype in DTYPES and x.dim() >= 1
            and x.shape[-1] % 2 == 0)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` (Triton)."""
    check_gelu_and_mul(x, approximate, provider=PROVIDER)
    return _launch(x, _ACT_GELU if approximate == "none" else _ACT_GELU_TANH)


def gelu_and_mul_supports(x: torch.Tensor, approximate: str = "none") -> bool:
    """Float dtypes, an even last dimension and a known ``approximate``."""
    return silu_and_mul_supports(x) and approximate in ("none", "tanh")

