"""The FusedMoE layer: both forward paths, CustomOp accounting, fullgraph compile."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

import opmux
from opmux.core.forward_context import collect_layers, forward_context
from opmux.layers.moe import FusedMoE, TransformersFusedMoE, moe_forward_shared


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():  # inference: no autograd through the opaque ops
        yield


def _reference(layer: FusedMoE, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The layer's math written out with torch only (dense over experts)."""
    flat = x.reshape(-1, layer.hidden_size).double()
    logits = flat @ layer.gate_weight.double().t()
    probs = torch.softmax(logits, -1)
    weights, ids = probs.topk(layer.top_k, -1)
    if layer.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    inter = layer.intermediate_size
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(layer.top_k):
            e = int(ids[t, j])
            h = layer.w13_weight[e].double() @ flat[t]
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += weights[t, j] * (layer.w2_weight[e].double() @ act)
    shared = None
    if layer.shared_experts is not None:
        se = layer.shared_experts
        h = flat @ se.gate_up_weight.double().t()
        i = se.intermediate_size
        shared = ((torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ se.down_weight.double().t())
        shared = shared.view(x.shape)
    return shared, out.view(x.shape)


def test_layer_matches_reference_on_both_paths(fresh_custom_ops: None) -> None:
    torch.manual_seed(0)
    layer = FusedMoE(8, 2, 32, 48, layer_name="moe0", shared_intermediate_size=40)
    x = torch.randn(2, 5, 32)
    want_shared, want_fused = _reference(layer, x)
    with forward_context(layers={"moe0": layer}):
        shared, fused = layer(x)
    assert shared is not None and shared.shape == fused.shape == x.shape
    torch.testing.assert_close(fused.double(), want_fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared.double(), want_shared, atol=1e-5, rtol=1e-5)
    # disabled: forward_native, no forward context needed
    opmux.set_custom_ops("all,-fused_moe")
    native_layer = FusedMoE(8, 2, 32, 48, layer_name="moe0", shared_intermediate_size=40)
    native_layer.load_state_dict(layer.state_dict())
    n_shared, n_fused = native_layer(x)
    torch.testing.assert_close(n_fused, fused)
    torch.testing.assert_close(n_shared, shared)
    counts = opmux.custom_op_counts()
    assert counts["enabled"]["fused_moe"] == 1 and counts["disabled"]["fused_moe"] == 1


def test_layer_without_shared_experts_and_grouped_routing() -> None:
    torch.manual_seed(1)
    layer = FusedMoE(16, 3, 24, 32, layer_name="m", num_expert_group=4, topk_group=2,
                     scoring_func="sigmoid", use_correction_bias=True,
                     routed_scaling_factor=2.0)
    with torch.no_grad():
        layer.e_score_correction_bias.copy_(torch.randn(16) * 0.1)  # type: ignore[union-attr]
    x = torch.randn(7, 24)
    with forward_context(layers=collect_layers(layer)):
        shared, fused = layer(x)
    assert shared is None
    _, ids = layer.route(x @ layer.gate_weight.t())
    groups = (ids.long() // 4)
    assert all(len(set(row.tolist())) <= 2 for row in groups)  # at most topk_group groups
    torch.testing.assert_close(fused, layer.forward_native(x)[1])


def test_layer_op_needs_the_context() -> None:
    layer = FusedMoE(4, 2, 8, 8, layer_name="lonely")
    with pytest.raises(opmux.OpmuxError, match="layer 'lonely' was requested but no forward "
                                               "context is active"):
        layer(torch.randn(2, 8))
    with forward_context(layers={"other": layer}), \
            pytest.raises(opmux.OpmuxError, match=r"known layers: \['other'\]"):
        layer(torch.randn(2, 8))
    with forward_context(layers={"lonely": layer}), \
            pytest.raises(opmux.OpmuxError, match="has no shared experts; call moe_forward"):
        moe_forward_shared("lonely", torch.randn(2, 8), torch.randn(2, 4))


def _expect_config_error(kwargs: dict[str, object], match: str) -> None:
    """A small FusedMoE with ``kwargs`` added is refused with ``match``."""
    args: dict[str, object] = {"num_experts": 4, "top_k": 2, "hidden_size": 8,
                               "intermediate_size": 8, **kwargs}
    with pytest.raises(opmux.ConfigError, match=match):
        FusedMoE(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"top_k": 5}, r"top_k must be in \[1, num_experts=4\], got 5"),
    ({"layer_name": ""}, "layer_name must be a non-empty string"),
    ({"num_expert_group": 2}, "give both num_expert_group and topk_group"),
    ({"num_expert_group": 3, "topk_group": 1}, "num_expert_group must divide num_experts=4"),
    ({"num_expert_group": 2, "topk_group": 3}, r"topk_group must be in \[1, 2\], got 3"),
    ({"scoring_func": "sigmoid"}, "apply to grouped routing only"),
])
def test_layer_config_errors(kwargs: dict[str, object], match: str) -> None:
    _expect_config_error({"layer_name": "x", **kwargs}, match)


class TwoLayerMoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = FusedMoE(8, 2, 32, 64, layer_name="layers.0.mlp",
                              shared_intermediate_size=48)
        self.second = FusedMoE(8, 2, 32, 64, layer_name="layers.1.mlp", num_expert_group=4,
                               topk_group=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared, fused = self.first(x)
        assert shared is not None
        x = x + shared + fused
        _, fused = self.second(x)
        return x + fused


def test_two_layer_model_compiles_fullgraph() -> None:
    torch.manual_seed(2)
    model = TwoLayerMoE()
    x = torch.randn(3, 4, 32)
    with forward_context(layers=collect_layers(model)):
        eager = model(x)
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1
        code = explanation.graphs[0].code
        assert "opmux.moe_forward_shared.default('layers.0.mlp'" in code
        assert "opmux.moe_forward.default('layers.1.mlp'" in code
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), eager)
        torch.testing.assert_close(compiled(x * 0.5), model(x * 0.5))


def test_native_path_compiles_fullgraph(fresh_custom_ops: None) -> None:
    opmux.set_custom_ops("none")
    torch.manual_seed(3)
    model = TwoLayerMoE()
    x = torch.randn(5, 32)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.slow
def test_two_layer_model_inductor() -> None:
    torch.manual_seed(4)
    model = TwoLayerMoE()
    x = torch.randn(6, 32)
    start = time.perf_counter()
    with forward_context(layers=collect_layers(model)):
        compiled = torch.compile(model, fullgraph=True, backend="inductor")
        torch.testing.assert_close(compiled(x), model(x))
    assert time.perf_counter() - start < 120


# ------------------------------------------------------------ vLLM 0.32's call forms
class _SharedMLP(torch.nn.Module):
    """A caller-built shared-experts module, as vLLM models pass one."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


def _routed_reference(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    inter = w2.shape[-1]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (
                w2[e].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


TOLS = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_form_router_logits_and_shared_module(fresh_custom_ops: None,
                                                   dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    shared = _SharedMLP(16, 8).to(dtype)
    bias = torch.nn.Parameter(torch.randn(8) * 0.1)
    kwargs: dict[str, object] = {
        "num_experts": 8, "top_k": 2, "hidden_size": 16, "intermediate_size": 12,
        "params_dtype": dtype, "prefix": "model.layers.3.mlp.experts",
        "use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2,
        "scoring_func": "sigmoid", "e_score_correction_bias": bias,
        "shared_experts": shared, "routed_scaling_factor": 1.5}
    layer = FusedMoE(**kwargs)  # type: ignore[arg-type]
    assert layer.layer_name == "model.layers.3.mlp.experts" and layer.w13_weight.dtype == dtype
    assert layer.e_score_correction_bias is bias
    x = torch.randn(2, 3, 16).to(dtype)
    logits = torch.randn(6, 8).to(dtype)
    weights, ids = layer.route(logits)
    flat = x.reshape(6, 16)
    want = (_routed_reference(layer.w13_weight, layer.w2_weight, flat, weights, ids)
            + shared(flat).double()).view(2, 3, 16)
    with forward_context(layers={layer.layer_name: layer}):
        out = layer(x, logits)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), want, **TOLS[dtype])
    opmux.set_custom_ops("all,-fused_moe")
    off = FusedMoE(**kwargs)  # type: ignore[arg-type]
    off.load_state_dict(layer.state_dict())
    torch.testing.assert_close(off(x, logits).double(), want, **TOLS[dtype])


def test_vllm_form_plain_topk_keeps_groups_informative() -> None:
    """use_grouped_topk=False: plain softmax top-k even with group sizes (vLLM's meaning)."""
    layer = FusedMoE(8, 2, 8, 8, prefix="p", use_grouped_topk=False, num_expert_group=4,
                     topk_group=1)
    logits = torch.randn(5, 8)
    weights, ids = layer.route(logits)
    want_w, want_ids = torch.softmax(logits, -1).topk(2, -1)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w / want_w.sum(-1, keepdim=True))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"activation": "gelu"}, "activation must be 'silu'"),
    ({"tp_size": 2}, "tp_size=2 differs from the tensor-parallel group's size 1"),
    ({"use_grouped_topk": True}, "use_grouped_topk=True needs num_expert_group"),
    ({"dtype": torch.float32, "params_dtype": torch.bfloat16}, "disagree"),
    ({"e_score_correction_bias": torch.zeros(3), "num_expert_group": 2, "topk_group": 1},
     r"e_score_correction_bias must have shape \(4,\)"),
    ({"shared_experts": torch.nn.Identity(), "shared_intermediate_size": 4}, "not both"),
])
def test_vllm_form_config_errors(kwargs: dict[str, object], match: str) -> None:
    _expect_config_error({"prefix": "x", **kwargs}, match)


