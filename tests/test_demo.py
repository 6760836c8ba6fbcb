"""``opmux demo``: runs end to end, reports JSON, and fails when a provider is wrong."""

from __future__ import annotations

import argparse
import io
import json

import pytest
import torch

import opmux
from opmux import demo

_SMALL = ["--layers", "2", "--steps", "3", "--batch", "3", "--hidden", "64", "--heads", "4",
          "--kv-heads", "2", "--block-size", "4", "--device", "cpu"]


def _run(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = demo.run(parser.parse_args(list(argv)), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_demo_json_report() -> None:
    code, out, _ = _run(*_SMALL, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] is True
    assert report["max_abs_diff"] <= report["tolerance"]
    assert report["config"]["layers"] == 2 and report["config"]["head_size"] == 16
    assert len(set(report["prompt_lens"])) > 1  # prompt lengths differ per sequence
    assert len(report["tokens"]) == 3 and all(len(t) == 4 for t in report["tokens"])
    assert all(0 <= tok < 1000 for row in report["tokens"] for tok in row)
    expected_ops = set(demo.DEMO_OPS) - {"advance_step_flashattn", "fused_add_rms_norm"}
    assert expected_ops <= set(report["providers"]["prefill"])
    assert set(demo.DEMO_OPS) == set(report["providers"]["decode"])
    registered = {op.qualname: set(op.impls) for op in opmux.list_ops()}
    for phase in report["providers"].values():
        for name, provider in phase.items():
            assert provider in registered[f"opmux::{name}"]
    assert report["tokens_agree"] == report["tokens_total"] == 12
    assert report["tokens_per_s"]["native"] > 0 and report["tokens_per_s"]["selected"] > 0


def test_demo_text_output() -> None:
    code, out, err = _run(*_SMALL)
    assert code == 0, err
    assert "logits vs all-native" in out and "OK" in out and "tokens/s" in out
    assert "paged_attention" in out
    assert err == ""  # no progress bar when stderr is not a TTY and the run is short


def test_demo_greedy_decoding_matches_a_plain_torch_model() -> None:
    """The paged, op-by-op decode equals recomputing the full causal model every step."""
    cfg = demo.DemoConfig(layers=2, hidden=64, heads=4, kv_heads=2, head_size=16,
                          intermediate=128, block_size=4, batch=2, steps=4, max_prompt=9)
    model = demo.TinyLlama(cfg, torch.device("cpu"))
    prompts = [torch.tensor([5, 17, 3]), torch.tensor([9, 1, 2, 8, 4, 7])]
    with contextlib_native(model):
        result = demo.generate(model, prompts, cfg.steps)
    for s, prompt in enumerate(prompts):
        seq = prompt.tolist()
        for step in range(cfg.steps + 1):
            logits = _dense_forward(model, torch.tensor(seq))
            torch.testing.assert_close(result.logits[step][s], logits, atol=1e-4, rtol=1e-4)
            seq.append(int(result.tokens[s, step]))
            assert int(logits.argmax()) == int(result.tokens[s, step])


def contextlib_native(model: demo.TinyLlama):  # type: ignore[no-untyped-def]
    import contextlib

    stack = contextlib.ExitStack()
    for op in model.ops.values():
        stack.enter_context(op.set_priority(["native"]))
    return stack


def _dense_forward(model: demo.TinyLlama, tokens: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: full causal attention, no cache, no opmux ops; last row's logits."""
    cfg = model.cfg
    t, d = tokens.shape[0], cfg.head_size
    g = cfg.heads // cfg.kv_heads

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rope(x: torch.Tensor) -> torch.Tensor:  # [t, h, d], neox
        cos, sin = model.cos_sin[:t].chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    h = model.embed[tokens]
    for layer in model.layers:
        x = norm(h, layer["in_norm"])
        q, k, v = (x @ layer["qkv"].T).split([cfg.heads * d, cfg.kv_heads * d,
                                              cfg.kv_heads * d], -1)
        q, k = rope(q.view(t, cfg.heads, d)), rope(k.view(t, cfg.kv_heads, d))
        k = k.repeat_interleave(g, dim=1)
        v = v.view(t, cfg.kv_heads, d).repeat_interleave(g, dim=1)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        h = h + attn.transpose(0, 1).reshape(t, -1) @ layer["o"].T
        x = norm(h, layer["post_norm"])
        gate, up = (x @ layer["gate_up"].T).chunk(2, -1)
        h = h + (torch.nn.functional.silu(gate) * up) @ layer["down"].T
    return (norm(h, model.final_norm) @ model.lm_head.T)[-1]


def test_demo_fails_when_a_provider_is_wrong() -> None:
    op = opmux.ops.silu_and_mul

    def off_by_a_bit(x: torch.Tensor) -> torch.Tensor:
        return op.native(x) + 0.05

    op.register_impl("demo_test_wrong", dispatch_key="CPU")(off_by_a_bit)
    try:
        with op.set_priority(["demo_test_wrong"]):
            code, out, _ = _run(*_SMALL, "--json")
    finally:
        op.unregister_impl("demo_test_wrong")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert report["providers"]["decode"]["silu_and_mul"] == "demo_test_wrong"
    assert report["max_abs_diff"] > report["tolerance"]


def test_demo_rejects_bad_sizes() -> None:
    code, _, err = _run("--hidden", "60", "--heads", "8")
    assert code == 2 and "multiple of --heads" in err


@pytest.mark.parametrize("dtype", ["bf16"])
def test_demo_low_precision(dtype: str) -> None:
    code, out, _ = _run(*_SMALL, "--dtype", dtype, "--json")
    assert code == 0, out
