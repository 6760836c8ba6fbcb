"""Tensor-parallel layers in one process (TP=1, no group): the vLLM contract, formulas,
weight loading and its errors. TP=2 is in test_tensor_parallel_tp2.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opmux
from opmux.layers import (
    ColumnParallelLinear,
    LogitsProcessor,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

pytestmark = pytest.mark.usefixtures("fresh_distributed")


def _load(layer: torch.nn.Module, **full: torch.Tensor) -> None:
    for name, value in full.items():
        param = getattr(layer, name)
        param.weight_loader(param, value)


def test_layers_are_registered_under_vllm_table_names() -> None:
    table = {"replicated_linear": ReplicatedLinear, "column_parallel_linear": ColumnParallelLinear,
             "row_parallel_linear": RowParallelLinear,
             "vocab_parallel_embedding": VocabParallelEmbedding,
             "parallel_lm_head": ParallelLMHead, "logits_processor": LogitsProcessor}
    for name, cls in table.items():
        assert opmux.CustomOp.op_registry[name] is cls and cls.name == name
        assert issubclass(cls, opmux.CustomOp)
    assert issubclass(MergedColumnParallelLinear, ColumnParallelLinear)
    assert issubclass(QKVParallelLinear, ColumnParallelLinear)
    assert issubclass(ParallelLMHead, VocabParallelEmbedding)


def test_linear_forward_contract() -> None:
    w, b, x = torch.randn(6, 4), torch.randn(6), torch.randn(3, 4)
    for cls in (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear):
        layer = cls(4, 6)
        assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
        assert layer.weight.shape == (6, 4) and layer.tp_size == 1
        _load(layer, weight=w, bias=b)
        out, bias = layer(x)
        torch.testing.assert_close(out, F.linear(x, w, b))
        assert bias is None
        skipping = cls(4, 6, skip_bias_add=True)
        skipping.load_state_dict(layer.state_dict())
        out, bias = skipping(x)
        torch.testing.assert_close(out, x @ w.t())
        assert bias is skipping.bias
        plain = cls(4, 6, bias=False, return_bias=False)
        assert plain.bias is None and "bias" not in plain.state_dict()
        _load(plain, weight=w)
        torch.testing.assert_close(plain(x), x @ w.t())


def test_merged_and_qkv_load_shards_and_fused_checkpoints() -> None:
    gate, up, x = torch.randn(5, 4), torch.randn(7, 4), torch.randn(2, 4)
    merged = MergedColumnParallelLinear(4, [5, 7], bias=False, return_bias=False)
    merged.weight_loader(merged.weight, up, 1)
    merged.weight_loader(merged.weight, gate, 0)
    torch.testing.assert_close(merged(x), x @ torch.cat([gate, up]).t())
    merged.weight_loader(merged.weight, torch.cat([gate, up]) * 2, (0, 1))
    torch.testing.assert_close(merged(x), 2 * x @ torch.cat([gate, up]).t())
    with pytest.raises(opmux.OpInputError, match=r"loaded_shard_id.*got 2"):
        merged.weight_loader(merged.weight, gate, 2)
    with pytest.raises(opmux.OpInputError, match=r"consecutive.*\(1, 0\)"):
        merged.weight_loader(merged.weight, gate, (1, 0))

    qkv = QKVParallelLinear(16, 4, 4, 2, bias=True)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.output_sizes) == (4, 2, [16, 8, 8])
    q, k, v = torch.randn(16, 16), torch.randn(8, 16), torch.randn(8, 16)
    for shard, t in (("v", v), ("q", q), ("k", k)):
        qkv.weight_loader(qkv.weight, t, shard)
    qkv.weight_loader(qkv.bias, torch.arange(32.0))  # fused on disk
    h = torch.randn(3, 16)
    out, _ = qkv(h)
    torch.testing.assert_close(out, F.linear(h, torch.cat([q, k, v]), torch.arange(32.0)))
    with pytest.raises(opmux.OpInputError, match="'q', 'k', 'v' or None, got 'x'"):
        qkv.weight_loader(qkv.weight, q, "x")


def test_weight_loader_wants_the_full_tensor() -> None:
    layer = ColumnParallelLinear(4, 6)
    with pytest.raises(opmux.OpInputError, match=r"ColumnParallelLinear.weight_loader: "
                       r"argument 'loaded_weight': expected the full checkpoint tensor with "
                       r"size 6 along dimension 0, got shape \(3, 4\)"):
        layer.weight_loader(layer.weight, torch.randn(3, 4))
    with pytest.raises(opmux.OpInputError, match=r"expected shape \(6, 4\).*got \(6, 5\)"):
        layer.weight_loader(layer.weight, torch.randn(6, 5))


def test_row_parallel_slices_a_full_input_and_refuses_unreduced_bias() -> None:
    layer = RowParallelLinear(8, 3, bias=False, input_is_parallel=False, return_bias=False)
    _load(layer, weight=torch.randn(3, 8))
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), x @ layer.weight.t())
    with pytest.raises(opmux.ConfigError, match="reduce_results=False with a bias"):
        RowParallelLinear(8, 3, bias=True, reduce_results=False)
    RowParallelLinear(8, 3, bias=True, reduce_results=False, skip_bias_add=True)


def test_quant_config_is_refused() -> None:
    with pytest.raises(opmux.ConfigError, match="quant_config='fp8' is not supported"):
        ColumnParallelLinear(4, 4, quant_config="fp8")
    with pytest.raises(opmux.ConfigError, match="quant_config"):
        VocabParallelEmbedding(10, 4, quant_config=object())


def test_vocab_parallel_embedding_pads_and_looks_up() -> None:
    emb = VocabParallelEmbedding(100, 8, params_dtype=torch.float64)
    assert emb.num_embeddings_padded == 128 and emb.weight.shape == (128, 8)
    assert emb.weight.dtype == torch.float64
    full = torch.randn(100, 8, dtype=torch.float64)
    emb.weight.fill_(7.0)
    _load(emb, weight=full)
    assert torch.equal(emb.weight[:100], full) and not emb.weight[100:].any()
    ids = torch.tensor([[0, 99], [42, 3]], dtype=torch.int32)
    torch.testing.assert_close(emb(ids), F.embedding(ids.long(), full))
    assert VocabParallelEmbedding(100, 8, padding_size=1).num_embeddings_padded == 100
    added = VocabParallelEmbedding(110, 8, org_num_embeddings=100)
    assert (added.org_vocab_size_padded, added.num_embeddings_padded) == (128, 192)
    shard = added.shard_indices  # one rank: base ids [0, 100) padded to 128, added [100, 110)
    assert (shard.num_org_elements, shard.num_org_elements_padded) == (100, 128)
    assert (shard.num_added_elements, shard.num_added_elements_padded) == (10, 64)
    assert (shard.num_org_vocab_padding, shard.num_elements_padded) == (28, 192)


def test_lm_head_and_logits_processor() -> None:
    head = ParallelLMHead(50, 6, bias=True)
    assert head.weight.shape == (64, 6) and head.bias is not None and head.bias.shape == (64,)
    w, b = torch.randn(50, 6), torch.randn(50)
    _load(head, weight=w, bias=b)
    with pytest.raises(opmux.OpmuxError, match="LogitsProcessor"):
        head(torch.zeros(1, dtype=torch.long))
    h = torch.randn(4, 6)
    torch.testing.assert_close(LogitsProcessor(50)(head, h), h @ w.t())
    capped = LogitsProcessor(50, scale=0.5, soft_cap=2.0)(head, h, head.bias)
    torch.testing.assert_close(capped, torch.tanh((h @ w.t() + b) / 2.0) * 2.0 * 0.5)
    assert LogitsProcessor(50)(head, h, None, True).shape == (4, 64)  # skip_gather: padded
    logits = torch.randn(4, 50)
    scaled = LogitsProcessor(50, scale=3.0, logits_as_input=True)(head, logits.clone())
    torch.testing.assert_close(scaled, logits * 3.0)
    emb = VocabParallelEmbedding(50, 6)
    _load(emb, weight=w)
    tied = ParallelLMHead(50, 6).tie_weights(emb)
    assert tied.weight is emb.weight


def test_layers_compile_fullgraph_at_tp1() -> None:
    from torch import _dynamo

    col = ColumnParallelLinear(8, 6, gather_output=True, return_bias=False)
    row = RowParallelLinear(6, 8, input_is_parallel=False, return_bias=False)
    emb = VocabParallelEmbedding(30, 8)
    for layer, shape in ((col, (6, 8)), (row, (8, 6)), (emb, (30, 8))):
        _load(layer, weight=torch.randn(*shape))
    for layer in (col, row):
        _load(layer, bias=torch.randn(layer.weight.shape[0]))

    def model(ids: torch.Tensor) -> torch.Tensor:
        return row(col(emb(ids)))  # type: ignore[no-any-return]

    ids = torch.tensor([1, 29, 5])
    _dynamo.reset()
    assert _dynamo.explain(model)(ids).graph_break_count == 0
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids), model(ids))


def test_disabled_layers_run_forward_native(fresh_custom_ops: None) -> None:
    opmux.set_custom_ops("none")
    layer = ColumnParallelLinear(4, 6, return_bias=False)
    assert layer.forward == layer.forward_native
    _load(layer, weight=torch.eye(6, 4), bias=torch.zeros(6))
    torch.testing.assert_close(layer(torch.ones(1, 4)), torch.eye(6, 4).sum(1).unsqueeze(0))
    assert opmux.custom_op_counts()["disabled"]["column_parallel_linear"] == 1


@pytest.mark.parametrize(("args", "message"), [
    ((16, 4, 0, 0), "total_num_heads expected a positive int, got 0"),
    ((16, 0, 4, 2), "head_size expected a positive int, got 0"),
    ((16, 4, 2, 4), r"total_num_kv_heads \(4\) must not exceed total_num_heads \(2\)"),
    ((16, 4, 4, 0), "total_num_kv_heads expected a positive int, got 0"),
])
def test_qkv_sizes_are_checked_at_construction(args: tuple[int, ...], message: str) -> None:
    from opmux.layers.linear import QKVParallelLinear

    with pytest.raises(opmux.OpInputError, match=message):
        QKVParallelLinear(*args)
