"""Catalog semantics and input errors: rotary embedding and the KV-cache bookkeeping."""

from __future__ import annotations

import pytest
import torch

import opmux
from opmux.ops import advance_step_flashattn, reshape_and_cache, rotary_embedding
from opmux.ops.rotary import make_cos_sin_cache


def _complex_rotary(x: torch.Tensor, pos: torch.Tensor, rot: int, head: int,
                    neox: bool) -> torch.Tensor:
    """Independent formulation: multiply (x1 + i x2) by exp(i * pos * freq)."""
    t = x.shape[0]
    heads = x.view(t, -1, head).clone()
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).double() / rot))
    angle = pos.double().unsqueeze(1) * inv  # [T, rot/2]
    r = heads[..., :rot].double()
    if neox:
        z = torch.complex(r[..., : rot // 2], r[..., rot // 2:])
    else:
        z = torch.complex(r[..., 0::2], r[..., 1::2])
    z = z * torch.polar(torch.ones_like(angle), angle).unsqueeze(1)
    out = torch.cat((z.real, z.imag), -1) if neox else torch.stack((z.real, z.imag), -1).flatten(-2)
    heads[..., :rot] = out.to(x.dtype)
    return heads.view_as(x)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32])
def test_rotary_matches_complex_formulation(neox: bool, rot: int) -> None:
    t, h, hkv, d = 6, 4, 2, 64
    pos = torch.tensor([0, 1, 5, 17, 30, 63])
    q, k = torch.randn(t, h * d), torch.randn(t, hkv * d)
    q0, k0 = q.clone(), k.clone()
    cache = make_cos_sin_cache(64, rot)
    oq, ok = rotary_embedding.native(pos, q, k, cache, d, neox)
    torch.testing.assert_close(oq, _complex_rotary(q0, pos, rot, d, neox), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, _complex_rotary(k0, pos, rot, d, neox), atol=1e-5, rtol=1e-5)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # functional: inputs untouched
    if rot < d:  # dims rot..D pass through
        assert torch.equal(oq.view(t, h, d)[..., rot:], q0.view(t, h, d)[..., rot:])


def test_rotary_3d_layout_equals_2d_layout() -> None:
    pos = torch.arange(5)
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    cache = make_cos_sin_cache(8, 32)
    q3, k3 = rotary_embedding.native(pos, q, k, cache, 32, False)
    q2, k2 = rotary_embedding.native(pos, q.view(5, -1), k.view(5, -1), cache, 32, False)
    assert q3.shape == q.shape
    torch.testing.assert_close(q3.view(5, -1), q2)
    torch.testing.assert_close(k3.view(5, -1), k2)


def test_rotary_errors() -> None:
    q, k = torch.randn(3, 64), torch.randn(3, 64)
    with pytest.raises(opmux.OpInputError,
                       match=r"rotary_embedding.*'positions' expected values in \[0, 16\).*"
                             r"got values in \[0, 16\]"):
        rotary_embedding.native(torch.tensor([0, 3, 16]), q, k, make_cos_sin_cache(16, 32), 32)
    with pytest.raises(opmux.OpInputError, match=r"'cos_sin_cache' expected an even rotary "
                                                 r"width 0 < rot <= head_size=32"):
        rotary_embedding.native(torch.arange(3), q, k, torch.randn(16, 64), 32)
    with pytest.raises(opmux.OpInputError, match=r"'query' expected \[T, heads\*48\]"):
        rotary_embedding.native(torch.arange(3), q, k, torch.randn(16, 32), 48)
    with pytest.raises(opmux.OpInputError, match=r"'positions' expected dtype int32 or int64"):
        rotary_embedding.native(torch.zeros(3), q, k, torch.randn(16, 32), 32)
    with pytest.raises(opmux.OpInputError, match=r"'key' expected \[T, heads\*32\].*with T=3"):
        rotary_embedding.native(torch.arange(3), q, torch.randn(2, 64), torch.randn(16, 32), 32)


def test_reshape_and_cache_writes_slots_and_skips_minus_one() -> None:
    kc, vc = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
    kc0, vc0 = kc.clone(), vc.clone()
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reshape_and_cache.native(key, value, kc, vc, torch.tensor([5, -1, 11]))
    assert torch.equal(kc[1, 1], key[0]) and torch.equal(vc[1, 1], value[0])
    assert torch.equal(kc[2, 3], key[2]) and torch.equal(vc[2, 3], value[2])
    changed = (kc != kc0).any(-1).any(-1).nonzero().tolist()
    assert changed == [[1, 1], [2, 3]]  # slot -1 wrote nothing anywhere
    assert (vc != vc0).any(-1).any(-1).nonzero().tolist() == [[1, 1], [2, 3]]