# ------------------------------------------------------------ TransformersFusedMoE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_fused_moe_enabled_and_disabled(fresh_custom_ops: None,
                                                     dtype: torch.dtype) -> None:
    torch.manual_seed(6)
    layer = TransformersFusedMoE(num_experts=6, top_k=2, hidden_size=16,
                                 intermediate_size=10, params_dtype=dtype,
                                 prefix="model.layers.0.mlp.experts")
    assert set(layer.state_dict()) == {"w13_weight", "w2_weight"}
    x = torch.randn(7, 16).to(dtype)
    probs = torch.softmax(torch.randn(7, 6), -1)
    weights, ids = probs.topk(2, -1)  # int64 ids, as Transformers routes
    want = _routed_reference(layer.w13_weight, layer.w2_weight, x, weights, ids)
    with forward_context(layers=collect_layers(layer)):
        out = layer(x, ids, weights.to(dtype), unused_transformers_kwarg=True)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), want, **TOLS[dtype])
    opmux.set_custom_ops("all,-transformers_fused_moe")
    off = TransformersFusedMoE(6, 2, 16, 10, params_dtype=dtype, prefix="off")
    off.load_state_dict(layer.state_dict())
    torch.testing.assert_close(off(x, ids, weights).double(), want, **TOLS[dtype])
    counts = opmux.custom_op_counts()
    assert counts["enabled"]["transformers_fused_moe"] == 1
    assert counts["disabled"]["transformers_fused_moe"] == 1
    with pytest.raises(opmux.ConfigError, match="shared experts belong to the Transformers"):
        TransformersFusedMoE(6, 2, 16, 10, prefix="s", shared_intermediate_size=4)


class TransformersBlock(torch.nn.Module):
    """A Transformers-style MoE block: the model routes, the experts layer computes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 6, bias=False)
        self.experts = TransformersFusedMoE(6, 2, 16, 10, prefix="block.experts")
        self.router = FusedMoE(6, 2, 16, 10, prefix="block.moe")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.softmax(self.gate(x), -1).topk(2, -1)
        y = x + self.experts(x, ids, weights)
        return y + self.router(y, self.gate(y))  # type: ignore[no-any-return]


@pytest.mark.parametrize("enablement", ["all", "none"])
def test_transformers_block_compiles_fullgraph(fresh_custom_ops: None,
                                               enablement: str) -> None:
    opmux.set_custom_ops(enablement)
    torch.manual_seed(8)
    block = TransformersBlock()
    x = torch.randn(5, 16)
    with forward_context(layers=collect_layers(block)):
        explanation = torch._dynamo.explain(block)(x)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1
        if enablement == "all":
            code = explanation.graphs[0].code
            assert "opmux.transformers_moe_forward.default('block.experts'" in code
        compiled = torch.compile(block, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), block(x))
