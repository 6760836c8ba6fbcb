"""rotary_embedding takes vLLM's layouts, through native and every provider here.

Positions of any shape (``[T]``, ``[batch, seq]``) with queries flattened
(``[*P, H*D]``) or per-head (``[*P, H, D]``), padded per-head views included; outputs keep
the input's shape. Checked against a float64 reference of ours that rotates each pair
explicitly (no shared code with the op).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import opmux
import opmux.ops
from opmux.ops.rotary import make_cos_sin_cache

HEAD_SIZES = (64, 80)
LAYOUTS = ("tokens-flat", "tokens-per-head", "batch-flat", "batch-per-head", "batch-padded")


def reference(positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor, head_size: int,
              is_neox: bool) -> torch.Tensor:
    """Rotate ``x`` ([*P, H*D] or [*P, H, D]) in float64, pair by pair."""
    pos = positions.reshape(-1).tolist()
    heads = x.reshape(len(pos), -1, head_size).double()
    out = heads.clone()
    rot = cache.shape[1]
    half = rot // 2
    for t, p in enumerate(pos):
        for i in range(half):
            c, s = float(cache[p, i]), float(cache[p, half + i])
            a, b = (i, half + i) if is_neox else (2 * i, 2 * i + 1)
            x1, x2 = heads[t, :, a], heads[t, :, b]
            out[t, :, a] = x1 * c - x2 * s
            out[t, :, b] = x2 * c + x1 * s
    return out.reshape(x.shape)


def _inputs(layout: str, heads: int, head_size: int, dtype: torch.dtype,
            seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch, seq = 2, 3
    positions = torch.randint(0, 64, (batch, seq) if layout.startswith("batch") else
                              (batch * seq,), generator=g)
    lead = tuple(positions.shape)
    if layout.endswith("flat"):
        x = torch.randn(*lead, heads * head_size, generator=g)
    elif layout.endswith("padded"):
        x = torch.randn(*lead, heads, head_size + 16, generator=g)[..., :head_size]
    else:
        x = torch.randn(*lead, heads, head_size, generator=g)
    return positions, x.to(dtype)


def _providers() -> list[str]:
    opmux.load_plugins()
    op = opmux.ops.rotary_embedding
    return [p for p, impl in op.impls.items() if impl.supported
            and impl.dispatch_key in ("CPU", "CompositeExplicitAutograd")
            and getattr(impl.fn, "__module__", "").startswith("opmux.")]


@pytest.mark.parametrize("provider", _providers())
@pytest.mark.parametrize(("layout", "head_size", "partial", "is_neox"),
                         list(itertools.product(LAYOUTS, HEAD_SIZES, (False, True),
                                                (True, False))))
def test_layouts_against_reference(provider: str, layout: str, head_size: int, partial: bool,
                                   is_neox: bool) -> None:
    op = opmux.ops.rotary_embedding
    rot = 32 if partial else head_size
    cache = make_cos_sin_cache(64, rot)
    positions, query = _inputs(layout, 3, head_size, torch.float32, seed=head_size)
    _, key = _inputs(layout, 1, head_size, torch.float32, seed=head_size + 1)
    impl = op.impls[provider]
    assert impl.supports_args is None or impl.supports_args(positions, query, key, cache,
                                                            head_size, is_neox)
    q0, k0 = query.clone(), key.clone()
    got_q, got_k = impl.fn(positions, query, key, cache, head_size, is_neox)
    assert got_q.shape == query.shape and got_k.shape == key.shape
    want_q = reference(positions, query, cache, head_size, is_neox)
    want_k = reference(positions, key, cache, head_size, is_neox)
    torch.testing.assert_close(got_q.double(), want_q, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(got_k.double(), want_k, atol=2e-6, rtol=2e-6)
    assert torch.equal(query, q0) and torch.equal(key, k0), "inputs must be untouched"
    # the op call picks the same layout rules
    with op.set_priority([provider, "native"] if provider != "native" else ["native"]):
        via_op = op(positions, query, key, cache, head_size, is_neox)
    torch.testing.assert_close(via_op[0], got_q, atol=1e-6, rtol=1e-6)


def test_bf16_rounds_once() -> None:
    """vLLM's Python reference rotates bf16 inputs *in bf16* (cos and sin cast to the input
    dtype, each product and sum rounded), while opmux (and vLLM's own CPU kernel) compute in
    fp32 and round once. Pin opmux's choice: within half a bf16 ulp of the float64 reference,
    and never worse than rotating in bf16."""
    op = opmux.ops.rotary_embedding
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 4096, (256,), generator=g)
    cache = make_cos_sin_cache(4096, 64)
    query = (torch.randn(256, 4 * 64, generator=g) * 3).to(torch.bfloat16)
    key = (torch.randn(256, 64, generator=g) * 3).to(torch.bfloat16)
    got, _ = op.native(positions, query, key, cache.to(torch.bfloat16), 64, True)
    want = reference(positions, query, cache.to(torch.bfloat16).float(), 64, True)
    err = (got.double() - want).abs()
    ulp = torch.tensor(2.0) ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    assert bool((err <= ulp / 2 + 1e-12).all()), float((err / ulp).max())
    # rotating in bf16 (the vLLM Python reference's arithmetic) is measurably worse
    c = cache.to(torch.bfloat16).index_select(0, positions)
    cos, sin = c[:, :32].unsqueeze(1), c[:, 32:].unsqueeze(1)
    heads = query.view(256, 4, 64)
    x1, x2 = heads[..., :32], heads[..., 32:]
    in_bf16 = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).reshape(query.shape)
    assert float((in_bf16.double() - want).abs().max()) > float(err.max())
    assert math.isfinite(float(err.max()))