def test_reshape_and_cache_errors_write_nothing() -> None:
    kc, vc = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
    kc0 = kc.clone()
    key = torch.randn(2, 2, 8)
    with pytest.raises(opmux.OpInputError,
                       match=r"reshape_and_cache.*'slot_mapping' expected -1 \(skip\) or slots "
                             r"in \[0, 12\).*got values in \[0, 12\]"):
        reshape_and_cache.native(key, key, kc, vc, torch.tensor([0, 12]))
    with pytest.raises(opmux.OpInputError, match=r"'slot_mapping' expected dtype int64"):
        reshape_and_cache.native(key, key, kc, vc, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(opmux.OpInputError, match=r"'key' expected the cache's dtype"):
        reshape_and_cache.native(key.half(), key.half(), kc, vc, torch.tensor([0, 1]))
    with pytest.raises(opmux.OpInputError, match=r"'key_cache' expected a tensor whose "
                                                 r"elements do not overlap"):
        reshape_and_cache.native(key, key, kc[:1].expand(3, 4, 2, 8), vc, torch.tensor([0, 1]))
    with pytest.raises(opmux.OpInputError, match=r"'key_cache' expected .* with a positive "
                                                 r"block_size in dim 1"):
        reshape_and_cache.native(key, key, kc[:, :0], vc[:, :0], torch.tensor([-1, -1]))
    with pytest.raises(opmux.OpInputError, match=r"'value' expected device cpu .*got meta"):
        reshape_and_cache.native(key, key.to("meta"), kc, vc, torch.tensor([0, 1]))
    assert torch.equal(kc, kc0)


def _state(seq_lens: list[int], tables: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = len(seq_lens)
    return (torch.full((n,), 99), torch.full((n,), 99),
            torch.tensor(seq_lens, dtype=torch.int32), torch.full((n,), 99),
            tables.to(torch.int32))


def test_advance_step_worked_example_from_design() -> None:
    tokens, pos, lens, slots, tables = _state([6, 8, 6, 6], torch.arange(4).view(4, 1))
    sampled = torch.tensor([[11], [12], [13], [14]])
    advance_step_flashattn(4, 4, 128, tokens, sampled, pos, lens, slots, tables)
    assert tokens.tolist() == [11, 12, 13, 14]
    assert pos.tolist() == [6, 8, 6, 6]
    assert lens.tolist() == [7, 9, 7, 7]
    assert slots.tolist() == [6, 136, 262, 390]


def test_advance_step_padding_rows() -> None:
    tables = torch.tensor([[3, 7], [1, 2], [0, 4]])
    tokens, pos, lens, slots, tables = _state([4, 1, 5], tables)
    advance_step_flashattn.native(3, 2, 4, tokens, torch.tensor([[5], [6]]), pos, lens, slots,
                                  tables)
    assert tokens.tolist() == [5, 6, 0]
    assert pos.tolist() == [4, 1, 0]
    assert lens.tolist() == [5, 2, 5]  # padding row's seq_len untouched
    assert slots.tolist() == [7 * 4 + 0, 1 * 4 + 1, -1]


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda s: s.__setitem__(2, s[2].to(torch.int64)), r"'seq_lens' expected dtype int32"),
    (lambda s: s.__setitem__(0, torch.zeros(1, dtype=torch.int64).expand(4)),
     r"'input_tokens' expected a tensor whose elements do not overlap"),
    (lambda s: s.__setitem__(4, torch.tensor([[0], [1], [-1], [3]], dtype=torch.int32)),
     r"'block_tables' expected non-negative block ids at the next position"),
    (lambda s: s.__setitem__(3, torch.zeros(3, dtype=torch.int64)),
     r"'slot_mapping' expected shape \[4\] \(num_seqs\)"),
    (lambda s: s.__setitem__(4, torch.zeros(3, 1, dtype=torch.int32)),
     r"'block_tables' expected shape \[4, max_blocks\]"),
    (lambda s: s.__setitem__(2, torch.tensor([6, 8, 128, 6], dtype=torch.int32)),
     r"'seq_lens' expected values in \[0, 128\)"),
])
def test_advance_step_errors_write_nothing(mutate, match) -> None:  # type: ignore[no-untyped-def]
    state = list(_state([6, 8, 6, 6], torch.arange(4).view(4, 1)))
    mutate(state)
    before = [t.clone() for t in state]
    with pytest.raises(opmux.OpInputError, match=r"advance_step_flashattn.*" + match):
        advance_step_flashattn.native(4, 4, 128, state[0], torch.ones(4, 1, dtype=torch.int64),
                                      *state[1:])
    for t, b in zip(state, before, strict=True):
        assert torch.equal(t, b)


def test_advance_step_writes_through_strided_state() -> None:
    # the state vectors may be strided views (columns of one [num_seqs, 4] buffer)
    tokens, pos, lens, slots, tables = _state([6, 8, 6, 6], torch.arange(4).view(4, 1))
    sampled = torch.tensor([[11], [12], [13]])
    buf = torch.full((4, 4), 99, dtype=torch.int64)
    lens_buf = torch.zeros(4, 2, dtype=torch.int32)
    lens_buf[:, 1] = lens
    s_tokens, s_pos, s_slots, s_lens = buf[:, 0], buf[:, 1], buf[:, 2], lens_buf[:, 1]
    advance_step_flashattn.native(4, 3, 128, s_tokens, sampled, s_pos, s_lens, s_slots, tables)
    advance_step_flashattn.native(4, 3, 128, tokens, sampled, pos, lens, slots, tables)
    assert torch.equal(s_tokens, tokens) and torch.equal(s_pos, pos)
    assert torch.equal(s_lens, lens) and torch.equal(s_slots, slots)
    assert buf[:, 3].eq(99).all() and lens_buf[:, 0].eq(0).all()  # neighbours untouched
