"""What opmux does not express runs transformers' own code: the results equal plain
transformers and the opmux attention path is not taken (core lane)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _transformers_models import PROMPTS, build

pytest.importorskip("transformers")

from opmux.integrations import transformers as otf
from opmux.integrations.transformers import _attention


@pytest.fixture
def opmux_attention_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls that take opmux's (non-paged) attention paths."""
    calls: list[int] = []
    for name in ("_dense_attention", "_masked_attention"):
        original = getattr(_attention, name)
        monkeypatch.setattr(_attention, name,
                            lambda *args, _f=original: calls.append(1) or _f(*args))
    return calls


def _enabled(arch: str) -> Iterator[Any]:
    model = build(arch)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    yield model
    otf.disable(model)


@pytest.fixture
def llama() -> Iterator[Any]:
    yield from _enabled("llama")


@pytest.fixture
def gemma2() -> Iterator[Any]:
    yield from _enabled("gemma2")


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    short, long = PROMPTS
    pad = len(long) - len(short)
    ids = torch.tensor([[0] * pad + short, long])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_autograd_runs_transformers_code(arch: str, opmux_attention_calls: list[int]) -> None:
    for model in _enabled(arch):
        ids = torch.tensor(PROMPTS[1:])
        want = model(ids).logits
        otf.enable(model)
        got = model(ids).logits  # grad enabled: the ops have no backward
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.sum().backward()
        assert all(p.grad is not None for p in model.model.layers[0].parameters())
        assert opmux_attention_calls == []


def test_attention_weights_requested_fall_back(gemma2: Any,
                                               opmux_attention_calls: list[int]) -> None:
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        want = gemma2(ids, output_attentions=True)
        otf.enable(gemma2)
        got = gemma2(ids, output_attentions=True)
    assert opmux_attention_calls == []
    assert len(got.attentions) == len(want.attentions) == 2
    for a, b in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(a, b)


def test_static_cache_runs_opmux_attention(llama: Any, opmux_attention_calls: list[int]) -> None:
    ids = torch.tensor(PROMPTS[:1])
    want = llama.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    otf.enable(llama)
    got = llama.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)
    # prefill: sdpa's upper-left causal (no mask); decode: the mask keeps out the empty slots
    assert len(opmux_attention_calls) == 2 * 5


def test_norm_with_another_weight_dtype_runs_transformers_code(llama: Any) -> None:
    norm = llama.model.layers[0].input_layernorm
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = norm(x)  # float32 weight times a bf16 value: transformers returns float32
    otf.enable(llama)
    assert type(norm).__name__ == "OpmuxLlamaRMSNorm"
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_model_set_to_opmux_by_hand_runs_opmux_attention(
        opmux_attention_calls: list[int]) -> None:
    """``attn_implementation="opmux"`` on a model that is not enabled: sdpa's masks, opmux's
    attention (equal to sdpa within float32 rounding)."""
    model = build("llama")
    ids = torch.tensor(PROMPTS[1:])
    otf.enable(build("llama"))  # registers "opmux"; this other model is not enabled
    with torch.no_grad():
        want = model(ids).logits
        model.set_attn_implementation(otf.ATTN_IMPLEMENTATION)
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(opmux_attention_calls) == 2


def test_paged_variant_outside_continuous_batching_is_an_error(llama: Any) -> None:
    otf.enable(llama)
    llama.config._attn_implementation = otf.PAGED_ATTN_IMPLEMENTATION
    try:
        with pytest.raises(RuntimeError, match=r"continuous batching \(generate_batch\) only"):
            with torch.no_grad():
                llama(torch.tensor(PROMPTS[:1]))
    finally:
        llama.config._attn_implementation = "sdpa"


