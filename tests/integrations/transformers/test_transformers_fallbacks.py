"""What opmux does not express runs transformers' own code: the results equal plain
transformers and the opmux attention path is not taken (core lane)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _transformers_models import PROMPTS, build

pytest.importorskip("transformers")

from opmux.integrations import transformers as otf

Calls = list[dict[str, Any]]


@pytest.fixture
def opmux_attention_calls(op_calls: Callable[[str], Calls]) -> Calls:
    """The test's calls of ``paged_attention``: one per attention call that takes opmux's
    attention (outside continuous batching)."""
    return op_calls("paged_attention")


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
def test_autograd_runs_transformers_code(arch: str, opmux_attention_calls: Calls) -> None:
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
                                               opmux_attention_calls: Calls) -> None:
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        want = gemma2(ids, output_attentions=True)
        otf.enable(gemma2)
        got = gemma2(ids, output_attentions=True)
    assert opmux_attention_calls == []
    assert len(got.attentions) == len(want.attentions) == 2
    for a, b in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(a, b)


def test_static_cache_runs_opmux_attention(llama: Any, opmux_attention_calls: Calls) -> None:
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
        opmux_attention_calls: Calls) -> None:
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
                                                     opmux_attention_calls: Calls) -> None:
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


def _llama(head_dim: int = 8) -> Any:
    """A random two-layer Llama (4 query heads, 2 key/value heads) of ``head_dim``; an odd
    one (which transformers' config refuses) is set on the first layer's attention only."""
    import transformers as tr
    from torch import nn

    torch.manual_seed(0)
    config = tr.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=head_dim + head_dim % 2)
    model = tr.LlamaForCausalLM(config).eval()
    if head_dim % 2:
        attn = model.model.layers[0].self_attn
        attn.head_dim, attn.scaling = head_dim, head_dim ** -0.5
        for name, heads in (("q_proj", 4), ("k_proj", 2), ("v_proj", 2)):
            setattr(attn, name, nn.Linear(32, heads * head_dim, bias=False))
        attn.o_proj = nn.Linear(4 * head_dim, 32, bias=False)
    return model


def _attend(model: Any, layer: int, hidden: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
    """The output of layer ``layer``'s attention module given the position embeddings."""
    with torch.no_grad():
        out, _ = model.model.layers[layer].self_attn(hidden, position_embeddings=(cos, sin),
                                                     attention_mask=None)
    return out  # type: ignore[no-any-return]


@pytest.mark.parametrize(("rows", "batch"), [(1, 1), (1, 3), (3, 3)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_op_rotates_like_transformers(op_calls: Callable[[str], Calls], rows: int,
                                             batch: int, tokens: int) -> None:
    """The attention rotates query and key with rotary_embedding, from a cos_sin_cache and
    positions built from the model's own cos/sin (one row per step or per sequence), as
    transformers' apply_rotary_pos_emb does; every layer of the step reuses the first
    layer's inputs."""
    model = _llama()
    cos, sin = _neox(rows, tokens, 8)
    hidden = torch.randn(batch, tokens, model.config.hidden_size)
    want = [_attend(model, layer, hidden, cos, sin) for layer in (0, 1)]
    otf.enable(model)
    calls = op_calls("rotary_embedding")
    for layer in (0, 1):
        torch.testing.assert_close(_attend(model, layer, hidden, cos, sin), want[layer],
                                   rtol=1e-5, atol=1e-5)
    first, again = calls
    assert first["is_neox"] and first["cos_sin_cache"].shape == (rows * tokens, 8)
    assert again["cos_sin_cache"] is first["cos_sin_cache"]
    assert again["positions"] is first["positions"]


def test_rotary_inputs_that_are_not_neox_rows_take_transformers_code(
        op_calls: Callable[[str], Calls]) -> None:
    """cos/sin whose halves differ (in cos or only in sin) are no cos_sin_cache rows, nor are
    those of an odd head size: the attention then runs transformers' own rotation."""
    calls = op_calls("rotary_embedding")
    cos, sin = _neox(1, 3, 8)
    for head_dim, bad_cos, bad_sin in ((8, torch.rand(1, 3, 8), sin),
                                       (8, cos, torch.rand(1, 3, 8)),
                                       (7, cos[..., :7], sin[..., :7])):
        model = _llama(head_dim)
        hidden = torch.randn(1, 3, model.config.hidden_size)
        want = _attend(model, 0, hidden, bad_cos, bad_sin)
        otf.enable(model)
        torch.testing.assert_close(_attend(model, 0, hidden, bad_cos, bad_sin), want,
                                   rtol=1e-5, atol=1e-5)
    assert calls == []
    # rows of another batch size than the hidden states': an error as in transformers
    model = _llama()
    hidden = torch.randn(2, 3, model.config.hidden_size)
    wide_cos, wide_sin = cos.expand(3, -1, -1), sin.expand(3, -1, -1)
    with pytest.raises(RuntimeError) as plain:
        _attend(model, 0, hidden, wide_cos, wide_sin)
    otf.enable(model)
    with pytest.raises(RuntimeError) as enabled:
        _attend(model, 0, hidden, wide_cos, wide_sin)
    assert str(enabled.value) == str(plain.value)


def test_linear_layers_run_dense_linear(llama: Any) -> None:
    """Every plain nn.Linear becomes an OpmuxLinear (opmux.layers.dense_linear) after enable;
    a subclass of nn.Linear (quantized, LoRA) keeps its class; disable restores nn.Linear."""
    from torch import nn

    class Custom(nn.Linear):
        pass

    llama.lm_head.__class__ = Custom
    otf.enable(llama)
    linears = [m for m in llama.modules() if isinstance(m, nn.Linear)]
    assert {type(m).__name__ for m in linears} == {"OpmuxLinear", "Custom"}
    proj = llama.model.layers[0].self_attn.q_proj
    x = torch.randn(3, proj.in_features)
    with torch.no_grad():
        torch.testing.assert_close(proj(x), nn.functional.linear(x, proj.weight, proj.bias),
                                   rtol=0, atol=0)  # a small weight: F.linear itself
    otf.disable(llama)
    assert {type(m) for m in llama.modules() if isinstance(m, nn.Linear)} == {nn.Linear, Custom}


def test_large_linears_run_onednn(two_threads: None,
                                  onednn_calls: Callable[[Callable[[], Any]], tuple[Any, int]]
                                  ) -> None:
    """With opmux.layers.dense_linear behind every projection, float32 weights of 2**20
    elements at a few rows run oneDNN's matmul: q, k, v, o, and the MLP's gate, up (one
    concatenated activation input) and down, in each layer."""
    import transformers as tr

    torch.manual_seed(0)
    config = tr.LlamaConfig(vocab_size=128, hidden_size=1024, intermediate_size=1024,
                            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                            head_dim=128)
    model = tr.LlamaForCausalLM(config).eval()
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        want, plain_calls = onednn_calls(lambda: model(ids).logits)
        otf.enable(model)
        got, calls = onednn_calls(lambda: model(ids).logits)
    assert plain_calls == 0
    assert calls == 2 * 7  # (lm_head's weight is small: F.linear)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
