"""Catalog semantics, input errors and torch integration of ``apply_rotary_emb`` and
``dual_chunk_rotary_embedding``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import opmux
from opmux.ops import apply_rotary_emb as apply_op
from opmux.ops import dual_chunk_rotary_embedding as dual_op
from opmux.ops.rotary import make_dual_chunk_caches
from opmux.testing import cases_for, run_opcheck

apply_rotary_emb = apply_op.native
dual_chunk_rotary_embedding = dual_op.native


def _complex_rotate(x: Tensor, cos: Tensor, sin: Tensor, neox: bool) -> Tensor:
    """Rotate whole heads of ``x[..., D]`` by ``cos``/``sin`` ``[..., D/2]`` (broadcast)."""
    d = x.shape[-1]
    xd = x.double()
    z = (torch.complex(xd[..., : d // 2], xd[..., d // 2:]) if neox
         else torch.complex(xd[..., 0::2], xd[..., 1::2]))
    z = z * torch.complex(cos.double(), sin.double())
    if neox:
        return torch.cat((z.real, z.imag), -1)
    return torch.stack((z.real, z.imag), -1).flatten(-2)


# ------------------------------------------------------------------------ apply_rotary_emb
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("shape", [(5, 3, 16), (2, 5, 3, 16)])
def test_apply_rotary_emb_is_a_rotation(neox: bool, shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape)
    ang = torch.rand(5, 8) * 6.3
    got = apply_rotary_emb(x, ang.cos(), ang.sin(), neox, False)
    want = _complex_rotate(x, ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2), neox)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-4)


def test_apply_rotary_emb_dtype_handling() -> None:
    """Without fp32 compute the math runs in x's dtype (tables cast to it); with it, in
    float32 and cast back: the two differ in bf16, and the fp32 one is the exact rounding."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4, 32, generator=g) * 3).bfloat16()
    ang = torch.rand(64, 16, generator=g) * 6.3
    cos, sin = ang.cos(), ang.sin()
    low = apply_rotary_emb(x, cos, sin, True, False)
    high = apply_rotary_emb(x, cos, sin, True, True)
    assert low.dtype == high.dtype == torch.bfloat16
    c, s = cos.bfloat16().unsqueeze(-2), sin.bfloat16().unsqueeze(-2)
    x1, x2 = x.chunk(2, -1)
    assert torch.equal(low, torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1))
    exact = _complex_rotate(x, cos.unsqueeze(-2), sin.unsqueeze(-2), True)
    assert torch.equal(high, exact.float().bfloat16())
    assert not torch.equal(low, high)


def test_apply_rotary_emb_input_errors() -> None:
    x, c = torch.randn(5, 2, 16), torch.randn(5, 8)
    with pytest.raises(opmux.OpInputError, match=r"'x' expected a tensor \[batch"):
        apply_rotary_emb(torch.randn(5, 16), c, c)
    with pytest.raises(opmux.OpInputError, match=r"'x' expected .*even head_size"):
        apply_rotary_emb(torch.randn(5, 2, 15), c, c)
    with pytest.raises(opmux.OpInputError, match=r"'cos' expected shape \[5, 8\]"):
        apply_rotary_emb(x, torch.randn(4, 8), c)
    with pytest.raises(opmux.OpInputError, match=r"'sin' expected shape \[5, 8\]"):
        apply_rotary_emb(x, c, torch.randn(5, 16))
    with pytest.raises(opmux.OpInputError, match="'x' expected a floating tensor"):
        apply_rotary_emb(x.int(), c, c)
    with pytest.raises(opmux.OpInputError, match="apply_rotary_emb"):  # whichever provider
        apply_op(x, torch.randn(4, 8), c)


# -------------------------------------------------------------- dual_chunk_rotary_embedding
CHUNK, LOCAL, MAX_POS = 24, 8, 96


def _dual_inputs(t: int = 9, h: int = 2, hkv: int = 1, d: int = 32, rot: int = 32
                 ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, MAX_POS, (t,), generator=g)
    return (positions, torch.randn(t, h * d, generator=g), torch.randn(t, hkv * d, generator=g),
            make_dual_chunk_caches(CHUNK, LOCAL, MAX_POS, rot))


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [32, 16])
def test_dual_chunk_rotations(neox: bool, rot: int) -> None:
    positions, query, key, caches = _dual_inputs(rot=rot)
    offsets = torch.randint(0, 3, positions.shape)
    positions = positions.clamp(max=MAX_POS - 3)
    q_out, k_out = dual_chunk_rotary_embedding(positions, query, key, *caches, 32, neox, offsets)
    assert q_out.shape == (9, 5 * 64) and k_out.shape == key.shape
    length = CHUNK - LOCAL
    p = positions + offsets
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).double() / rot))

    def rotate(x: Tensor, at: Tensor) -> Tensor:
        heads = x.view(9, -1, 32).double().clone()
        ang = (at.double()[:, None] * inv)[:, None, :]
        heads[..., :rot] = _complex_rotate(heads[..., :rot], ang.cos(), ang.sin(), neox)
        return heads.flatten(-2)

    c = p % length
    angles = [c, (c + length).clamp(max=CHUNK), torch.full_like(c, min(2 * length - 1, CHUNK)),
              c + length, c + CHUNK]
    for i, at in enumerate(angles):
        torch.testing.assert_close(q_out[:, i * 64:(i + 1) * 64].double(), rotate(query, at),
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.double(), rotate(key, c), atol=1e-5, rtol=1e-5)
    if rot < 32:  # the pass-through dims are copied exactly
        assert torch.equal(q_out.view(9, 5, 2, 32)[..., rot:],
                           query.view(9, 1, 2, 32)[..., rot:].expand(9, 5, 2, 32 - rot))


