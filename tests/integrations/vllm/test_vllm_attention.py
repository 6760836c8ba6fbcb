"""The opmux CPU attention backend for vLLM: cache layout, KV write, attention, refusals
(vllm lane)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm

H, HKV, D, BS, BLOCKS = 8, 2, 32, 32, 12


@pytest.fixture(scope="module")
def attn() -> Iterator[Any]:
    from vllm.v1.attention.backends import cpu_attn

    from opmux.integrations.vllm import attention

    # the impl only reads the model dtype from the engine's config (no model needed here)
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_attn, "get_current_vllm_config", lambda: config)
        yield attention


def _reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
               q_lens: list[int], scale: float, window: int | None,
               cap: float | None) -> torch.Tensor:
    out, row = [], 0
    for k, v, q_len in zip(keys, values, q_lens, strict=True):
        kv_len = k.shape[0]
        qs = q[row:row + q_len]
        row += q_len
        kr = k.repeat_interleave(H // HKV, dim=1)
        vr = v.repeat_interleave(H // HKV, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, kr) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        t = torch.arange(kv_len)[None, :]
        visible = t <= pos
        if window:
            visible &= t > pos - window
        s = s.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vr))
    return torch.cat(out)


def _prefer(attn: Any, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make opmux.kv_cache_format answer ``name`` inside the backend."""
    import opmux

    fmt = opmux.get_kv_cache_format(name)
    monkeypatch.setattr(attn, "kv_cache_format", lambda *args, **kwargs: fmt)


@pytest.mark.parametrize(("window", "cap", "pad", "fmt"),
                         [(None, None, 2, "canonical"), (20, None, 2, "canonical"),
                          (None, 30.0, 2, "canonical"), (None, None, 0, "canonical"),
                          (None, None, 2, "hnd"), (20, 30.0, 0, "hnd")])
def test_write_then_attend(attn: Any, window: int | None, cap: float | None, pad: int,
                           fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # pad: rows past the step's tokens in vLLM's buffers (left alone); 0: none
    # fmt: the KV-cache format opmux.kv_cache_format answers (the backend lays it out)
    from vllm.v1.attention.backend import AttentionType

    import opmux

    _prefer(attn, monkeypatch, fmt)

    impl = attn.OpmuxCPUAttentionImpl(H, D, 1 / math.sqrt(D), HKV, None, window, "auto",
                                      cap, AttentionType.DECODER)
    # vLLM's per-layer cache: [blocks, Hkv, block_size, 2 * D]
    kv_cache = torch.zeros(BLOCKS, HKV, BS, 2 * D)
    kv_lens, q_lens = [70, 5, 33], [70, 1, 3]  # a prefill, a decode, a chunked prefill
    tables = torch.tensor([[3, 7, 1], [0, 5, 5], [11, 2, 5]], dtype=torch.int32)
    keys = [torch.randn(n, HKV, D) for n in kv_lens]
    values = [torch.randn(n, HKV, D) for n in kv_lens]
    for i, n in enumerate(kv_lens):  # write each sequence's tokens through the backend
        pos = torch.arange(n)
        slots = tables[i, pos // BS].long() * BS + pos % BS
        padded = [torch.cat([t, torch.full((pad, HKV, D), 9.0)]) for t in (keys[i], values[i])]
        impl.do_kv_cache_update(None, *padded, kv_cache, slots)
    assert attn.vllm_kv_cache_format(kv_cache) == fmt
    key_cache, value_cache = opmux.get_kv_cache_format(fmt).to_canonical(
        *attn.split_kv_cache(kv_cache, fmt))
    assert key_cache.shape == (BLOCKS, BS, HKV, D)
    torch.testing.assert_close(key_cache[3, 4], keys[0][4])
    torch.testing.assert_close(value_cache[2, 0], values[2][32])
    q = torch.randn(sum(q_lens) + pad, H, D)
    meta = attn.OpmuxCPUAttentionMetadata(
        num_actual_tokens=sum(q_lens), max_query_len=70,
        query_start_loc=torch.tensor([0, 70, 71, 74], dtype=torch.int32), max_seq_len=70,
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32), block_table=tables,
        slot_mapping=torch.zeros(0, dtype=torch.long))
    output = torch.full((q.shape[0], H, D), 7.0)
    impl.forward(None, q, None, None, kv_cache, meta, output)
    want = _reference(q, keys, values, q_lens, 1 / math.sqrt(D), window, cap)
    torch.testing.assert_close(output[:74], want, rtol=1e-4, atol=1e-4)
    assert output.shape[0] == 74 + pad and (output[74:] == 7.0).all()  # padding left alone
    assert (kv_cache != 9.0).all()  # no padding row was written into the cache


@pytest.mark.parametrize("fmt", ["canonical", "hnd"])
def test_zeroing_a_block_clears_only_that_block(attn: Any, fmt: str) -> None:
    # vLLM zeroes fresh blocks as kv[block_id].zero_(): opmux's layout must keep a block's
    # keys and values inside that block's memory
    kv_cache = torch.randn(BLOCKS, HKV, BS, 2 * D)
    key_cache, value_cache = attn.split_kv_cache(kv_cache, fmt)
    want = (BLOCKS, BS, HKV, D) if fmt == "canonical" else (BLOCKS, HKV, BS, D)
    assert key_cache.shape == value_cache.shape == want
    kv_cache[4].zero_()
    assert (key_cache[4] == 0).all() and (value_cache[4] == 0).all()
    assert (key_cache[3] != 0).any() and (value_cache[5] != 0).any()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"alibi_slopes": [0.5] * H}, "ALiBi"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
    ({"attn_type": "encoder_only"}, "attention type 'encoder_only'"),
    ({"sinks": torch.zeros(H)}, "attention sinks"),
])
def test_refused_at_construction(attn: Any, kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"num_heads": H, "head_size": D, "scale": 0.1, "num_kv_heads": HKV,
                            "alibi_slopes": None, "sliding_window": None,
                            "kv_cache_dtype": "auto", **kwargs}
    with pytest.raises(attn.OpmuxAttentionUnsupported, match=match) as info:
        attn.OpmuxCPUAttentionImpl(**args)
    assert "OPMUX_VLLM_LAYERS" in str(info.value)


def test_non_dense_cache_refused(attn: Any) -> None:
    strided = torch.zeros(BLOCKS, BS, HKV, 2 * D).transpose(1, 2)  # [B, Hkv, bs, 2D], not dense
    with pytest.raises(attn.OpmuxAttentionUnsupported, match="blocks are not dense"):
        attn.split_kv_cache(strided)


def test_a_format_vllm_cannot_hold_falls_back_to_canonical(
        attn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from opmux.plugins.cpu.amx_format import AmxBf16Format

    class Packed(AmxBf16Format):  # tile-packed: not a view of a dense block in either order
        name = "test_packed"

    monkeypatch.setattr(attn, "kv_cache_format", lambda *args, **kwargs: Packed())
    assert attn.vllm_kv_cache_format(torch.zeros(BLOCKS, HKV, BS, 2 * D)) == "canonical"
    with pytest.raises(attn.OpmuxAttentionUnsupported, match="'test_packed' inside vLLM"):
        attn.split_kv_cache(torch.zeros(BLOCKS, HKV, BS, 2 * D), "test_packed")
