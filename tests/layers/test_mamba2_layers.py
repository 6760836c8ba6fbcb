"""MambaMixer2, Mixer2RMSNormGated and Plamo2MambaMixer: vLLM's parameter names, enabled
(catalog ops -> ``cpp``) and disabled (native references) against a per-token reference built
from the same parameters, on a batch mixing decode rows and prefill sequences over shared
state slots; prefill then decode through the layer equals one longer prefill; a tiny Mamba-2
stack under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import opmux
from opmux.layers import MambaMetadata, MambaMixer2, Mixer2RMSNormGated, Plamo2MambaMixer
from opmux.testing.mamba_batches import (
    assert_compiled_matches_eager,
    init_ssm_layer,
    mixed_batch,
    packed_sequences,
)
from opmux.testing.ssd_reference import sequential_ssd
from opmux.testing.ssm_reference import sequential_causal_conv1d

pytestmark = pytest.mark.usefixtures("plugins_no_grad")


def _gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None,
                group: int, eps: float) -> torch.Tensor:
    h = x.float() * F.silu(gate.float())
    if weight is None:
        return h.to(x.dtype)
    g = h.unflatten(-1, (-1, group))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.flatten(-2).to(x.dtype)


def _fill_states(layer: MambaMixer2 | Plamo2MambaMixer, slots: int) -> None:
    conv, ssm = layer.allocate_state_cache(slots)
    g = torch.Generator().manual_seed(5)
    conv.copy_(torch.randn(conv.shape, generator=g))
    ssm.copy_(torch.randn(ssm.shape, generator=g) * 0.5)


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("groups,use_rms_norm", [(1, True), (2, True), (2, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_norm_matches_reference(enabled: bool, groups: int, use_rms_norm: bool,
                                      dtype: torch.dtype) -> None:
    opmux.set_custom_ops("all" if enabled else "none")
    norm = Mixer2RMSNormGated(32, groups, use_rms_norm, eps=1e-5)
    assert [n for n, _ in norm.named_parameters()] == (["weight"] if use_rms_norm else [])
    if norm.weight is not None:
        norm.weight.copy_(1 + 0.1 * torch.randn(32))
        norm.to(dtype)
    x, gate = torch.randn(6, 32).to(dtype), torch.randn(6, 32).to(dtype)
    want = _gated_norm(x, gate, norm.weight, 32 // groups, 1e-5)
    got = norm(x, gate)
    assert got.dtype == want.dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert opmux.custom_op_counts()["enabled" if enabled else "disabled"][
        "mixer2_gated_rms_norm"] == 1


def _mixer2(dtype: torch.dtype, groups: int = 2, prefix: str = "model.layers.0.mixer"
            ) -> MambaMixer2:
    layer = MambaMixer2(hidden_size=16, ssm_state_size=8, conv_kernel_size=4,
                        intermediate_size=32, use_conv_bias=True, use_bias=False,
                        n_groups=groups, num_heads=4, head_dim=8, rms_norm_eps=1e-5,
                        prefix=prefix, chunk_size=4)
    init_ssm_layer(layer, 7)
    a = layer.A.data.clone()
    layer.to(dtype)
    layer.A.data = a  # A stays fp32, as vLLM creates it
    return layer


def _mixer2_reference(layer: MambaMixer2, h: torch.Tensor, m: MambaMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qsl, idx, init = packed_sequences(m)
    conv, ssm = (t.clone() for t in layer.kv_cache)
    g = layer.n_groups
    gate, xbc, dt = F.linear(h, layer.in_proj.weight).split([32, 32 + 2 * 8 * g, 4], dim=-1)
    xbc, conv = sequential_causal_conv1d(xbc, layer.conv1d.weight[:, 0, :], layer.conv1d.bias,
                                         conv, qsl, idx, init, "silu")
    x, b, c = xbc.split([32, 8 * g, 8 * g], dim=-1)
    t = h.shape[0]
    y, ssm = sequential_ssd(x.view(t, 4, 8), dt, layer.A, b.view(t, g, 8), c.view(t, g, 8),
                            ssm, idx, qsl, init, layer.D, None, layer.dt_bias, True)
    y = _gated_norm(y.flatten(1), gate, layer.norm.weight, 32 // g, 1e-5)
    return F.linear(y, layer.out_proj.weight), conv, ssm


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mamba_mixer2_matches_reference(enabled: bool, groups: int, dtype: torch.dtype) -> None:
    opmux.set_custom_ops("all" if enabled else "none")
    layer = _mixer2(dtype, groups)
    names = sorted(n for n, _ in layer.named_parameters())
    assert names == ["A", "D", "conv1d.bias", "conv1d.weight", "dt_bias", "in_proj.weight",
                     "norm.weight", "out_proj.weight"]
    assert tuple(layer.conv1d.weight.shape) == (32 + 2 * 8 * groups, 1, 4)
    _fill_states(layer, 4)
    h = torch.randn(11, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    m = mixed_batch()
    want, want_conv, want_ssm = _mixer2_reference(layer, h, m)
    got = layer(h, None, m)
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(layer.kv_cache[0].float(), want_conv.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(layer.kv_cache[1], want_ssm, atol=tol, rtol=tol)
    assert opmux.custom_op_counts()["enabled" if enabled else "disabled"]["mamba_mixer2"] == 1


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_mamba_mixer2_prefill_then_decode_equals_longer_prefill(enabled: bool) -> None:
    opmux.set_custom_ops("all" if enabled else "none")
    layer = _mixer2(torch.float32)
    _fill_states(layer, 3)
    start = [t.clone() for t in layer.kv_cache]
    h = torch.randn(9, 16)
    whole = layer(h, None, MambaMetadata(1, 9, 0, torch.tensor([0, 9]), torch.tensor([1]),
                                         torch.tensor([True])))
    whole_states = [t.clone() for t in layer.kv_cache]
    layer.kv_cache = tuple(start)
    parts = [layer(h[:6], None, MambaMetadata(1, 6, 0, torch.tensor([0, 6]), torch.tensor([1]),
                                              torch.tensor([True])))]
    for i in range(6, 9):
        parts.append(layer(h[i:i + 1], None, MambaMetadata(
            0, 0, 1, state_indices_tensor_d=torch.tensor([1]))))
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-4, rtol=1e-4)
    for got, want in zip(layer.kv_cache, whole_states, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mamba_mixer2_profile_run_touches_no_state() -> None:
    layer = _mixer2(torch.float32)
    _fill_states(layer, 2)
    before = [t.clone() for t in layer.kv_cache]
    out = layer(torch.randn(3, 16))
    assert out.shape == (3, 16)
    for got, want in zip(layer.kv_cache, before, strict=True):
        assert torch.equal(got, want)


def _plamo2(dtype: torch.dtype) -> Plamo2MambaMixer:
    config = SimpleNamespace(hidden_size=16, mamba_d_state=8, mamba_d_conv=4,
                             mamba_num_heads=4, hidden_size_per_head=8, rms_norm_eps=1e-6,
                             mamba_chunk_size=4)
    layer = Plamo2MambaMixer(SimpleNamespace(model_config=SimpleNamespace(hf_config=config)),
                             prefix="model.layers.0.mixer")
    init_ssm_layer(layer, 9)
    a = layer.A.data.clone()
    layer.to(dtype)
    layer.A.data = a
    return layer


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plamo2_mamba_mixer_matches_reference(enabled: bool, dtype: torch.dtype) -> None:
    opmux.set_custom_ops("all" if enabled else "none")
    layer = _plamo2(dtype)
    assert sorted(n for n, _ in layer.named_parameters()) == [
        "A", "B_norm.weight", "C_norm.weight", "D", "bcdt_proj.weight", "conv1d.weight",
        "dt_bias", "dt_norm.weight", "dt_proj.weight", "in_proj.weight", "out_proj.weight"]
    _fill_states(layer, 4)
    m = mixed_batch()
    qsl, idx, init = packed_sequences(m)
    conv, ssm = (t.clone() for t in layer.kv_cache)
    h = torch.randn(11, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    gate, x = F.linear(h, layer.in_proj.weight).chunk(2, dim=-1)
    x, conv = sequential_causal_conv1d(x, layer.conv1d.weight[:, 0, :], None, conv, qsl, idx,
                                       init, "silu")
    b, c, ts = F.linear(x, layer.bcdt_proj.weight).split([8, 8, 64], dim=-1)

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
                ).to(t.dtype)

    dt = F.linear(rms(ts, layer.dt_norm.weight), layer.dt_proj.weight)
    y, ssm = sequential_ssd(x.view(11, 4, 8), dt, layer.A, rms(b, layer.B_norm.weight)[:, None],
                            rms(c, layer.C_norm.weight)[:, None], ssm, idx, qsl, init, layer.D,
                            gate.reshape(11, 4, 8), layer.dt_bias, True)
    want = F.linear(y.flatten(1), layer.out_proj.weight)
    output = torch.full((12, 16), 7.0, dtype=dtype)  # one padding row beyond the batch
    assert layer(h, output, m) is None
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(output[:11].float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(output[11], torch.full((16,), 7.0, dtype=dtype))
    torch.testing.assert_close(layer.kv_cache[0].float(), conv.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(layer.kv_cache[1], ssm, atol=tol, rtol=tol)


class _TinyMamba2(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_mixer2(torch.float32, prefix=f"layers.{i}")
                                          for i in range(2))

    def forward(self, h: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        for layer in self.layers:
            h = h + layer(h, None, meta)
        return h


def test_tiny_mamba2_stack_compiles_fullgraph() -> None:
    """Prefill then decode through the compiled stack equals eager, with no graph break
    (``fullgraph=True`` raises on one)."""
    opmux.set_custom_ops("all")
    model = _TinyMamba2()
    for layer in model.layers:
        _fill_states(layer, 3)
    prefill = MambaMetadata(2, 7, 0, torch.tensor([0, 4, 7], dtype=torch.int32),
                            torch.tensor([2, 0], dtype=torch.int32), torch.tensor([False, True]))
    decode = MambaMetadata(0, 0, 2, state_indices_tensor_d=torch.tensor([0, 2],
                                                                        dtype=torch.int32))
    assert_compiled_matches_eager(model, model.layers, [layer.kv_cache for layer in model.layers],
                                  [(torch.randn(7, 16), prefill), (torch.randn(2, 16), decode)])
