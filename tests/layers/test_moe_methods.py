"""UnquantizedFusedMoEMethod and the modular kernel (FusedMoEModularMethod): weights,
both forward paths against a per-token reference, a custom experts object, fullgraph."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import opmux
from opmux.layers import (
    FusedMoECatalogExperts,
    FusedMoEConfig,
    FusedMoEExpertsModular,
    FusedMoEKernel,
    FusedMoEModularMethod,
    MoEPrepareAndFinalizeNoDPEPModular,
    UnquantizedFusedMoEMethod,
)
from opmux.layers.moe_methods import TopKWeightAndReduce, TopKWeightAndReduceContiguous

E, H, INTER, TOPK = 6, 16, 12, 2
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


@pytest.fixture(autouse=True)
def _no_grad(fresh_custom_ops: None) -> Iterator[None]:
    with torch.no_grad():
        yield


def _layer(method: UnquantizedFusedMoEMethod | FusedMoEModularMethod, dtype: torch.dtype,
           seed: int = 0) -> torch.nn.Module:
    layer = torch.nn.Module()
    method.create_weights(layer, E, H, INTER, dtype)
    gen = torch.Generator().manual_seed(seed)
    layer.w13_weight.copy_(torch.randn(E, 2 * INTER, H, generator=gen) * H ** -0.5)
    layer.w2_weight.copy_(torch.randn(E, H, INTER, generator=gen) * INTER ** -0.5)
    return layer


def _routing(tokens: int, seed: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    probs = torch.softmax(torch.randn(tokens, E, generator=gen), -1)
    weights, ids = probs.topk(TOPK, -1)
    return x, weights, ids.to(torch.int32)


def _reference(layer: torch.nn.Module, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """Per token, per chosen expert, in float64."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = layer.w13_weight[e].double() @ x[t].double()
            act = F.silu(h[:INTER]) * h[INTER:]
            out[t] += float(weights[t, j]) * (layer.w2_weight[e].double() @ act)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unquantized_method_enabled_and_disabled(dtype: torch.dtype) -> None:
    method = UnquantizedFusedMoEMethod(FusedMoEConfig(E, TOPK, H, INTER))
    layer = _layer(method, dtype)
    assert layer.w13_weight.shape == (E, 2 * INTER, H) and layer.w2_weight.shape == (E, H, INTER)
    assert layer.w13_weight.dtype == dtype and not layer.w13_weight.requires_grad
    x, weights, ids = _routing(9)
    x = x.to(dtype)
    want = _reference(layer, x, weights, ids)
    enabled = method.apply(layer, x, weights, ids)
    assert enabled.dtype == dtype and enabled.shape == (9, H)
    torch.testing.assert_close(enabled.double(), want, **TOL[dtype])
    opmux.set_custom_ops("all,-unquantized_fused_moe")
    off = UnquantizedFusedMoEMethod()
    torch.testing.assert_close(off.apply(layer, x, weights, ids).double(), want, **TOL[dtype])
    counts = opmux.custom_op_counts()
    assert counts["enabled"]["unquantized_fused_moe"] == 1
    assert counts["disabled"]["unquantized_fused_moe"] == 1


def test_create_weights_sets_attrs_and_checks() -> None:
    layer = torch.nn.Module()

    def loader(param: torch.nn.Parameter, loaded: Tensor) -> None:
        param.data.copy_(loaded)

    UnquantizedFusedMoEMethod().create_weights(layer, 2, 4, 3, torch.float32,
                                               weight_loader=loader)
    assert layer.w2_weight.weight_loader is loader
    with pytest.raises(opmux.ConfigError, match="intermediate_size_per_partition must be >= 1"):
        UnquantizedFusedMoEMethod().create_weights(layer, 2, 4, 0, torch.float32)
    with pytest.raises(opmux.ConfigError, match="activation must be 'silu'"):
        FusedMoEConfig(2, 1, 4, 3, activation="gelu")
    with pytest.raises(opmux.OpInputError, match="shared_experts"):
        UnquantizedFusedMoEMethod().apply(layer, torch.randn(1, 4), torch.ones(1, 1),
                                          torch.zeros(1, 1, dtype=torch.int32),
                                          shared_experts=torch.nn.Identity())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modular_method_enabled_and_disabled(dtype: torch.dtype) -> None:
    method = FusedMoEModularMethod(UnquantizedFusedMoEMethod())
    assert isinstance(method.moe_kernel.prepare_finalize, MoEPrepareAndFinalizeNoDPEPModular)
    assert isinstance(method.moe_kernel.fused_experts, FusedMoECatalogExperts)
    layer = _layer(method, dtype)
    x, weights, ids = _routing(7)
    x = x.to(dtype)
    want = _reference(layer, x, weights, ids)
    torch.testing.assert_close(method.apply(layer, x, weights, ids).double(), want,
                               **TOL[dtype])
    opmux.set_custom_ops(["all", "-modular_fused_moe"])
    off = FusedMoEModularMethod(UnquantizedFusedMoEMethod())
    torch.testing.assert_close(off.apply(layer, x, weights, ids).double(), want, **TOL[dtype])
    assert opmux.custom_op_counts()["disabled"]["modular_fused_moe"] == 1


