"""Padded batches run on opmux's attention op (the mask transformers builds becomes block
tables), equal to plain transformers at every real token; the gated MLP runs its op for
each activation the architectures allow (core lane)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _transformers_models import ARCHS, PROMPTS, build

pytest.importorskip("transformers")

from opmux.integrations import transformers as otf
from opmux.integrations.transformers import _attention, _layers


@pytest.fixture
def masked_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the attention calls that run paged_attention under a mask."""
    calls: list[int] = []
    original = _attention._masked_attention
    monkeypatch.setattr(_attention, "_masked_attention",
                        lambda *args: calls.append(1) or original(*args))
    return calls


def _padded(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    short, long = PROMPTS
    pad = [0] * (len(long) - len(short))
    ids = torch.tensor([pad + short if side == "left" else short + pad, long])
    mask = (torch.arange(len(long)) >= len(pad)) if side == "left" \
        else (torch.arange(len(long)) < len(short))
    return ids, torch.stack((mask, torch.ones_like(mask))).long()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ARCHS)
def test_padded_forward_runs_opmux_attention(arch: str, side: str,
                                             masked_calls: list[int]) -> None:
    model = build(arch)
    ids, mask = _padded(side)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        otf.enable(model)
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)
    assert len(masked_calls) == model.config.num_hidden_layers
    # one padded row alone equals the unpadded prompt
    with torch.no_grad():
        alone = model(torch.tensor(PROMPTS[:1])).logits[0]
    torch.testing.assert_close(got[0][real[0]], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_generate_equals_plain(arch: str, masked_calls: list[int]) -> None:
    model = build(arch)
    ids, mask = _padded("left")
    kwargs: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=6, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
    want = model.generate(ids, **kwargs)
    otf.enable(model)
    got = model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    assert len(masked_calls) == 6 * model.config.num_hidden_layers  # prefill and each step


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_gated_mlp_activations(monkeypatch: pytest.MonkeyPatch, act: str) -> None:
    """SiLU, exact GELU and the tanh GELUs run silu_and_mul / gelu_and_mul."""
    import transformers as tr

    model = build("llama")
    for layer in model.model.layers:
        layer.mlp.act_fn = tr.activations.ACT2FN[act]
    ids = torch.tensor(PROMPTS[1:])
    calls: list[int] = []
    real = _layers._gate_up
    monkeypatch.setattr(_layers, "_gate_up", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        want = model(ids).logits
        otf.enable(model)
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(calls) == (2 if act != "gelu_new" else 0)  # gelu_new: transformers' MLP
