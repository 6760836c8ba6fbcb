"""Padded batches run on opmux's attention op (the mask transformers builds becomes block
tables), equal to plain transformers at every real token; the gated MLP runs its op for
each activation the architectures allow (core lane)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _transformers_models import ARCHS, PROMPTS, build

pytest.importorskip("transformers")

from opmux.integrations import transformers as otf

Calls = list[dict[str, Any]]


@pytest.fixture
def attention_calls(op_calls: Callable[[str], Calls]) -> Calls:
    """The test's calls of opmux's ``paged_attention``."""
    return op_calls("paged_attention")


def _per_row(call: dict[str, Any]) -> bool:
    """Whether a ``paged_attention`` call reads a mask: every sequence is one query row
    with its own block table (the keys that row sees)."""
    starts = call["query_start_loc"]
    return torch.equal(starts, torch.arange(len(starts), dtype=starts.dtype))


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
                                             attention_calls: Calls) -> None:
    model = build(arch)
    ids, mask = _padded(side)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        otf.enable(model)
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)
    assert len(attention_calls) == model.config.num_hidden_layers
    assert all(_per_row(call) for call in attention_calls)
    # one padded row alone equals the unpadded prompt
    with torch.no_grad():
        alone = model(torch.tensor(PROMPTS[:1])).logits[0]
    torch.testing.assert_close(got[0][real[0]], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_generate_equals_plain(arch: str, attention_calls: Calls) -> None:
    model = build(arch)
    ids, mask = _padded("left")
    kwargs: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=6, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
    want = model.generate(ids, **kwargs)
    otf.enable(model)
    got = model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    assert len(attention_calls) == 6 * model.config.num_hidden_layers  # prefill and each step
    assert all(_per_row(call) for call in attention_calls)


#: transformers' activation -> (the op of the gated MLP, its ``approximate``), or None: the
#: tanh GELU written out (gelu_new) has no gated op and runs transformers' MLP
GATED_OPS: dict[str, tuple[str, str | None] | None] = {
    "silu": ("silu_and_mul", None), "gelu": ("gelu_and_mul", "none"),
    "gelu_pytorch_tanh": ("gelu_and_mul", "tanh"), "gelu_new": None,
}


@pytest.mark.parametrize("act", list(GATED_OPS))
def test_gated_mlp_activations(op_calls: Callable[[str], Calls], act: str) -> None:
    """SiLU, exact GELU and the tanh GELUs run silu_and_mul / gelu_and_mul."""
    import transformers as tr

    model = build("llama")
    for layer in model.model.layers:
        layer.mlp.act_fn = tr.activations.ACT2FN[act]
    ids = torch.tensor(PROMPTS[1:])
    calls = {name: op_calls(name) for name in ("silu_and_mul", "gelu_and_mul")}
    with torch.no_grad():
        want = model(ids).logits
        otf.enable(model)
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    expected = GATED_OPS[act]
    ran = {name: [c.get("approximate") for c in seen] for name, seen in calls.items()}
    layers = model.config.num_hidden_layers
    assert ran == {name: [expected[1]] * layers if expected and name == expected[0] else []
                   for name in calls}