class LoopExperts(FusedMoEExpertsModular):
    """A custom experts object: per-slot GEMMs, output ``[M, topk, K]`` left unweighted
    for finalize to weight and reduce; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, activation: str, global_num_experts: int,
              expert_map: Optional[Tensor], apply_router_weight_on_input: bool) -> Tensor:
        self.calls += 1
        inter = w2.shape[-1]
        gate_up = torch.einsum("mh,mkih->mki", hidden_states, w1[topk_ids.long()])
        act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        return torch.einsum("mki,mkhi->mkh", act, w2[topk_ids.long()])

    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        return TopKWeightAndReduceContiguous()


def test_custom_experts_plug_in() -> None:
    experts = LoopExperts()
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
    method = FusedMoEModularMethod(UnquantizedFusedMoEMethod(), kernel)
    layer = _layer(method, torch.float32, seed=3)
    x, weights, ids = _routing(5, seed=4)
    out = method.apply(layer, x, weights, ids)
    assert experts.calls == 1
    torch.testing.assert_close(out.double(), _reference(layer, x, weights, ids), **TOL[
        torch.float32])


def test_router_weight_on_input() -> None:
    """top-1 with the weight applied to the tokens in prepare equals weighting the output
    for the catalog experts; for SiLU experts it differs, as in vLLM (weight inside)."""
    method = FusedMoEModularMethod(UnquantizedFusedMoEMethod())
    layer = _layer(method, torch.float32, seed=5)
    x, _, _ = _routing(4, seed=6)
    weights = torch.full((4, 1), 0.5)
    ids = torch.tensor([[0], [3], [5], [3]], dtype=torch.int32)
    out = method.moe_kernel.apply(x, layer.w13_weight, layer.w2_weight, weights, ids,
                                  apply_router_weight_on_input=True)
    want = _reference(layer, x * 0.5, torch.ones(4, 1), ids)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    with pytest.raises(opmux.OpInputError, match=r"\[M, 1\] with apply_router_weight_on_input"):
        method.moe_kernel.apply(x, layer.w13_weight, layer.w2_weight,
                                torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int32),
                                apply_router_weight_on_input=True)
    with pytest.raises(opmux.OpInputError, match="expert_map"):
        method.moe_kernel.apply(x, layer.w13_weight, layer.w2_weight, weights, ids,
                                expert_map=torch.arange(E))


def test_module_apply_still_works() -> None:
    """A method held by a model as a submodule: ``model.apply(fn)`` recurses into it."""
    model = torch.nn.Module()
    model.quant_method = FusedMoEModularMethod(UnquantizedFusedMoEMethod())
    seen: list[str] = []
    model.apply(lambda m: seen.append(type(m).__name__))
    assert "FusedMoEModularMethod" in seen and "UnquantizedFusedMoEMethod" in seen


class TinyBlock(torch.nn.Module):
    """Router + both methods, as a MoE block would use them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.unquantized = UnquantizedFusedMoEMethod()
        self.modular = FusedMoEModularMethod(UnquantizedFusedMoEMethod())
        self.unquantized.create_weights(self, E, H, INTER, torch.float32)
        torch.nn.init.normal_(self.w13_weight, std=H ** -0.5)
        torch.nn.init.normal_(self.w2_weight, std=INTER ** -0.5)

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = torch.softmax(self.gate(x), -1).topk(TOPK, -1)
        ids = ids.to(torch.int32)
        y = x + self.unquantized.apply(self, x, weights, ids)
        return y + self.modular.apply(self, y, weights, ids)


@pytest.mark.parametrize("enablement", ["all", "none"])
def test_tiny_block_compiles_fullgraph(enablement: str) -> None:
    opmux.set_custom_ops(enablement)
    torch.manual_seed(7)
    block = TinyBlock()
    x = torch.randn(6, H)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), block(x))
