"""MMEncoderAttention and MultiHeadLatentAttentionWrapper against references written here from
vLLM 0.32's semantics (same parameters), enabled (platform path -> catalog ops -> ``cpp``) and
disabled (``forward_native``); decode continuing a prefill; a tiny MLA stack compiled with
``fullgraph=True``."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import opmux
from opmux.core.forward_context import forward_context
from opmux.layers import (
    MLAAttentionMetadata,
    MLAModules,
    MMEncoderAttention,
    MultiHeadLatentAttentionWrapper,
    ReplicatedLinear,
    RotaryEmbedding,
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


pytestmark = pytest.mark.usefixtures("plugins_no_grad")


def _modes() -> list[str]:
    return ["all", "none"]


# -------------------------------------------------------------------------- encoder attention
def encoder_reference(layer: MMEncoderAttention, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cu: list[int] | None) -> torch.Tensor:
    """Softmax attention per batch row, per sequence chunk, per head (float64)."""
    bsz, q_len = q.shape[:2]
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    qv = q.double().reshape(bsz, q_len, h, d)
    kv = k.double().reshape(bsz, k.shape[1], hkv, d)
    vv = v.double().reshape(bsz, v.shape[1], hkv, d)
    out = torch.zeros(bsz, q_len, h, d, dtype=torch.float64)
    bounds = list(itertools.pairwise(cu)) if cu is not None else [(0, q_len)]
    for b in range(bsz):
        for s0, s1 in bounds:
            k_hi = s1 if cu is not None else k.shape[1]
            for head in range(h):
                g = head // (h // hkv)
                scores = qv[b, s0:s1, head] @ kv[b, s0:k_hi, g].T * layer.scale
                out[b, s0:s1, head] = torch.softmax(scores, -1) @ vv[b, s0:k_hi, g]
    return out.reshape(q.shape)


@pytest.mark.parametrize("mode", _modes())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("bsz", "cu", "four_d", "kv_heads"), [
    (1, [0, 5, 12, 20], False, 4), (1, [0, 20], True, 2), (2, None, False, 1),
    (2, [0, 7, 20], False, 2)])
def test_mm_encoder_attention(mode: str, dtype: torch.dtype, bsz: int, cu: list[int] | None,
                              four_d: bool, kv_heads: int) -> None:
    opmux.set_custom_ops(mode)
    layer = MMEncoderAttention(num_heads=4, head_size=16, num_kv_heads=kv_heads)
    assert MMEncoderAttention.enabled() is (mode == "all")
    g = torch.Generator().manual_seed(3)
    shape = (bsz, 20, 4, 16) if four_d else (bsz, 20, 64)
    kv_shape = (bsz, 20, kv_heads, 16) if four_d else (bsz, 20, kv_heads * 16)
    q = torch.randn(shape, generator=g).to(dtype)
    k = torch.randn(kv_shape, generator=g).to(dtype)
    v = torch.randn(kv_shape, generator=g).to(dtype)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    got = layer(q, k, v, cu_t, None if cu is None else torch.tensor(max(
        b - a for a, b in itertools.pairwise(cu))))
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), encoder_reference(layer, q, k, v, cu),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_mm_encoder_attention_cross_length_and_errors() -> None:
    layer = MMEncoderAttention(num_heads=2, head_size=8)
    q, kv = torch.randn(1, 3, 16), torch.randn(1, 5, 16)
    torch.testing.assert_close(layer(q, kv, kv).double(),
                               encoder_reference(layer, q, kv, kv, None), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"num_heads \(3\) is not divisible by num_kv_heads"):
        MMEncoderAttention(num_heads=3, head_size=8, num_kv_heads=2)


# ------------------------------------------------------------------------------------- MLA
HIDDEN, HEADS, NOPE, ROPE, V_DIM, Q_LORA, KV_LORA, BS = 48, 4, 16, 8, 16, 24, 32, 4


def _build_mla(q_lora: int | None, seed: int, dtype: torch.dtype = torch.float32
               ) -> MultiHeadLatentAttentionWrapper:
    torch.manual_seed(seed)
    qk = NOPE + ROPE

    def lin(i: int, o: int) -> ReplicatedLinear:
        layer = ReplicatedLinear(i, o, bias=False)
        nn.init.normal_(layer.weight, std=i ** -0.5)
        return layer

    modules = MLAModules(
        kv_a_layernorm=nn.RMSNorm(KV_LORA, eps=1e-6),
        kv_b_proj=lin(KV_LORA, HEADS * (NOPE + V_DIM)),
        rotary_emb=RotaryEmbedding(ROPE, ROPE, 64, 10000.0, False, torch.float32),
        o_proj=lin(HEADS * V_DIM, HIDDEN),
        fused_qkv_a_proj=lin(HIDDEN, Q_LORA + KV_LORA + ROPE) if q_lora else None,
        kv_a_proj_with_mqa=None if q_lora else lin(HIDDEN, KV_LORA + ROPE),
        q_a_layernorm=nn.RMSNorm(Q_LORA, eps=1e-6) if q_lora else None,
        q_b_proj=lin(Q_LORA, HEADS * qk) if q_lora else None,
        q_proj=None if q_lora else lin(HIDDEN, HEADS * qk),
    )
    layer = MultiHeadLatentAttentionWrapper(
        HIDDEN, HEADS, qk ** -0.5, NOPE, ROPE, V_DIM, q_lora, KV_LORA, modules, prefix="mla0")
    return layer.to(dtype)


def mla_reference(layer: MultiHeadLatentAttentionWrapper, positions: torch.Tensor,
                  hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Whole sequences, no cache: up-projected keys and values, causal softmax per head."""
    if layer.q_lora_rank is not None:
        q_c, kv = layer.fused_qkv_a_proj.weight.float().matmul(  # type: ignore[union-attr]
            hidden.float().T).T.split([Q_LORA, KV_LORA + ROPE], -1)
        q_c = layer.q_a_layernorm.float()(q_c)  # type: ignore[union-attr]
        q = q_c @ layer.q_b_proj.weight.float().T  # type: ignore[union-attr]
    else:
        kv = hidden.float() @ layer.kv_a_proj_with_mqa.weight.float().T  # type: ignore[union-attr]
        q = hidden.float() @ layer.q_proj.weight.float().T  # type: ignore[union-attr]
    kv_c, k_pe = kv.split([KV_LORA, ROPE], -1)
    kv_c = layer.kv_a_layernorm.float()(kv_c)
    q = q.view(-1, HEADS, NOPE + ROPE)
    rope = RotaryEmbedding(ROPE, ROPE, 64, 10000.0, False, torch.float32)
    q_pe, k_pe = rope.forward_native(positions, q[..., NOPE:].contiguous(),
                                     k_pe.unsqueeze(1).contiguous())
    q = torch.cat([q[..., :NOPE], q_pe], -1)
    w = layer.kv_b_proj.weight.float().view(HEADS, NOPE + V_DIM, KV_LORA)
    out = []
    start = 0
    for n in lens:
        c = kv_c[start:start + n]
        k = torch.cat([torch.einsum("hdl,tl->htd", w[:, :NOPE], c),
                       k_pe[start:start + n].reshape(1, n, ROPE).expand(HEADS, -1, -1)], -1)
        v = torch.einsum("hdl,tl->htd", w[:, NOPE:], c)
        s = q[start:start + n].transpose(0, 1) @ k.transpose(1, 2) * layer.scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append((torch.softmax(s, -1) @ v).transpose(0, 1).reshape(n, HEADS * V_DIM))
        start += n
    return torch.cat(out) @ layer.o_proj.weight.float().T


