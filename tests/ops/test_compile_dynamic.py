"""Dynamic shapes under ``torch.compile``.

A decoder step that calls every catalog op, compiled with ``fullgraph=True, dynamic=True``,
serves 16 different token / sequence counts with at most 2 compilations: the ops' fake
kernels and checks never specialise a size (no ``int()`` on a symbolic size; size conditions
become deferred runtime asserts). Compilations are counted by the backend itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import opmux
from opmux import ops
from opmux.ops.rotary import make_cos_sin_cache

H, HKV, D, HIDDEN, INTER, EXPERTS, BS, BLOCKS, MAX_BLOCKS = 4, 2, 16, 64, 32, 4, 8, 80, 4


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * shape[-1] ** -0.5

    return {
        "w_norm": torch.rand(HIDDEN, generator=g) + 0.5,
        "w_qkv": w((H + 2 * HKV) * D, HIDDEN),
        "w_o": w(HIDDEN, H * D),
        "w_gate_up": w(2 * INTER, HIDDEN),
        "w_down": w(HIDDEN, INTER),
        "router": w(EXPERTS, HIDDEN),
        "w1": w(EXPERTS, 2 * INTER, HIDDEN),
        "w2": w(EXPERTS, HIDDEN, INTER),
        "cos_sin": make_cos_sin_cache(BLOCKS * BS, D),
    }


def _batch(n: int) -> dict[str, Any]:
    """Decode inputs of ``n`` sequences (one token each), their state after ``n + 3`` steps."""
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(1, MAX_BLOCKS * BS - 1, (n,), generator=g, dtype=torch.int32)
    # distinct blocks per sequence, so every token writes its own slot
    tables = torch.randperm(BLOCKS, generator=g)[: n * MAX_BLOCKS].view(n, MAX_BLOCKS)
    tables = tables.to(torch.int32)
    positions = (lens - 1).long()
    slots = (tables.gather(1, (positions // BS).unsqueeze(1)).squeeze(1).long() * BS
             + positions % BS)
    return {
        "x": torch.randn(n, HIDDEN, generator=g),
        "positions": positions,
        "slots": slots,
        "block_tables": tables,
        "seq_lens": lens,
        "qsl": torch.arange(n + 1, dtype=torch.int32),
        "tokens": torch.zeros(n, dtype=torch.int64),
        "sampled": torch.randint(0, 1000, (n, 1), generator=g),
        "next_pos": torch.zeros(n, dtype=torch.int64),
        "next_lens": lens.clone(),
        "next_slots": torch.zeros(n, dtype=torch.int64),
    }


def decoder_step(x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor,
                 tokens: torch.Tensor, sampled: torch.Tensor, next_pos: torch.Tensor,
                 next_lens: torch.Tensor, next_slots: torch.Tensor,
                 w: dict[str, torch.Tensor]) -> torch.Tensor:
    """One layer of a decoder plus the step bookkeeping, through every catalog op."""
    n = x.shape[0]
    h = ops.rms_norm(x, w["w_norm"], 1e-6)
    q, k, v = (h @ w["w_qkv"].t()).split([H * D, HKV * D, HKV * D], dim=-1)
    q, k = ops.rotary_embedding(positions, q, k, w["cos_sin"], D, True)
    ops.reshape_and_cache(k.reshape(n, HKV, D), v.reshape(n, HKV, D), key_cache, value_cache,
                          slots)
    attn = ops.paged_attention(q.reshape(n, H, D), key_cache, value_cache, block_tables,
                               seq_lens, qsl, D ** -0.5, None, None)
    h2, residual = ops.fused_add_rms_norm(attn.reshape(n, H * D) @ w["w_o"].t(), x,
                                          w["w_norm"], 1e-6)
    gate_up = h2 @ w["w_gate_up"].t()
    mlp = (ops.silu_and_mul(gate_up) + ops.gelu_and_mul(gate_up, "tanh")) @ w["w_down"].t()
    logits = h2 @ w["router"].t()
    weights, ids = ops.topk_softmax(logits, 2, True)
    g_weights, g_ids = ops.grouped_topk(logits, 2, True, 2, 1)
    moe = ops.fused_moe(h2, w["w1"], w["w2"], weights, ids)
    moe = moe + ops.fused_moe(h2, w["w1"], w["w2"], g_weights, g_ids)
    ops.advance_step_flashattn(n, n, BS, tokens, sampled, next_pos, next_lens, next_slots,
                               block_tables)
    return residual + mlp + moe


def _caches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # K and V as two views of one buffer, as engines allocate them
    kv = torch.randn(BLOCKS, 2, BS, HKV, D, generator=g)
    return kv[:, 0], kv[:, 1]


@pytest.mark.slow
def test_decoder_step_compiles_once_for_16_sizes() -> None:
    opmux.load_plugins()
    torch._dynamo.reset()
    compiles = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiles.append(gm)
        return gm.forward

    w = _weights()
    compiled = torch.compile(decoder_step, backend=counting_backend, fullgraph=True,
                             dynamic=True)
    sizes = list(range(2, 18))
    for n in sizes:
        batch = _batch(n)
        eager_kc, eager_vc = _caches()
        comp_kc, comp_vc = _caches()
        eager_state = {k: v.clone() for k, v in batch.items()}
        comp_state = {k: v.clone() for k, v in batch.items()}
        want = decoder_step(**eager_state, key_cache=eager_kc, value_cache=eager_vc, w=w)
        got = compiled(**comp_state, key_cache=comp_kc, value_cache=comp_vc, w=w)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(comp_kc, eager_kc)  # written in place through the views
        for name in ("tokens", "next_pos", "next_lens", "next_slots"):
            assert torch.equal(comp_state[name], eager_state[name]), name
    assert len(sizes) == 16
    assert 1 <= len(compiles) <= 2, f"{len(compiles)} compilations for {len(sizes)} sizes"


@pytest.mark.slow
def test_paged_attention_bad_input_still_raises_when_compiled() -> None:
    # the value checks still fire when the graph runs: native's check, or the kernel's
    # own of the provider chosen (it reads the index values before writing)
    opmux.load_plugins()
    torch._dynamo.reset()

    def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor,
               lens: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
        return ops.paged_attention(q, kc, vc, bt, lens, qsl, 0.25, None, None)

    compiled = torch.compile(attend, backend="eager", fullgraph=True, dynamic=True)
    kc, vc = _caches()
    bt = torch.zeros(3, MAX_BLOCKS, dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    ok = compiled(torch.randn(3, H, D), kc, vc, bt, torch.tensor([1, 2, 3], dtype=torch.int32),
                  qsl)
    assert ok.shape == (3, H, D)
    with pytest.raises(opmux.OpInputError, match=r"'seq_lens' (expected values in \[0, |"
                                                 r"rejected by the kernel: seq_lens\[1\] = -2 "
                                                 r"is outside \[0, )"):
        compiled(torch.randn(3, H, D), kc, vc, bt, torch.tensor([1, -2, 3], dtype=torch.int32),
                 qsl)
