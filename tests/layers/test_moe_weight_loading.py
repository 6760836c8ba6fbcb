"""FusedMoE weight loading from full checkpoint tensors (TP=1 here; TP=2 in
test_tensor_parallel_tp2.py) and its errors."""

from __future__ import annotations

import pytest
import torch

import opmux
from opmux.layers import FusedMoE

pytestmark = pytest.mark.usefixtures("fresh_distributed")


def test_per_expert_and_stacked_loads_agree() -> None:
    layer = FusedMoE(4, 2, 8, 6, layer_name="m", shared_intermediate_size=4)
    assert layer.tp_size == 1 and layer.intermediate_size_per_partition == 6
    w13, w2 = torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    for e in range(4):
        layer.weight_loader(layer.w13_weight, w13[e, :6], "experts.w1", "w1", e)
        layer.weight_loader(layer.w13_weight, w13[e, 6:], "experts.w3", "w3", e)
        layer.weight_loader(layer.w2_weight, w2[e], "experts.w2", "w2", e)
    assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)
    other = FusedMoE(4, 2, 8, 6, layer_name="m2", shared_intermediate_size=4)
    other.w13_weight.weight_loader(other.w13_weight, w13)  # type: ignore[attr-defined]
    other.w2_weight.weight_loader(other.w2_weight, w2)  # type: ignore[attr-defined]
    assert torch.equal(other.w13_weight, w13) and torch.equal(other.w2_weight, w2)
    assert layer.shared_experts is not None
    gate_up = torch.randn(8, 8)
    layer.weight_loader(layer.shared_experts.gate_up_weight, gate_up)
    assert torch.equal(layer.shared_experts.gate_up_weight, gate_up)
    router = torch.randn(4, 8)
    layer.weight_loader(layer.gate_weight, router)
    assert torch.equal(layer.gate_weight, router)


def test_bad_loads_are_clear_errors() -> None:
    layer = FusedMoE(4, 2, 8, 6, layer_name="m")
    with pytest.raises(opmux.OpInputError, match="'shard_id': expected 'w1' or 'w3'"):
        layer.weight_loader(layer.w13_weight, torch.randn(6, 8), "", "w2", 0)
    with pytest.raises(opmux.OpInputError, match=r"'expert_id': expected an expert in "
                       r"\[0, 4\), got 4"):
        layer.weight_loader(layer.w2_weight, torch.randn(8, 6), "", "w2", 4)
    with pytest.raises(opmux.OpInputError, match="full checkpoint tensor with size 6"):
        layer.weight_loader(layer.w2_weight, torch.randn(8, 3), "", "w2", 1)
    with pytest.raises(opmux.OpInputError, match=r"expected shape \(4, 8\)"):
        layer.weight_loader(layer.gate_weight, torch.randn(8, 4))
