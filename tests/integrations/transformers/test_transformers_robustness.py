"""An enabled model behaves as a plain one wherever plain transformers runs: models sharing a
config, torch.compile, the meta device and FakeTensorMode, output_attentions, CPU autocast,
deepcopy, pickling, save_pretrained, a compiled wrapper (core lane)."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from _transformers_models import ARCHS, PROMPTS, build

pytest.importorskip("transformers")

from torch._subclasses.fake_tensor import FakeTensorMode

import opmux
from opmux.integrations import transformers as otf


def _logits(model: Any, ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(PROMPTS[1:]) if ids is None else ids,  # type: ignore[no-any-return]
                     **kwargs).logits


def _opmux_classes(model: Any) -> set[str]:
    return {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Opmux")}


# ---------------------------------------------------------------------- shared configurations
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_mixtral_models_sharing_a_config_never_recurse(act: str) -> None:
    """Two models built from one config object, both enabled: the experts' fallback (grad
    on, or GELU experts that fused_moe does not compute) is transformers' own forward."""
    import transformers as tr

    first = build("mixtral")
    config = first.config
    config.hidden_act = act
    second = tr.MixtralForCausalLM(config).eval()
    second.load_state_dict(first.state_dict())
    for module in (first, second):  # the activation is chosen when the experts are built
        for layer in module.model.layers:
            layer.mlp.experts.act_fn = tr.activations.ACT2FN[act]
    ids = torch.tensor(PROMPTS[1:])
    want = _logits(second, ids)
    want_grad = second(ids).logits
    otf.enable(first)
    otf.enable(second)
    assert config._experts_implementation == build("mixtral").config._experts_implementation
    torch.testing.assert_close(_logits(second, ids), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second(ids).logits, want_grad, rtol=0, atol=0)  # autograd
    out = second.generate(ids[:, :4], max_new_tokens=3, do_sample=False, num_beams=2,
                          pad_token_id=0)
    assert out.shape == (1, 7)


# ------------------------------------------------------------------------------- tracing
@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_with_fullgraph(arch: str) -> None:
    """Nothing data-dependent on the traced path: one graph, the plain model's outputs."""
    model = build(arch)
    ids = torch.tensor(PROMPTS[1:])
    torch._dynamo.reset()
    plain = torch.compile(model, fullgraph=True, backend="aot_eager")
    want = _logits(plain, ids)
    otf.enable(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(_logits(compiled, ids), want, rtol=1e-4, atol=1e-4)


def _build_without_data(arch: str) -> Any:
    """``build(arch)``; Mixtral in bfloat16: without data, transformers' experts run only in
    bf16 (``grouped_mm``; the eager experts call ``nonzero``)."""
    if arch != "mixtral":
        return build(arch)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return build(arch)
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("arch", ARCHS)
def test_meta_device_and_fake_tensors(arch: str) -> None:
    with torch.device("meta"):
        model = _build_without_data(arch)
    ids = torch.tensor(PROMPTS[1:], device="meta")
    want = _logits(model, ids)
    otf.enable(model)
    got = _logits(model, ids)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_meta

    with FakeTensorMode():
        model = _build_without_data(arch)
        ids = torch.tensor(PROMPTS[1:])
        want = _logits(model, ids)
        otf.enable(model)
        got = _logits(model, ids)
    assert got.shape == want.shape and got.dtype == want.dtype
    with torch.no_grad():  # the memos kept no fake tensor: a real model still runs
        real = build(arch)
        want = _logits(real)
        otf.enable(real)
        torch.testing.assert_close(_logits(real), want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------ output_attentions
def test_output_attentions_on_the_config(tmp_path: Path) -> None:
    import transformers as tr

    build("llama").save_pretrained(tmp_path / "src")
    model = tr.AutoModelForCausalLM.from_pretrained(
        tmp_path / "src", attn_implementation="eager", output_attentions=True).eval()
    want = model(torch.tensor(PROMPTS[:1]))
    otf.enable(model)
    with torch.no_grad():
        got = model(torch.tensor(PROMPTS[:1]))
    assert len(got.attentions) == len(want.attentions) == 2
    for a, b in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(a, b.detach())
    model.save_pretrained(tmp_path / "dst")
    model.config.output_attentions = False
    model.config.output_attentions = True  # eager: allowed, as without opmux


# ------------------------------------------------------------------------------- autocast
@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_autocast_bfloat16(arch: str) -> None:
    model = build(arch)
    ids = torch.tensor(PROMPTS[1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _logits(model, ids)
        otf.enable(model)
        got = _logits(model, ids)
    assert got.dtype == want.dtype
    # bf16 linears in both; opmux's ops round once where transformers rounds per step
    assert (got.float() - want.float()).abs().max() < 0.1 * want.float().abs().max()


# --------------------------------------------------------------------- copies and pickling
@pytest.mark.parametrize("arch", ["gemma2", "mixtral"])
def test_deepcopy_is_enabled_and_can_be_disabled(arch: str) -> None:
    model = build(arch)
    want = _logits(model)
    otf.enable(model)
    twin = copy.deepcopy(model)
    assert otf.is_enabled(twin) and _opmux_classes(twin) == _opmux_classes(model)
    torch.testing.assert_close(_logits(twin), want, rtol=1e-4, atol=1e-4)
    otf.disable(twin)
    assert not otf.is_enabled(twin) and _opmux_classes(twin) == set()
    assert "init_continuous_batching" not in twin.__dict__
    assert otf.is_enabled(model) and _opmux_classes(model)
    torch.testing.assert_close(_logits(twin), want, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_save_and_load(arch: str) -> None:
    model = build(arch)
    want = _logits(model)
    otf.enable(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert otf.is_enabled(loaded) and _opmux_classes(loaded) == _opmux_classes(model)
    torch.testing.assert_close(_logits(loaded), want, rtol=1e-4, atol=1e-4)
    otf.disable(loaded)
    assert _opmux_classes(loaded) == set()


def test_save_pretrained_of_an_enabled_model(tmp_path: Path) -> None:
    import json

    import transformers as tr

    model = build("gemma2")
    want = _logits(model)
    otf.enable(model)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    again = tr.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not otf.is_enabled(again)
    torch.testing.assert_close(_logits(again), want, rtol=0, atol=0)


# ------------------------------------------------------------------------ wrappers, errors
def test_enable_a_compiled_module() -> None:
    model = build("llama")
    compiled = torch.compile(model, backend="eager")
    assert otf.enable(compiled) is compiled
    assert otf.is_enabled(compiled) and otf.is_enabled(model)
    assert "OpmuxLlamaRMSNorm" in _opmux_classes(model)
    assert otf.disable(compiled) is compiled and not otf.is_enabled(model)


@pytest.mark.parametrize("func", [otf.enable, otf.disable])
def test_not_a_model_is_a_clear_error(func: Any) -> None:
    assert otf.is_enabled(None) is False
    with pytest.raises(otf.UnsupportedModelError, match=r"got NoneType with model_type None"):
        func(None)
    with pytest.raises(opmux.OpmuxError):
        func(torch.nn.Linear(2, 2))
