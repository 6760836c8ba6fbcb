"""The catalog's numerics rule: in bf16/fp16 an op computes in float32 and rounds once per
output, and every provider follows its native.

Each op below has its formula written once in plain PyTorch. Run on the bf16/fp16 inputs it
is the *per-op-in-dtype* computation (every PyTorch op rounds to the dtype); run on the same
inputs widened to float64 it is the exact reference. For each op, dtype and provider that
takes the inputs, the mean absolute error against float64 must be no larger than the
per-op-in-dtype computation's. Shapes follow vLLM's kernel tests (token counts 7/83, hidden
768, 17 heads of 128, MoE with 8 experts, top 4, hidden/intermediate 128 and 2880).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import opmux
from opmux.testing import paged_batch

Formula = Callable[..., Any]
Builder = Callable[[torch.dtype, torch.Generator], tuple[Any, ...]]


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return torch.randn(shape, generator=g) * scale


def _gated(fn: Callable[[Tensor, Tensor], Tensor]) -> Formula:
    def formula(x: Tensor, *_: Any) -> Tensor:
        d = x.shape[-1] // 2
        return fn(x[..., :d], x[..., d:])
    return formula


def _rms(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight + offset)


def _add_rms(offset: float, normalize_stored: bool) -> Formula:
    def formula(x: Tensor, residual: Tensor, weight: Tensor, eps: float, *,
                stored: Callable[[Tensor], Tensor] = lambda t: t) -> tuple[Tensor, ...]:
        s = x + residual
        # fused_add_rms_norm normalises the new residual as stored (the op's definition)
        return _rms(stored(s) if normalize_stored else s, weight, eps, offset), s
    return formula


def _rotary(positions: Tensor, query: Tensor, key: Tensor, cache: Tensor, head_size: int,
            is_neox: bool) -> tuple[Tensor, Tensor]:
    cos, sin = cache[positions].chunk(2, dim=-1)

    def rotate(x: Tensor) -> Tensor:
        x = x.unflatten(-1, (-1, head_size))
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)

    return rotate(query), rotate(key)


def _moe(x: Tensor, w1: Tensor, w2: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = x[rows] @ w1[e].t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, weights[rows, slot].unsqueeze(1) * (act @ w2[e].t()))
    return out


def _attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
               seq_lens: Tensor, query_start_loc: Tensor, scale: float) -> Tensor:
    out = torch.zeros_like(query)
    _, block_size, kv_heads, head_size = key_cache.shape
    group = query.shape[1] // kv_heads
    starts = query_start_loc.tolist()
    for i, kv_len in enumerate(seq_lens.tolist()):
        q = query[starts[i]:starts[i + 1]]
        blocks = block_tables[i, : (kv_len + block_size - 1) // block_size].long()
        k = key_cache[blocks].reshape(-1, kv_heads, head_size)[:kv_len]
        v = value_cache[blocks].reshape(-1, kv_heads, head_size)[:kv_len]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        pos = torch.arange(kv_len - q.shape[0], kv_len).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(kv_len).unsqueeze(0) > pos, -math.inf)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _linear_args(dtype: torch.dtype, g: torch.Generator) -> tuple[Any, ...]:
    # two rows: the decode-step calls the cpp kernel takes
    return (_randn(g, 2, 1024).to(dtype), _randn(g, 1000, 1024, scale=1 / 32).to(dtype),
            _randn(g, 1000).to(dtype))


def _linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return (x[..., None, :] * weight).sum(-1) + bias


def _activation(shape: tuple[int, int], scale: float = 2.0) -> Builder:
    return lambda dtype, g: (_randn(g, *shape, scale=scale).to(dtype),)


def _norm(fused: bool) -> Builder:
    def build(dtype: torch.dtype, g: torch.Generator) -> tuple[Any, ...]:
        x = _randn(g, 83, 768, scale=3.0).to(dtype)
        weight = (1 + 0.5 * _randn(g, 768)).to(dtype)
        if fused:
            return x, _randn(g, 83, 768, scale=3.0).to(dtype), weight, 1e-6
        return x, weight, 1e-6
    return build


def _rotary_args(dtype: torch.dtype, g: torch.Generator) -> tuple[Any, ...]:
    tokens, heads, head = 55, 17, 128
    inv = 1.0 / 10000 ** (torch.arange(0, head, 2, dtype=torch.float64) / head)
    freqs = torch.outer(torch.arange(4096, dtype=torch.float64), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    return (positions, _randn(g, tokens, heads * head).to(dtype),
            _randn(g, tokens, heads * head).to(dtype), cache, head, True)


def _moe_args(tokens: int, hidden: int, inter: int) -> Builder:
    def build(dtype: torch.dtype, g: torch.Generator) -> tuple[Any, ...]:
        x = _randn(g, tokens, hidden, scale=1 / (0.5 * hidden ** 0.5)).to(dtype)
        w1 = _randn(g, 8, 2 * inter, hidden, scale=1 / (0.5 * hidden ** 0.5)).to(dtype)
        w2 = _randn(g, 8, hidden, inter, scale=1 / (0.5 * inter ** 0.5)).to(dtype)
        weights, ids = torch.topk(torch.softmax(_randn(g, tokens, 8), -1), 4)
        return x, w1, w2, weights, ids.to(torch.int32)
    return build


def _attention_args(q_lens: list[int], kv_lens: list[int]) -> Builder:
    def build(dtype: torch.dtype, g: torch.Generator) -> tuple[Any, ...]:
        b = paged_batch(q_lens, kv_lens, heads=16, kv_heads=4, head_size=128, block_size=16,
                        dtype=dtype, generator=g)
        return (*tuple(b.args())[:6], 128 ** -0.5)
    return build


def _silu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


C = math.sqrt(2 / math.pi)
OPS: dict[str, tuple[str, Builder, Formula]] = {
    "silu_and_mul": ("silu_and_mul", _activation((83, 1024)), _gated(lambda a, b: _silu(a) * b)),
    "gelu_and_mul": ("gelu_and_mul", _activation((83, 1024)), _gated(lambda a, b: F.gelu(a) * b)),
    "mul_and_silu": ("mul_and_silu", _activation((83, 1024)), _gated(lambda a, b: a * _silu(b))),
    "fatrelu_and_mul": ("fatrelu_and_mul", _activation((83, 1024)),
                        _gated(lambda a, b: F.threshold(a, 0.0, 0.0) * b)),
    "swigluoai_and_mul": ("swigluoai_and_mul", _activation((83, 1024)),
                          lambda x: ((x[..., 1::2].clamp(-7, 7) + 1) * x[..., ::2].clamp(max=7)
                                     * torch.sigmoid(1.702 * x[..., ::2].clamp(max=7)))),
    "gelu_new": ("gelu_new", _activation((83, 1024)),
                 lambda x: 0.5 * x * (1 + torch.tanh(C * (x + 0.044715 * x.pow(3))))),
    "gelu_fast": ("gelu_fast", _activation((83, 1024)),
                  lambda x: 0.5 * x * (1 + torch.tanh(x * 0.7978845608 * (1 + 0.044715 * x * x)))),
    "quick_gelu": ("quick_gelu", _activation((83, 1024)), lambda x: x * torch.sigmoid(1.702 * x)),
    "relu2": ("relu2", _activation((83, 1024)), lambda x: F.relu(x).square()),
    "rms_norm": ("rms_norm", _norm(False), _rms),
    "fused_add_rms_norm": ("fused_add_rms_norm", _norm(True), _add_rms(0.0, True)),
    "gemma_rms_norm": ("gemma_rms_norm", _norm(False),
                       lambda x, w, eps: _rms(x, w, eps, 1.0)),
    "gemma_fused_add_rms_norm": ("gemma_fused_add_rms_norm", _norm(True), _add_rms(1.0, False)),
    "rotary_embedding": ("rotary_embedding", _rotary_args, _rotary),
    "linear": ("linear", _linear_args, _linear),
    "fused_moe-1x128x128": ("fused_moe", _moe_args(1, 128, 128), _moe),
    "fused_moe-64x128x128": ("fused_moe", _moe_args(64, 128, 128), _moe),
    "fused_moe-256x128x128": ("fused_moe", _moe_args(256, 128, 128), _moe),
    "fused_moe-7x128x2880": ("fused_moe", _moe_args(7, 128, 2880), _moe),
    "paged_attention-prefill": ("paged_attention", _attention_args([7, 33], [7, 40]),
                                _attention),
    "paged_attention-decode": ("paged_attention", _attention_args([1, 1, 1], [83, 17, 300]),
                               _attention),
}


def _outputs(value: Any) -> list[Tensor]:
    items = value if isinstance(value, tuple | list) else (value,)
    return [t for t in items if isinstance(t, Tensor) and t.is_floating_point()]


def _widen(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.double() if isinstance(a, Tensor) and a.is_floating_point() else a
                 for a in args)


def _mean_error(got: Any, exact: Any) -> float:
    pairs = list(zip(_outputs(got), _outputs(exact), strict=True))
    total = sum(float((a.double() - b).abs().sum()) for a, b in pairs)
    return total / sum(b.numel() for _, b in pairs)


ONE_ROUNDING_SLACK = 1.05
"""How far above the error of rounding the exact result once a provider may be: float32's own
error moves a few results across a rounding boundary."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(OPS))
def test_one_rounding_is_never_worse_than_rounding_every_step(case: str,
                                                              dtype: torch.dtype) -> None:
    opmux.load_plugins()
    name, build, formula = OPS[case]
    op = opmux.get_op(name)
    args = build(dtype, torch.Generator().manual_seed(53))
    stored = {"stored": lambda t: t.to(dtype).double()} \
        if "stored" in inspect.signature(formula).parameters else {}
    exact = formula(*_widen(args), **stored)
    per_op = _mean_error(formula(*args), exact)
    once = _mean_error(tuple(t.to(dtype) for t in _outputs(exact)), exact)
    checked = []
    for provider, impl in op.impls.items():
        if not impl.supported or impl.dispatch_key not in ("CPU", "CompositeExplicitAutograd"):
            continue
        if impl.supports_args is not None and not impl.supports_args(*args):
            continue
        got = impl(*(a.clone() if isinstance(a, Tensor) else a for a in args))
        assert all(t.dtype == dtype for t in _outputs(got)), provider
        error = _mean_error(got, exact)
        where = (f"{case} {dtype} provider {provider!r}: mean |error| {error:.4g} vs float64; "
                 f"per-op-in-dtype {per_op:.4g}, the exact result rounded once {once:.4g}")
        assert error <= per_op, where
        assert error <= ONE_ROUNDING_SLACK * once, where
        checked.append(provider)
    assert "native" in checked