def test_cached_continuation_with_several_new_tokens(llama: Any,
                                                     opmux_attention_calls: list[int]) -> None:
    """A multi-token step on a filled cache (kv longer than q, where sdpa's own causal flag
    would align the mask wrongly) runs opmux's rule and matches transformers."""
    from transformers import DynamicCache

    ids = torch.tensor(PROMPTS[1:])
    results = []
    for enabled in (False, True):
        if enabled:
            otf.enable(llama)
        cache = DynamicCache(config=llama.config)
        with torch.no_grad():
            llama(ids[:, :9], past_key_values=cache, use_cache=True)
            results.append(llama(ids[:, 9:], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    assert len(opmux_attention_calls) == 4  # 2 layers x 2 forwards


def _neox(rows: int, tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as transformers' rotary embeddings build them: cat((freqs, freqs))."""
    freqs = torch.rand(rows, tokens, dim // 2) * 10
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize(("rows", "batch"), [(1, 1), (1, 3), (3, 3)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_op_inputs_rotate_like_transformers(rows: int, batch: int, tokens: int) -> None:
    """The cos_sin_cache and positions built from the model's cos/sin (one row per step or
    per sequence) rotate query and key exactly as transformers' apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from opmux.integrations.transformers import _layers

    heads, dim = 4, 8
    cos, sin = _neox(rows, tokens, dim)
    query = torch.randn(batch, tokens, heads, dim)
    key = torch.randn(batch, tokens, 2, dim)
    rotated = _layers._rotate(query, key, cos, sin)
    assert rotated is not None
    want_q, want_k = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    torch.testing.assert_close(rotated[0], want_q.transpose(1, 2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotated[1], want_k.transpose(1, 2), rtol=1e-6, atol=1e-6)
    # every layer of the step reuses the first layer's inputs
    first = _layers._rope_inputs(cos, sin, batch)
    again = _layers._rope_inputs(cos, sin, batch)
    assert first[0] is again[0] and first[1] is again[1]


def test_rotary_inputs_that_are_not_neox_rows_take_transformers_code() -> None:
    """cos/sin whose halves differ (in cos or only in sin) are no cos_sin_cache rows: the
    layer then runs transformers' own rotation."""
    from opmux.integrations.transformers import _layers

    query, key = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8)
    cos, sin = _neox(1, 3, 8)
    for bad_cos, bad_sin in ((torch.rand(1, 3, 8), sin), (cos, torch.rand(1, 3, 8))):
        assert _layers._rope_inputs(bad_cos, bad_sin, 1) == (None, None)
        assert _layers._rotate(query, key, bad_cos, bad_sin) is None
    assert _layers._rope_inputs(cos[..., :7], sin[..., :7], 1) == (None, None)  # odd D
    assert _layers._rope_inputs(cos, sin, 2)[0] is not None  # one row serves a batch
    assert _layers._rope_inputs(cos.expand(3, -1, -1), sin.expand(3, -1, -1), 2) == (None, None)


def test_linear_layers_run_dense_linear(monkeypatch: pytest.MonkeyPatch, llama: Any) -> None:
    """Every plain nn.Linear runs opmux.layers.dense_linear after enable (oneDNN for large
    float32 weights at a few rows with several threads); a subclass of nn.Linear (quantized,
    LoRA) keeps its class; disable restores nn.Linear."""
    from torch import nn

    from opmux.integrations.transformers import _layers

    class Custom(nn.Linear):
        pass

    llama.lm_head.__class__ = Custom
    otf.enable(llama)
    linears = [m for m in llama.modules() if isinstance(m, nn.Linear)]
    assert {type(m) for m in linears} == {_layers.OpmuxLinear, Custom}
    calls: list[int] = []
    real = _layers.dense_linear
    monkeypatch.setattr(_layers, "dense_linear", lambda *a: calls.append(1) or real(*a))
    proj = llama.model.layers[0].self_attn.q_proj
    x = torch.randn(3, proj.in_features)
    with torch.no_grad():
        torch.testing.assert_close(proj(x), nn.functional.linear(x, proj.weight, proj.bias),
                                   rtol=0, atol=0)  # a small weight: F.linear itself
        llama(torch.tensor(PROMPTS[:1]))
    # q, k, v, o per layer and gate + up per layer (down_proj through its module): 2 layers
    assert len(calls) == 1 + 2 * (4 + 3)
    otf.disable(llama)
    assert {type(m) for m in llama.modules() if isinstance(m, nn.Linear)} == {nn.Linear, Custom}
