"""Bad inputs of the activations, the RMS norms and ``rotary_embedding``.

Registered by :func:`register_elementwise_bad_inputs` (called by
:mod:`opmux.testing.bad_inputs`). Every row is refused by native and by every provider with an
:class:`opmux.OpInputError` naming the argument in the row."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opmux.ops.rotary import make_cos_sin_cache
from opmux.testing.bad_input_table import BadInput, register_bad_inputs

__all__ = [
    "gated_bad_inputs", "norm_bad_inputs", "register_elementwise_bad_inputs",
    "rotary_bad_inputs",
]

_META = torch.device("meta")


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + 7)
    return torch.randn(shape, generator=g).to(dtype)


def _gated_x_rows() -> Iterator[tuple[str, object]]:
    yield "x-none", None
    yield "x-0d", torch.tensor(1.5)
    yield "x-odd-last-dim", _x(4, 7)
    yield "x-odd-last-dim-3d", _x(2, 3, 5)
    yield "x-one-column", _x(3, 1)
    yield "x-int64", torch.arange(8).reshape(2, 4)
    yield "x-int32", torch.arange(8, dtype=torch.int32).reshape(2, 4)
    yield "x-bool", torch.ones(2, 4, dtype=torch.bool)
    yield "x-complex", torch.ones(2, 4, dtype=torch.complex64)


def gated_bad_inputs(with_approximate: bool) -> Iterator[BadInput]:
    """Rows of ``silu_and_mul`` (``with_approximate`` false) or ``gelu_and_mul``."""
    tail: tuple[object, ...] = ("none",) if with_approximate else ()
    for label, x in _gated_x_rows():
        yield BadInput(label, (x, *tail), {}, "x")
    if with_approximate:
        good = _x(3, 8)
        for label, approx in (("approximate-unknown", "exact"), ("approximate-upper", "TANH"),
                              ("approximate-empty", ""), ("approximate-erf", "erf"),
                              ("approximate-space", " none")):
            yield BadInput(label, (good, approx), {}, "approximate")
        yield BadInput("x-odd-with-tanh", (_x(2, 9), "tanh"), {}, "x")


def norm_bad_inputs(fused: bool) -> Iterator[BadInput]:
    """Rows of ``rms_norm`` (``fused`` false) or ``fused_add_rms_norm``."""
    x, w = _x(4, 16), _x(16).abs() + 0.5

    def row(label: str, argument: str, x: object = x, weight: object = w,
            eps: float = 1e-6, residual: object = None) -> BadInput:
        if fused:
            res = _x(4, 16) if residual is None else residual
            return BadInput(label, (x, res, weight, eps), {}, argument)
        return BadInput(label, (x, weight, eps), {}, argument)

    yield row("x-none", "x", x=None)
    yield row("x-0d", "x", x=torch.tensor(2.0))
    yield row("x-int64", "x", x=torch.arange(64).reshape(4, 16))
    yield row("x-bool", "x", x=torch.ones(4, 16, dtype=torch.bool))
    yield row("weight-none", "weight", weight=None)
    yield row("weight-int32", "weight", weight=torch.ones(16, dtype=torch.int32))
    yield row("weight-2d", "weight", weight=w.reshape(4, 4))
    yield row("weight-too-short", "weight", weight=w[:15])
    yield row("weight-too-long", "weight", weight=torch.ones(17))
    yield row("weight-0d", "weight", weight=torch.tensor(1.0))
    yield row("weight-on-meta", "weight", weight=torch.ones(16, device=_META))
    yield row("eps-negative", "eps", eps=-1.0)
    yield row("eps-negative-half", "eps", eps=-0.5)
    yield row("eps-tiny-negative", "eps", eps=-1e-12)
    yield row("eps-nan", "eps", eps=float("nan"))
    yield row("eps-minus-inf", "eps", eps=float("-inf"))
    if fused:
        yield BadInput("residual-none", (x, None, w, 1e-6), {}, "residual")
        yield row("residual-shape", "residual", residual=_x(4, 8))
        yield row("residual-rows", "residual", residual=_x(3, 16))
        yield row("residual-rank", "residual", residual=_x(2, 2, 16))
        yield row("residual-dtype", "residual", residual=_x(4, 16, dtype=torch.bfloat16))
        yield row("residual-on-meta", "residual",
                  residual=torch.empty(4, 16, device=_META))


def rotary_bad_inputs() -> Iterator[BadInput]:
    """Rows of ``rotary_embedding``."""
    t, h, hkv, d, rot, max_pos = 5, 2, 1, 16, 16, 32
    pos = torch.tensor([0, 3, 7, 31, 2])
    q, k = _x(t, h * d), _x(t, hkv * d)
    cache = make_cos_sin_cache(max_pos, rot)

    def row(label: str, argument: str, positions: object = pos, query: object = q,
            key: object = k, cos_sin_cache: object = cache, head_size: object = d,
            is_neox: object = True) -> BadInput:
        return BadInput(label, (positions, query, key, cos_sin_cache, head_size, is_neox), {},
                        argument)

    yield row("positions-none", "positions", positions=None)
    yield row("positions-float", "positions", positions=pos.float())
    yield row("positions-int16", "positions", positions=pos.to(torch.int16))
    yield row("positions-0d", "positions", positions=torch.tensor(3))
    yield row("positions-on-meta", "positions", positions=torch.empty(t, dtype=torch.int64,
                                                                      device=_META))
    yield row("positions-past-cache", "positions", positions=torch.tensor([0, 1, 2, 32, 4]))
    yield row("positions-negative", "positions", positions=torch.tensor([0, -1, 2, 3, 4]))
    yield row("positions-2d-query-flat-tokens", "query", positions=pos.reshape(1, t))
    yield row("query-none", "query", query=None)
    yield row("query-int", "query", query=torch.ones(t, h * d, dtype=torch.int64))
    yield row("query-heads-disagree", "query", query=_x(t, h * d + 4))
    yield row("query-head-size-not-divisor", "query", query=_x(t, 24))
    yield row("query-tokens", "query", query=_x(t + 1, h * d))
    yield row("query-1d", "query", query=_x(t * h * d))
    yield row("query-4d", "query", query=_x(t, h, d, 1))
    yield row("query-per-head-wrong-d", "query", query=_x(t, h, d + 2))
    yield row("query-on-meta", "query", query=torch.empty(t, h * d, device=_META))
    yield row("key-none", "key", key=None)
    yield row("key-tokens", "key", key=_x(t - 1, hkv * d))
    yield row("key-heads-disagree", "key", key=_x(t, d + 3))
    yield row("key-dtype", "key", key=k.to(torch.bfloat16))
    yield row("key-on-meta", "key", key=torch.empty(t, hkv * d, device=_META))
    yield row("cos-sin-cache-none", "cos_sin_cache", cos_sin_cache=None)
    yield row("cos-sin-cache-1d", "cos_sin_cache", cos_sin_cache=cache.flatten())
    yield row("cos-sin-cache-odd-rot", "cos_sin_cache", cos_sin_cache=cache[:, :15])
    yield row("cos-sin-cache-rot-0", "cos_sin_cache", cos_sin_cache=cache[:, :0])
    yield row("cos-sin-cache-rot-past-head", "cos_sin_cache",
              cos_sin_cache=make_cos_sin_cache(max_pos, 2 * d))
    yield row("cos-sin-cache-int", "cos_sin_cache",
              cos_sin_cache=torch.ones(max_pos, rot, dtype=torch.int32))
    yield row("cos-sin-cache-on-meta", "cos_sin_cache",
              cos_sin_cache=torch.empty(max_pos, rot, device=_META))
    yield row("head-size-0", "head_size", head_size=0)
    yield row("head-size-negative", "head_size", head_size=-16)
    yield row("head-size-not-dividing", "query", query=_x(t, 40), key=_x(t, 40),
              head_size=12, cos_sin_cache=make_cos_sin_cache(max_pos, 12))


def register_elementwise_bad_inputs() -> None:
    """Register the generators above."""
    register_bad_inputs("silu_and_mul", lambda: gated_bad_inputs(False))
    register_bad_inputs("gelu_and_mul", lambda: gated_bad_inputs(True))
    register_bad_inputs("rms_norm", lambda: norm_bad_inputs(False))
    register_bad_inputs("fused_add_rms_norm", lambda: norm_bad_inputs(True))
    register_bad_inputs("rotary_embedding", rotary_bad_inputs)