def _metadata(starts: list[int], new: list[int], max_blocks: int = 4) -> MLAAttentionMetadata:
    tables = torch.arange(len(new) * max_blocks, dtype=torch.int32).view(len(new), max_blocks)
    slots = [int(tables[i, p // BS]) * BS + p % BS
             for i, (s, n) in enumerate(zip(starts, new, strict=True)) for p in range(s, s + n)]
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    return MLAAttentionMetadata(torch.tensor(slots), tables,
                                torch.tensor([s + n for s, n in zip(starts, new, strict=True)],
                                             dtype=torch.int32),
                                torch.tensor(qsl, dtype=torch.int32))


@pytest.mark.parametrize("mode", _modes())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_lora", [Q_LORA, None], ids=["q_lora", "no_q_lora"])
def test_mla_prefill_then_decode(mode: str, dtype: torch.dtype, q_lora: int | None) -> None:
    opmux.set_custom_ops(mode)
    layer = _build_mla(q_lora, seed=1, dtype=dtype)
    lens, steps = [5, 3], 2
    full = [n + steps for n in lens]
    g = torch.Generator().manual_seed(5)
    hidden = [torch.randn(n, HIDDEN, generator=g).to(dtype) for n in full]
    pos = [torch.arange(n) for n in full]
    layer.kv_cache = torch.zeros(8, BS, KV_LORA + ROPE, dtype=dtype)
    pre = layer(torch.cat([p[:n] for p, n in zip(pos, lens, strict=True)]),
                torch.cat([h[:n] for h, n in zip(hidden, lens, strict=True)]),
                attn_metadata=_metadata([0, 0], lens))
    dec = []
    for step in range(steps):
        at = [n + step for n in lens]
        with forward_context(metadata={"mla0": _metadata(at, [1, 1])}):   # from the context
            dec.append(layer(torch.tensor(at), torch.stack([h[a] for h, a in
                                                            zip(hidden, at, strict=True)])))
    assert pre.dtype == dtype and pre.shape == (sum(lens), HIDDEN)
    got = torch.cat([torch.cat([pre.split(lens)[i], torch.stack([d[i] for d in dec])])
                     for i in range(2)])
    want = mla_reference(layer, torch.cat(pos), torch.cat(hidden), full)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)


def test_mla_errors() -> None:
    layer = _build_mla(None, seed=2)
    x, p = torch.randn(2, HIDDEN), torch.arange(2)
    with pytest.raises(ValueError, match="kv_cache is not bound"):
        layer(p, x, attn_metadata=_metadata([0], [2]))
    layer.kv_cache = torch.zeros(4, BS, KV_LORA + ROPE)
    with pytest.raises(ValueError, match="no MLAAttentionMetadata given"):
        layer(p, x)
    modules = MLAModules(nn.Identity(), nn.Identity(), None, nn.Identity(), None, None, None,
                         None, None, indexer=nn.Identity(), is_sparse=True)
    with pytest.raises(NotImplementedError, match="sparse MLA"):
        MultiHeadLatentAttentionWrapper(8, 2, 1.0, 4, 4, 4, None, 8, modules)


class _TinyMLAStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_build_mla(Q_LORA, seed=i) for i in range(2)])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                md: MLAAttentionMetadata) -> torch.Tensor:
        for layer in self.layers:
            hidden = hidden + layer(positions, hidden, attn_metadata=md)
        return hidden


def test_tiny_mla_stack_compiles_fullgraph() -> None:
    opmux.set_custom_ops("all")
    stack = _TinyMLAStack()

    def fresh() -> tuple[Any, ...]:
        for layer in stack.layers:
            layer.kv_cache = torch.zeros(8, BS, KV_LORA + ROPE)
        g = torch.Generator().manual_seed(9)
        return torch.tensor([0, 1, 2, 0, 1]), torch.randn(5, HIDDEN, generator=g), _metadata(
            [0, 0], [3, 2])

    want = stack(*fresh())
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(stack)(*fresh())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(stack, fullgraph=True, backend="aot_eager")
    got = compiled(*fresh())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert stack.layers[1].kv_cache.abs().sum() > 0   # the compiled graph wrote the cache
    torch._dynamo.reset()


def test_registered_names_and_parameter_names() -> None:
    assert opmux.CustomOp.op_registry["mm_encoder_attn"] is MMEncoderAttention
    assert (opmux.CustomOp.op_registry["multi_head_latent_attention"]
            is MultiHeadLatentAttentionWrapper)
    names = set(_build_mla(Q_LORA, seed=0).state_dict())
    assert names == {"fused_qkv_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                     "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
    assert not list(MMEncoderAttention(2, 8).state_dict())
