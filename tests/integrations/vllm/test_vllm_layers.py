"""vLLM's layers after opmux's register(): each is opmux's subclass, agrees with vLLM's own
implementation, and falls back to it where the opmux op does not apply (vllm lane)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_ctx() -> Iterator[Any]:
    from vllm.config import VllmConfig, set_current_vllm_config

    from opmux.integrations import vllm as plugin

    plugin.register()
    assert plugin.registered(), "register() replaced nothing"
    with set_current_vllm_config(VllmConfig()):
        yield plugin


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _activation_cases() -> list[tuple[str, dict[str, Any], int]]:
    return [("SiluAndMul", {}, 64), ("MulAndSilu", {}, 64), ("GeluAndMul", {}, 64),
            ("GeluAndMul", {"approximate": "tanh"}, 64), ("FatreluAndMul", {"threshold": 0.3}, 64),
            ("SwigluOAIAndMul", {}, 64), ("NewGELU", {}, 48), ("GELUTanh", {}, 48),
            ("FastGELU", {}, 48), ("QuickGELU", {}, 48), ("ReLUSquaredActivation", {}, 48)]


@pytest.mark.parametrize(("name", "kwargs", "width"), _activation_cases())
def test_activations_replaced_and_agree(vllm_ctx: Any, name: str, kwargs: dict[str, Any],
                                        width: int) -> None:
    from vllm.model_executor.layers import activation

    base = getattr(activation, name)
    layer = base(**kwargs)
    assert type(layer) is not base and isinstance(layer, base)
    assert type(layer).__name__ == f"Opmux{name}" and type(layer).name == base.name
    x = torch.randn(2, 5, width) * 3
    want = base.forward_native(layer, x) if name != "SiluAndMul" else base.forward_native(x)
    _close(layer(x), want)            # the path vLLM picked
    _close(layer.forward_cpu(x), want)
    _close(layer.forward_native(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_replaced_and_agree(vllm_ctx: Any, dtype: torch.dtype) -> None:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2,
                                                                         "atol": 2e-2}
    for base in (RMSNorm, GemmaRMSNorm):
        layer = base(64, eps=1e-5).to(dtype)
        assert type(layer) is not base and isinstance(layer, base)
        with torch.no_grad():
            layer.weight.normal_()
        x, res = torch.randn(7, 64, dtype=dtype), torch.randn(7, 64, dtype=dtype)
        torch.testing.assert_close(layer(x), base.forward_native(layer, x), **tol)
        out, new_res = layer(x.clone(), res.clone())
        want_out, want_res = base.forward_native(layer, x.clone(), res.clone())
        torch.testing.assert_close(out, want_out, **tol)
        torch.testing.assert_close(new_res, want_res, **tol)


def test_rms_norm_fallback_to_vllm(vllm_ctx: Any,
                                  op_calls: Callable[[str], list[dict[str, Any]]]) -> None:
    from vllm.model_executor.layers.layernorm import RMSNorm

    calls = op_calls("rms_norm")
    layer = RMSNorm(64, var_hidden_size=32)
    x = torch.randn(3, 64)
    _close(layer(x), RMSNorm.forward_native(layer, x))
    assert calls == []  # the opmux op does not run for var_hidden_size
    # no weight: the op runs with the ones vLLM keeps
    plain = RMSNorm(64, has_weight=False)
    _close(plain(x), RMSNorm.forward_native(plain, x))
    (call,) = calls
    assert call["x"] is x and torch.equal(call["weight"], torch.ones(64))


def _rope_layers() -> list[tuple[str, dict[str, Any]]]:
    common = {"head_size": 32, "rotary_dim": 32, "max_position_embeddings": 256,
              "base": 10000.0, "is_neox_style": True, "dtype": torch.float32}
    return [
        ("RotaryEmbedding", common),
        ("RotaryEmbedding", {**common, "rotary_dim": 16, "is_neox_style": False}),
        ("LinearScalingRotaryEmbedding", {**common, "scaling_factors": [1.0, 2.0]}),
        ("DynamicNTKScalingRotaryEmbedding", {**common, "scaling_factor": 2.0,
                                              "max_trained_positions": 128}),
        ("YaRNScalingRotaryEmbedding", {**common, "scaling_factor": 2.0}),
        ("Llama3RotaryEmbedding", {**common, "scaling_factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "orig_max_position": 64}),
    ]


@pytest.mark.parametrize(("name", "kwargs"), _rope_layers())
def test_rotary_replaced_and_agree(vllm_ctx: Any, name: str, kwargs: dict[str, Any]) -> None:
    from vllm.model_executor.layers import rotary_embedding as rope

    base = getattr(rope, name)
    layer = base(**kwargs)
    assert type(layer).__name__ == f"Opmux{name}" and isinstance(layer, base)
    tokens = 9
    positions = torch.randint(0, 200, (tokens,))
    qkv = torch.randn(tokens, (8 + 2 + 2) * 32)
    q, k = qkv[:, :256], qkv[:, 256:320]  # strided views, as vLLM splits qkv
    want_q, want_k = base.forward_native(layer, positions, q.clone(), k.clone())
    got_q, got_k = layer.forward_native(positions, q, k)
    _close(got_q, want_q)
    _close(got_k, want_k)
    before = qkv.clone()
    out_q, out_k = layer.forward_cpu(positions, q, k)  # the platform path: in place
    assert out_q is q and out_k is k
    _close(q, want_q)
    _close(k, want_k)
    torch.testing.assert_close(qkv[:, 320:], before[:, 320:])  # v untouched
    q_only, none = layer.forward_cpu(positions, q.clone(), None)
    assert none is None
    _close(q_only, base.forward_native(layer, positions, q.clone(), None)[0])


def test_other_rope_classes_listed(vllm_ctx: Any) -> None:
    from vllm.model_executor.custom_op import op_registry_oot

    for name in vllm_ctx.ROPE_CLASSES:
        assert op_registry_oot[name].__name__ == f"Opmux{name}"


def test_ir_provider(vllm_ctx: Any) -> None:
    from vllm import ir

    x, w, res = torch.randn(5, 64), torch.randn(64), torch.randn(5, 64)
    assert "opmux" in ir.ops.rms_norm.impls and "opmux" in ir.ops.fused_add_rms_norm.impls
    want = ir.ops.rms_norm.impls["native"].impl_fn(x, w, 1e-6)
    with ir.ops.rms_norm.set_priority(["opmux", "native"]):
        assert ir.ops.rms_norm.dispatch(x, w, 1e-6).provider == "opmux"
        assert ir.ops.rms_norm.dispatch(x, None, 1e-6).provider == "native"  # declined
        _close(ir.ops.rms_norm(x, w, 1e-6), want)
    want_out, want_res = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, res, w, 1e-6)
    with ir.ops.fused_add_rms_norm.set_priority(["opmux", "native"]):
        out, new_res = ir.ops.fused_add_rms_norm(x, res, w, 1e-6)
    _close(out, want_out)
    _close(new_res, want_res)


def test_register_idempotent_and_backend(vllm_ctx: Any) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    first = vllm_ctx.registered()
    vllm_ctx.register()
    assert vllm_ctx.registered() == first
    cls = AttentionBackendEnum.CPU_ATTN.get_class()
    assert cls.__name__ == "OpmuxCPUAttentionBackend"
    assert cls.get_name() == "CPU_ATTN"


def _graph_targets(fn: Any, *args: Any) -> set[str]:
    """The call targets of the FX graph torch.compile traces for ``fn(*args)``."""
    seen: set[str] = set()

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


def test_forward_native_traces_vllm_code_platform_paths_trace_the_op(vllm_ctx: Any) -> None:
    # under torch.compile vLLM turns custom ops off so that Inductor fuses the native code:
    # the replacement's forward_native then traces vLLM's own code, while an enabled op's
    # platform path stays one opmux node
    from vllm.model_executor.layers.layernorm import RMSNorm

    layer = RMSNorm(32)
    x, res = torch.randn(4, 32), torch.randn(4, 32)
    native = _graph_targets(layer.forward_native, x)
    assert not any("opmux" in t for t in native), native
    assert any("opmux.rms_norm" in t for t in _graph_targets(layer.forward_cpu, x))
    assert any("opmux.fused_add_rms_norm" in t
               for t in _graph_targets(layer.forward_cpu, x, res))
    # eager forward_native still runs the opmux op, and both agree
    _close(layer.forward_native(x), torch.compile(layer.forward_native, backend="eager")(x))
