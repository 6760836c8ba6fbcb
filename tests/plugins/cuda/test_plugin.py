"""The CUDA plugin's hooks, priorities and ``cuda_c`` availability (no GPU needed)."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

import opmux
from opmux.plugins import cuda as plugin
from opmux.plugins.cuda import cuda_c, priority


def test_plugin_info_is_cheap_and_names_platforms() -> None:
    assert plugin.opmux_plugin_info() == {"name": "cuda", "platforms": ["cuda", "rocm"]}


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_default_priority_on_gpu_platforms(platform: str) -> None:
    p = types.SimpleNamespace(name=platform)
    for op in ("silu_and_mul", "gelu_and_mul", "rms_norm", "fused_add_rms_norm",
               "rotary_embedding", "reshape_and_cache", "paged_attention",
               "advance_step_flashattn"):
        order = plugin.opmux_default_priority(op, p)
        assert order is not None and "triton" in order and order[-1] == "native", op
    assert plugin.opmux_default_priority("advance_step_flashattn", p)[0] == "cuda_c"
    assert plugin.opmux_default_priority("paged_attention", p)[0] == "triton"
    assert plugin.opmux_default_priority("no_such_op", p) is None


def test_no_opinion_off_gpu_platforms() -> None:
    assert plugin.opmux_default_priority("rms_norm", types.SimpleNamespace(name="cpu")) is None
    assert priority.default_priority("rms_norm", "xla") is None


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-torch reason")
def test_cuda_c_unsupported_on_cpu_torch_with_reason(registry: opmux.OpRegistry,
                                                     ns: str) -> None:
    ok, reason = cuda_c.cuda_c_status()
    assert not ok and reason == "torch is a CPU build (torch.version.cuda is None)"
    op = registry.register_op(opmux.ops.rms_norm.native, name="rms_norm", namespace=ns)
    assert cuda_c.register(registry, "CUDA") == ["rms_norm:cuda_c"]
    impl = op.impls["cuda_c"]
    assert not impl.supported and impl.reason == reason and impl.dispatch_key == "CUDA"
    assert "cuda_c" not in op.supported_providers()


def test_cuda_c_build_dir_is_keyed(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("OPMUX_CACHE_DIR", str(tmp_path))
    d = cuda_c.build_dir()
    assert d.parent == tmp_path / "cuda_c" and len(d.name) == 16  # type: ignore[operator]
    assert {p.name for p in cuda_c.sources()} == {"activation.cu", "bindings.cpp", "cache.cu",
                                                  "layernorm.cu"}


def test_cuda_c_build_refuses_with_reason_when_impossible(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(cuda_c, "cuda_c_status", lambda: (False, "no toolkit here"))
    monkeypatch.setattr(cuda_c.CACHE, "cached_status", None)
    with pytest.raises(opmux.OpmuxError, match="cannot be built here: no toolkit here"):
        cuda_c.build()


def test_register_hook_serves_cuda_key_with_both_providers(registry: opmux.OpRegistry,
                                                           ns: str) -> None:
    for name in ("rms_norm", "paged_attention"):
        registry.register_op(getattr(opmux.ops, name).native, name=name, namespace=ns)
    done = plugin.register(registry, "CUDA")
    assert sorted(done) == ["paged_attention:triton", "rms_norm:cuda_c", "rms_norm:triton"]
    for op in registry.list_ops():
        assert op.impls["triton"].dispatch_key == "CUDA"


def test_without_triton_the_provider_is_unsupported_and_says_why(
        registry: opmux.OpRegistry, ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from opmux.plugins.cuda import triton_ops

    reason = "triton is not installed (pip install 'opmux[cuda]')"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "triton" else real(name, *args))
    op = registry.register_op(opmux.ops.silu_and_mul.native, name="silu_and_mul", namespace=ns)
    assert triton_ops.register(registry, "CPU") == ["silu_and_mul:triton"]
    impl = op.impls["triton"]
    assert not impl.supported and impl.reason == reason
    x = torch.randn(2, 4)
    assert op.dispatch(x).provider == "native"
    with pytest.raises(opmux.ProviderUnavailableError, match=r"silu_and_mul \(provider 'triton'\)"):
        impl(x)
