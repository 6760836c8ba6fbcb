"""ShortConv and MambaMixer: vLLM 0.32's constructors and parameter names, enabled (catalog
ops -> ``cpp``) and disabled (native references) against a per-token reference built from
the same parameters, a batch mixing decode and prefill sequences over shared state slots,
and a tiny Mamba stack under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import opmux
from opmux.core.forward_context import forward_context
from opmux.layers import MambaMetadata, MambaMixer, ShortConv
from opmux.testing.mamba_batches import (
    assert_compiled_matches_eager,
    init_ssm_layer,
    mixed_batch,
    packed_sequences,
)
from opmux.testing.ssm_reference import sequential_causal_conv1d, sequential_selective_scan

pytestmark = pytest.mark.usefixtures("plugins_no_grad")


def _mixer(use_rms_norm: bool, dtype: torch.dtype) -> MambaMixer:
    layer = MambaMixer(hidden_size=16, ssm_state_size=8, conv_kernel_size=4,
                       intermediate_size=32, time_step_rank=4, use_conv_bias=True,
                       use_bias=False, use_rms_norm=use_rms_norm, prefix="model.layers.0.mixer")
    init_ssm_layer(layer, 7)
    a = layer.A.data.clone()
    layer.to(dtype)
    layer.A.data = a  # A stays fp32 in a model of another dtype, as vLLM creates it
    return layer


def _mixer_reference(layer: MambaMixer, h: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                     m: MambaMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qsl, idx, init = packed_sequences(m)
    proj = F.linear(h, layer.in_proj.weight)
    xbc, gate = proj.chunk(2, dim=-1)
    w = layer.conv1d.weight[:, 0, :]
    x, conv = sequential_causal_conv1d(xbc, w, layer.conv1d.bias, conv, qsl, idx, init, "silu")
    params = F.linear(x, layer.x_proj.weight)
    ts, b, c = params.split([4, 8, 8], dim=-1)
    if layer.use_rms_norm:
        def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            tf = t.float()
            return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-5)
                    * weight.float()).to(t.dtype)
        assert layer.dt_layernorm is not None and layer.b_layernorm is not None
        assert layer.c_layernorm is not None
        ts, b, c = (rms(ts, layer.dt_layernorm.weight), rms(b, layer.b_layernorm.weight),
                    rms(c, layer.c_layernorm.weight))
    dt = F.linear(ts, layer.dt_proj.weight)
    assert layer.dt_proj.bias is not None
    y, ssm = sequential_selective_scan(x, ssm, dt, layer.A, b, c, layer.D.float(), gate,
                                       layer.dt_proj.bias.float(), True, qsl, idx, init)
    return F.linear(y, layer.out_proj.weight), conv, ssm


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("use_rms_norm", [False, True], ids=["plain", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mamba_mixer_matches_reference(enabled: bool, use_rms_norm: bool,
                                       dtype: torch.dtype) -> None:
    opmux.set_custom_ops("all" if enabled else "none")
    layer = _mixer(use_rms_norm, dtype)
    assert layer.A.dtype == torch.float32 and tuple(layer.conv1d.weight.shape) == (32, 1, 4)
    conv, ssm = layer.allocate_state_cache(4)
    g = torch.Generator().manual_seed(3)
    conv.copy_(torch.randn(conv.shape, generator=g))
    ssm.copy_(torch.randn(ssm.shape, generator=g) * 0.5)
    h = torch.randn(11, 16, generator=g).to(dtype)
    want, want_conv, want_ssm = _mixer_reference(layer, h, conv.clone(), ssm.clone(),
                                                 mixed_batch())
    output = torch.full((12, 16), 7.0, dtype=dtype)  # one padding row beyond the batch
    layer(h, output, mixed_batch())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(output[:11].float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(conv.float(), want_conv.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(ssm, want_ssm, atol=tol, rtol=tol)
    assert torch.equal(output[11], torch.full((16,), 7.0, dtype=dtype))
    counts = opmux.custom_op_counts()["enabled" if enabled else "disabled"]
    assert counts["mamba_mixer"] == 1


def test_mamba_mixer_metadata_from_forward_context() -> None:
    layer = _mixer(False, torch.float32)
    caches = [t.clone() for t in layer.allocate_state_cache(4)]
    h = torch.randn(11, 16)
    direct = torch.empty(11, 16)
    layer(h, direct, mixed_batch())
    layer.kv_cache = tuple(caches)
    via_ctx = torch.empty(11, 16)
    with forward_context(layers={}, metadata={layer.prefix: mixed_batch()}):
        layer(h, via_ctx)
    torch.testing.assert_close(via_ctx, direct)
    profile = torch.empty(11, 16)
    layer(h, profile)  # no metadata: vLLM's profile run, states untouched
    assert torch.equal(layer.kv_cache[0], caches[0])


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_short_conv_matches_reference(enabled: bool) -> None:
    opmux.set_custom_ops("all" if enabled else "none")
    config = SimpleNamespace(conv_L_cache=3, conv_bias=True)
    layer = ShortConv(config, dim=24, layer_idx=0, prefix="model.layers.1.conv")
    init_ssm_layer(layer, 11)
    assert sorted(n for n, _ in layer.named_parameters()) == [
        "conv.bias", "conv.weight", "in_proj.bias", "in_proj.weight", "out_proj.bias",
        "out_proj.weight"]
    (conv,) = layer.allocate_state_cache(4)
    conv.copy_(torch.randn(conv.shape))
    m = mixed_batch()
    qsl, idx, init = packed_sequences(m)
    h = torch.randn(11, 24)
    b, c, x = F.linear(h, layer.in_proj.weight, layer.in_proj.bias).chunk(3, dim=-1)
    y, want_conv = sequential_causal_conv1d(b * x, layer.conv.weight[:, 0, :], layer.conv.bias,
                                            conv.clone(), qsl, idx, init, None)
    want = F.linear(c * y, layer.out_proj.weight, layer.out_proj.bias)
    output = torch.empty(11, 24)
    layer(h, output, m)
    torch.testing.assert_close(output, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(conv, want_conv)


class _TinyMamba(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            MambaMixer(16, 8, 4, 32, 4, True, False, False, prefix=f"layers.{i}")
            for i in range(2))

    def forward(self, h: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        for layer in self.layers:
            out = torch.empty_like(h)
            layer(h, out, meta)
            h = h + out
        return h


def test_tiny_mamba_stack_compiles_fullgraph() -> None:
    """Prefill then decode through the compiled stack equals eager, with no graph break."""
    opmux.set_custom_ops("all")
    model = _TinyMamba()
    for i, layer in enumerate(model.layers):
        init_ssm_layer(layer, 20 + i)
    caches = [layer.allocate_state_cache(3) for layer in model.layers]
    prefill = MambaMetadata(1, 6, 0, torch.tensor([0, 6], dtype=torch.int32),
                            torch.tensor([2], dtype=torch.int32), torch.tensor([False]), None)
    decode = MambaMetadata(0, 0, 1, state_indices_tensor_d=torch.tensor([2], dtype=torch.int32))
    assert_compiled_matches_eager(model, model.layers, caches,
                                  [(torch.randn(6, 16), prefill), (torch.randn(1, 16), decode)])
