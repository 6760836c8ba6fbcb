"""Triton kernels of the activation ops.

``silu_and_mul`` and ``gelu_and_mul`` read ``x[..., 2d]`` once and write ``[..., d]``: one
program per (row, column block), math in fp32, one rounding to ``x.dtype`` at the store. Memory
bound; the block size is autotuned on a GPU.

vLLM's other activation rows: the gated ops (``fatrelu_and_mul``, ``mul_and_silu``,
``swigluoai_and_mul``) run one program per (row, column block); the elementwise ops
(``gelu_new``, ``gelu_fast``, ``quick_gelu``, ``relu2``, ``xielu``) one program per flat block;
``gelu_and_mul_sparse`` one program per row (its row statistics need the whole gate; rows up to
32768 wide). Math in fp32, one rounding at the store; ``gelu_and_mul_sparse`` also rounds its
statistics to ``x.dtype`` where the PyTorch reference does, and ``xielu`` rounds its softplus
terms to the parameters' dtype. Inputs of any layout are accepted: they are made row-contiguous
first (a copy only when needed).

Checked once: each ``supports_args`` is the whole acceptance test on metadata (native's static
conditions, written inline for the one-tensor and gated ops, native's static check itself for
the ops with scalar parameters), so a call it declines runs native, whose check gives the
error; the impls launch their kernels directly."""

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from opmux.ops import checks
from opmux.ops.activation import sparsity_std_multiplier
from opmux.plugins.cuda.triton_runtime import DTYPES, PROVIDER, one_config_when_interpreting

__all__ = [
    "fatrelu_and_mul", "fatrelu_and_mul_supports", "gelu_and_mul", "gelu_and_mul_sparse",
    "gelu_and_mul_sparse_supports", "gelu_and_mul_supports", "gelu_fast", "gelu_fast_supports",
    "gelu_new", "gelu_new_supports", "mul_and_silu", "mul_and_silu_supports", "quick_gelu",
    "quick_gelu_supports", "relu2", "relu2_supports", "silu_and_mul", "silu_and_mul_supports",
    "swigluoai_and_mul", "swigluoai_and_mul_supports", "xielu", "xielu_supports",
]


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
    return _launch(x, _ACT_SILU)


