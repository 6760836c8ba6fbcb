"""opmux.integrations.transformers on tiny random checkpoints of Llama, Qwen2, Mixtral and
Gemma2: greedy float32 generate and generate_batch equal plain transformers token for token,
and disable() puts the model back exactly (core lane: transformers installed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _transformers_models import (
    ARCHS,
    PROMPTS,
    build,
    checkpoint,
    greedy,
    greedy_batch,
)

pytest.importorskip("transformers")

from opmux.integrations import transformers as otf


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(arch, model loaded from its checkpoint, plain transformers' results), the model
    enabled; disabled again afterwards."""
    arch = request.param
    model = checkpoint(arch, tmp_path_factory.mktemp(arch))
    with torch.no_grad():
        logits = model(torch.tensor(PROMPTS[1:])).logits
    plain = {"generate": greedy(model), "batch": greedy_batch(model), "logits": logits,
             "attn": model.config._attn_implementation}
    otf.enable(model)
    yield arch, model, plain
    otf.disable(model)


def _snapshot(model: Any) -> dict[str, Any]:
    return {"classes": [type(m) for m in model.modules()],
            "attn": model.config._attn_implementation,
            "experts": model.config._experts_implementation,
            "dict": sorted(model.__dict__),
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def test_generate_equals_plain_transformers(loaded: tuple[str, Any, dict[str, Any]]) -> None:
    _, model, plain = loaded
    assert model.config._attn_implementation == plain["attn"]  # the config is not changed
    assert greedy(model) == plain["generate"]


def test_generate_batch_equals_plain_transformers(loaded: tuple[str, Any, dict[str, Any]]
                                                  ) -> None:
    arch, model, plain = loaded
    got = greedy_batch(model)
    assert got == plain["generate"]
    if arch != "gemma2":
        assert got == plain["batch"]
    # else: transformers 5.23's own generate_batch of Gemma2 (its "paged|eager" path) does not
    # reproduce its generate() on these checkpoints; opmux's does (docs/transformers.md)
    # the batching manager switched to the paged variant and back
    assert model.config._attn_implementation == plain["attn"]


def test_logits_agree(loaded: tuple[str, Any, dict[str, Any]]) -> None:
    _, model, plain = loaded
    with torch.no_grad():
        logits = model(torch.tensor(PROMPTS[1:])).logits
    torch.testing.assert_close(logits, plain["logits"], rtol=1e-4, atol=1e-4)


def test_layers_swapped(loaded: tuple[str, Any, dict[str, Any]]) -> None:
    arch, model, _ = loaded
    names = {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Opmux")}
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mixtral": "Mixtral", "gemma2": "Gemma2"}[arch]
    expected = {f"Opmux{prefix}{part}" for part in ("RMSNorm", "Attention", "DecoderLayer")}
    expected.add("OpmuxLinear")  # every plain nn.Linear (projections, lm_head)
    expected.add(f"Opmux{prefix}Experts" if arch == "mixtral" else f"Opmux{prefix}MLP")
    assert names == expected
    for module in model.modules():  # every swapped class is a subclass of the original
        if type(module).__name__.startswith("Opmux"):
            assert type(module).__bases__[-1].__name__ == type(module).__name__[len("Opmux"):]


@pytest.mark.parametrize("arch", ["mixtral", "gemma2"])
def test_disable_restores_exactly(arch: str) -> None:
    model = build(arch)
    before = _snapshot(model)
    with torch.no_grad():
        want = model(torch.tensor(PROMPTS[:1])).logits
    assert otf.enable(model) is model and otf.is_enabled(model)
    assert otf.enable(model) is model  # twice is a no-op
    assert _snapshot(model)["attn"] == before["attn"]  # the config is not changed
    assert otf.disable(model) is model and not otf.is_enabled(model)
    after = _snapshot(model)
    state, state_after = before.pop("state"), after.pop("state")
    assert after == before
    assert state.keys() == state_after.keys()
    assert all(torch.equal(state[k], state_after[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(model(torch.tensor(PROMPTS[:1])).logits, want)
    assert otf.disable(model) is model  # disabling a plain model changes nothing


def test_bfloat16_runs_close_to_plain() -> None:
    model = build("llama").to(torch.bfloat16)
    ids = torch.tensor(PROMPTS[1:])
    with torch.no_grad():
        want = model(ids).logits.float()
        otf.enable(model)
        try:
            got = model(ids).logits.float()
        finally:
            otf.disable(model)
    # opmux rounds once per op where transformers rounds after each step: bf16 noise only
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_unsupported_model_is_refused(tmp_path: Path) -> None:
    import transformers as tr

    model = tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(otf.UnsupportedModelError,
                       match=r"supports transformers models of the types \['gemma2'"):
        otf.enable(model)
    with pytest.raises(TypeError, match="got object"):
        otf.enable(object())
    assert isinstance(otf.UnsupportedModelError("x"), __import__("opmux").OpmuxError)
