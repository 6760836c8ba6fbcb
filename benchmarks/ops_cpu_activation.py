"""Rows of ``ops_cpu.py`` for vLLM's other activation rows (``fatrelu_and_mul`` ... ``xielu``).

Gated ops read ``[tokens, 2 * inter]``; the elementwise ones read ``[tokens, inter]``.
vLLM's CPU library has kernels for ``gelu_new``, ``gelu_fast`` and ``quick_gelu``
(``gelu_quick``); the other ops have no vLLM CPU kernel (vLLM runs their PyTorch code).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Fn = Callable[[], Any]


def _unary_fns(op: Callable[..., Any], kernels: Any, kernel: str, x: torch.Tensor,
               out: torch.Tensor) -> dict[str, Fn]:
    """The op of an elementwise activation, and its kernel ``kernels.<kernel>`` writing into
    ``out`` (looked up when called: the library loads on the op's first call)."""
    return {"cpp": lambda: op(x),
            "cpp kernel (out given)": lambda: getattr(kernels, kernel)(out, x)}


def activation_cases(tokens: int, inter: int, dtype: torch.dtype,
                     has_vllm: bool) -> list[tuple[str, tuple[Any, ...], dict[str, Fn]]]:
    """(op name, native args, {label: callable}) per op, as ``ops_cpu.cases`` returns."""
    from opmux.plugins.cpu import cpp_activation as c

    k = torch.ops.opmux_cpu
    torch.manual_seed(0)
    g = torch.randn(tokens, 2 * inter, dtype=dtype)
    g_out = torch.empty(tokens, inter, dtype=dtype)
    x = torch.randn(tokens, inter, dtype=dtype)
    out = torch.empty_like(x)
    ap = torch.tensor([0.5], dtype=dtype)
    an = torch.tensor([0.1], dtype=dtype)
    mult = 1.6448536
    rows: list[tuple[str, tuple[Any, ...], dict[str, Fn]]] = [
        ("fatrelu_and_mul", (g, 0.1), {
            "cpp": lambda: c.fatrelu_and_mul(g, 0.1),
            "cpp kernel (out given)": lambda: k.fatrelu_and_mul_out(g_out, g, 0.1)}),
        ("mul_and_silu", (g,), {
            "cpp": lambda: c.mul_and_silu(g),
            "cpp kernel (out given)": lambda: k.mul_and_silu_out(g_out, g)}),
        ("gelu_and_mul_sparse", (g, 0.95, "tanh"), {
            "cpp": lambda: c.gelu_and_mul_sparse(g, 0.95, "tanh"),
            "cpp kernel (out given)": lambda: k.gelu_and_mul_sparse_out(g_out, g, mult,
                                                                        "tanh")}),
        ("swigluoai_and_mul", (g, 1.702, 7.0), {
            "cpp": lambda: c.swigluoai_and_mul(g, 1.702, 7.0),
            "cpp kernel (out given)": lambda: k.swigluoai_and_mul_out(g_out, g, 1.702, 7.0)}),
        *((name, (x,), _unary_fns(getattr(c, name), k, f"{name}_out", x, out))
          for name in ("gelu_new", "gelu_fast", "quick_gelu", "relu2")),
        ("xielu", (x, ap, an, 0.5, -1e-6), {
            "cpp": lambda: c.xielu(x, ap, an, 0.5, -1e-6),
            "cpp kernel (out given)": lambda: k.xielu_out(out, x, ap, an, 0.5, -1e-6)}),
    ]
    if has_vllm:
        v = torch.ops._C
        extra: dict[str, Fn] = {
            "gelu_new": lambda: v.gelu_new(out, x),
            "gelu_fast": lambda: v.gelu_fast(out, x),
            "quick_gelu": lambda: v.gelu_quick(out, x),
        }
        for name, _, fns in rows:
            if name in extra:
                fns["vLLM kernel"] = extra[name]
    return rows