def silu_and_mul_supports(x: torch.Tensor) -> bool:
    """Float dtypes (not float64) and an even last dimension (native's conditions, and the
    kernel's dtypes)."""
    return (isinstance(x, torch.Tensor) and x.dtype in DTYPES and x.dim() >= 1
            and x.shape[-1] % 2 == 0)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` (Triton)."""
    return _launch(x, _ACT_GELU if approximate == "none" else _ACT_GELU_TANH)


def gelu_and_mul_supports(x: torch.Tensor, approximate: str = "none") -> bool:
    """Float dtypes, an even last dimension and a known ``approximate``."""
    return silu_and_mul_supports(x) and approximate in ("none", "tanh")


_MAX_SPARSE_D = 32768


_FATRELU, _MUL_SILU, _SWIGLUOAI = 0, 1, 2


_GELU_NEW, _GELU_FAST, _QUICK_GELU, _RELU2, _XIELU = 0, 1, 2, 3, 4


@triton.autotune(configs=_CONFIGS, key=["d"])  # type: ignore[untyped-decorator]
@triton.jit  # type: ignore[untyped-decorator]
def _gated_kernel(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, d, x_row_stride, out_row_stride, p0, p1,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    if ACT == 2:  # swigluoai: gate and up interleaved; p0 = alpha, p1 = limit
        g = tl.load(x_row + 2 * cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + 2 * cols + 1, mask=mask, other=0.0).to(tl.float32)
        g = tl.minimum(g, p1)
        u = tl.minimum(tl.maximum(u, -p1), p1)
        y = (u + 1.0) * (g * tl.sigmoid(g * p0))
    else:
        a = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:  # fatrelu: torch.threshold zeroes x <= threshold (p0)
            y = tl.where(a <= p0, 0.0, a) * b
        else:  # mul_and_silu
            y = a * (b * tl.sigmoid(b))
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _round(v, dt: tl.constexpr):  # type: ignore[no-untyped-def]
    # fp32 -> dt -> fp32 with round-to-nearest-even; written out for bf16 because the
    # interpreter's conversion truncates
    if dt == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    else:
        return v.to(dt).to(tl.float32)


@triton.jit  # type: ignore[untyped-decorator]
def _softplus(v):  # type: ignore[no-untyped-def]
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))


@triton.jit  # type: ignore[untyped-decorator]
def _expm1(v):  # type: ignore[no-untyped-def]
    # exp(v) - 1 loses the low bits near 0: a cubic Taylor form there (error < 1e-13)
    small = v * (1.0 + v * (0.5 + v * (1.0 / 6.0)))
    return tl.where(tl.abs(v) < 1e-3, small, tl.exp(v) - 1.0)


@triton.autotune(configs=_CONFIGS, key=[])  # type: ignore[untyped-decorator]
@triton.jit  # type: ignore[untyped-decorator]
def _unary_kernel(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, n, ap_ptr, an_ptr, beta, eps,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # gelu_new
        y = 0.5 * v * (1.0 + _tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    elif ACT == 1:  # gelu_fast
        y = 0.5 * v * (1.0 + _tanh(v * 0.7978845608 * (1.0 + 0.044715 * v * v)))
    elif ACT == 2:  # quick_gelu
        y = v * tl.sigmoid(1.702 * v)
    elif ACT == 3:  # relu2
        r = tl.maximum(v, 0.0)
        y = r * r
    else:  # xielu; softplus terms rounded to the parameters' dtype as the reference does
        pdt = ap_ptr.dtype.element_ty
        a_p = _round(_softplus(tl.load(ap_ptr).to(tl.float32)), pdt)
        sp_n = _round(_softplus(tl.load(an_ptr).to(tl.float32)), pdt)
        a_n = _round(beta + sp_n, pdt)
        pos = a_p * v * v + beta * v
        neg = (_expm1(tl.minimum(v, eps)) - v) * a_n + beta * v
        y = tl.where(v > 0.0, pos, neg)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _gelu_and_mul_sparse_kernel(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, d, x_row_stride, multiplier,
    TANH: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    dt = x_ptr.dtype.element_ty
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(g, axis=0) / d
    c = tl.where(mask, g - mean, 0.0)
    std = tl.sqrt(tl.sum(c * c, axis=0) / d)
    # the reference rounds each intermediate to x.dtype
    scaled = _round(_round(std, dt) * multiplier, dt)
    cutoff = _round(_round(mean, dt) + scaled, dt)
    s = tl.maximum(_round(g - cutoff, dt), 0.0)
    if TANH:
        act = 0.5 * s * (1.0 + _tanh(0.7978845608028654 * (s + 0.044715 * s * s * s)))
    else:
        act = 0.5 * s * (1.0 + tl.erf(s * 0.7071067811865476))
    act = _round(act, dt)
    u = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _gated(x: torch.Tensor, act: int, p0: float = 0.0, p1: float = 0.0) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = _rows(x)
    rows = x2.shape[0]

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return rows, triton.cdiv(d, meta["BLOCK"])

    _gated_kernel[grid](x2, out, d, x2.stride(0), d, float(p0), float(p1), ACT=act)
    return out


def _unary(x: torch.Tensor, act: int, alpha_p: torch.Tensor | None = None,
           alpha_n: torch.Tensor | None = None, beta: float = 0.0,
           eps: float = 0.0) -> torch.Tensor:
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n = xc.numel()
    if n == 0:
        return out
    ap = xc if alpha_p is None else alpha_p
    an = xc if alpha_n is None else alpha_n

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK"]),)

    _unary_kernel[grid](xc, out, n, ap, an, float(beta), float(eps), ACT=act)
    return out


def _float(x: torch.Tensor) -> bool:
    """A tensor of a kernel dtype (fp32/fp16/bf16): what native's one-tensor ops require of
    ``x``, narrowed to the kernels' dtypes."""
    return isinstance(x, torch.Tensor) and x.dtype in DTYPES


mul_and_silu_supports = silu_and_mul_supports
gelu_new_supports = gelu_fast_supports = quick_gelu_supports = relu2_supports = _float


def fatrelu_and_mul(x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """``threshold(x[..., :d], threshold, 0) * x[..., d:]`` (Triton)."""
    return _gated(x, _FATRELU, threshold)


def fatrelu_and_mul_supports(x: torch.Tensor, threshold: float = 0.0) -> bool:
    """Native's static check; float dtypes."""
    return (checks.static_check_passes(checks.check_fatrelu_and_mul, x, threshold,
                                       provider=PROVIDER)
            and x.dtype in DTYPES)


def mul_and_silu(x: torch.Tensor) -> torch.Tensor:
    """``x[..., :d] * silu(x[..., d:])`` (Triton)."""
    return _gated(x, _MUL_SILU)


def swigluoai_and_mul(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0
                      ) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on interleaved gate/up (Triton)."""
    return _gated(x, _SWIGLUOAI, alpha, limit)


def swigluoai_and_mul_supports(x: torch.Tensor, alpha: float = 1.702,
                               limit: float = 7.0) -> bool:
    """Native's static check; float dtypes."""
    return (checks.static_check_passes(checks.check_swigluoai_and_mul, x, alpha, limit,
                                       provider=PROVIDER)
            and x.dtype in DTYPES)


def gelu_and_mul_sparse(x: torch.Tensor, activation_sparsity: float,
                        approximate: str = "none") -> torch.Tensor:
    """Gemma-3n's sparse GeGLU (Triton), one program per row."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = _rows(x)
    block = triton.next_power_of_2(d)
    _gelu_and_mul_sparse_kernel[(x2.shape[0],)](
        x2, out, d, x2.stride(0), sparsity_std_multiplier(float(activation_sparsity)),
        TANH=approximate == "tanh", BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return out


def gelu_and_mul_sparse_supports(x: torch.Tensor, activation_sparsity: float,
                                 approximate: str = "none") -> bool:
    """Native's static check; float dtypes and a gate of at most 32768 values (one row per
    program)."""
    return (checks.static_check_passes(checks.check_gelu_and_mul_sparse, x,
                                       activation_sparsity, approximate, provider=PROVIDER)
            and x.dtype in DTYPES and x.shape[-1] // 2 <= _MAX_SPARSE_D)


def _elementwise(op: str, act: int, doc: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The impl of elementwise activation ``op``: kernel ``act``."""

    def impl(x: torch.Tensor) -> torch.Tensor:
        return _unary(x, act)

    impl.__name__ = impl.__qualname__ = op
    impl.__doc__ = doc
    return impl


gelu_new = _elementwise("gelu_new", _GELU_NEW, "GPT-2's tanh GELU (Triton).")


gelu_fast = _elementwise("gelu_fast", _GELU_FAST, "The fast tanh GELU (Triton).")


quick_gelu = _elementwise("quick_gelu", _QUICK_GELU, "``x * sigmoid(1.702 x)`` (Triton).")


relu2 = _elementwise("relu2", _RELU2, "``relu(x)^2`` (Triton).")


def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float,
          eps: float) -> torch.Tensor:
    """xIELU with the layer's raw parameters (Triton)."""
    return _unary(x, _XIELU, alpha_p, alpha_n, beta, eps)


def xielu_supports(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor,
                   beta: float, eps: float) -> bool:
    """Native's static check; float dtypes, parameters of one dtype, and a result in
    ``x.dtype`` and shape (shape-[1] parameters promote the reference's result and broadcast
    a 0-d ``x`` to [1])."""
    if not checks.static_check_passes(checks.check_xielu, x, alpha_p, alpha_n, beta, eps,
                                      provider=PROVIDER):
        return False
    dtype = x.dtype
    for t in (alpha_p, alpha_n):
        if t.dim() > 0:
            dtype = torch.promote_types(dtype, t.dtype)
    return (x.dtype in DTYPES and alpha_p.dtype in DTYPES and alpha_n.dtype == alpha_p.dtype
            and x.dim() >= max(alpha_p.dim(), alpha_n.dim())
            and alpha_p.device == x.device and alpha_n.device == x.device
            and dtype == x.dtype)