def test_dual_chunk_input_errors() -> None:
    positions, query, key, caches = _dual_inputs()
    op = dual_chunk_rotary_embedding
    with pytest.raises(opmux.OpInputError, match=r"'positions' expected positions in \[0, 96\)"):
        op(positions + 90, query, key, *caches, 32)
    with pytest.raises(opmux.OpInputError, match=r"positions \+ offsets in \[0, 96\)"):
        op(positions, query, key, *caches, 32, True, torch.full_like(positions, 96))
    with pytest.raises(opmux.OpInputError, match=r"'offsets' expected None or an int32/int64"):
        op(positions, query, key, *caches, 32, True, positions[:3])
    with pytest.raises(opmux.OpInputError, match="'key' expected query's dtype"):
        op(positions, query, key.double(), *caches, 32)
    with pytest.raises(opmux.OpInputError, match=r"'query' expected \[9, heads\*32\]"):
        op(positions, query[:, :40], key, *caches, 32)
    bad = list(caches)
    bad[1] = bad[1][:5]
    with pytest.raises(opmux.OpInputError, match=r"'cos_sin_qc_cache' expected shape \[16, 32\]"):
        op(positions, query, key, *bad, 32)
    bad = list(caches)
    bad[4] = bad[4].double()
    with pytest.raises(opmux.OpInputError, match="'cos_sin_q_inter_cache' expected cos_sin_q"):
        op(positions, query, key, *bad, 32)
    with pytest.raises(opmux.OpInputError, match="'cos_sin_q_cache' expected an even rotary"):
        op(positions, query[:, :32], key[:, :16], *caches, 16)
    with pytest.raises(opmux.OpInputError, match="dual_chunk_rotary_embedding"):
        dual_op(positions + 90, query, key, *caches, 32)  # whichever provider serves it


def test_dual_chunk_cache_builder() -> None:
    q, qc, k, qcnc, qi = make_dual_chunk_caches(CHUNK, LOCAL, MAX_POS, 8, base=100.0)
    length = CHUNK - LOCAL
    assert q.shape == qc.shape == qcnc.shape == qi.shape == (length, 8)
    assert k.shape == (MAX_POS, 8)
    inv = [100.0 ** (-2 * i / 8) for i in range(4)]
    for row, pos in ((q[3], 3), (qc[10], CHUNK), (k[40], 40 % length), (qcnc[10], 26),
                     (qi[2], 2 + CHUNK)):
        want = [math.cos(pos * f) for f in inv] + [math.sin(pos * f) for f in inv]
        torch.testing.assert_close(row.double(), torch.tensor(want, dtype=torch.float64),
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="must exceed local_size"):
        make_dual_chunk_caches(8, 8, 16, 8)


# ------------------------------------------------------------------------- torch plumbing
@pytest.mark.parametrize("name", ["apply_rotary_emb", "dual_chunk_rotary_embedding"])
def test_opcheck(name: str) -> None:
    op = opmux.get_op(name)
    cases = [c for c in cases_for(name)
             if c.name.startswith(("fp32-neox", "bf16-gptj", "fp32-empty", "fp32-strided"))]
    results = run_opcheck(op, cases=cases[:5])
    assert results
    for per_case in results.values():
        assert set(per_case.values()) == {"SUCCESS"}, per_case


def test_compile_fullgraph_of_both_ops() -> None:
    positions, query, key, caches = _dual_inputs()
    x, ang = torch.randn(2, 5, 3, 16), torch.rand(5, 8)

    def block(positions: Tensor, query: Tensor, key: Tensor, x: Tensor, cos: Tensor,
              sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k = opmux.ops.dual_chunk_rotary_embedding(positions, query, key, *caches, 32)
        return q, k, opmux.ops.apply_rotary_emb(x, cos, sin, False, True)

    args = (positions, query, key, x, ang.cos(), ang.sin())
    want = block(*args)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(*args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()
