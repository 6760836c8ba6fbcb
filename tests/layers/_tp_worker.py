"""One rank of the tensor-parallel tests: run by ``test_tensor_parallel_tp2.py`` as a
subprocess with the environment ``torchrun`` would set (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), or imported for its case builders (the TP=1 side of each comparison).

Every layer case builds its layer, loads FULL checkpoint tensors through the layer's
``weight_loader`` and returns this rank's output. The worker writes
``rank{r}.pt`` (outputs) and ``rank{r}.json`` (check verdicts) into the directory given
as its only argument.
"""

# no ``from __future__ import annotations``: check_vendor_provider registers an impl whose
# annotations opmux turns into a torch schema
import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

import opmux
import opmux.distributed as od
import opmux.layers as ol
from opmux.core.forward_context import forward_context


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _w(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed)) * 0.3


# ---------------------------------------------------------------- layer cases
# Each returns this rank's output (a tensor or a dict of tensors).
def case_replicated() -> dict[str, torch.Tensor]:
    layer = ol.ReplicatedLinear(16, 12, bias=True, skip_bias_add=True)
    layer.weight_loader(layer.weight, _w(1, 12, 16))
    layer.weight_loader(layer.bias, _w(2, 12))  # type: ignore[arg-type]
    out, bias = layer(_w(3, 5, 16))
    return {"out": out, "bias": bias}


def case_column() -> dict[str, torch.Tensor]:
    gathered = ol.ColumnParallelLinear(16, 24, bias=True, gather_output=True)
    local = ol.ColumnParallelLinear(16, 24, bias=True, return_bias=False)
    for layer in (gathered, local):
        layer.weight.weight_loader(layer.weight, _w(11, 24, 16))  # type: ignore[attr-defined]
        layer.bias.weight_loader(layer.bias, _w(12, 24))  # type: ignore[union-attr]
    x = _w(13, 2, 3, 16)
    out, bias = gathered(x)
    assert bias is None
    return {"gathered": out, "local": local(x)}


def case_mlp() -> dict[str, torch.Tensor]:
    """Llama's MLP: merged gate/up (per-shard loads) + SiLU-and-mul + row-parallel down."""
    gate_up = ol.MergedColumnParallelLinear(16, [20, 20], bias=False)
    fused_on_disk = ol.MergedColumnParallelLinear(16, [20, 20], bias=False)
    down = ol.RowParallelLinear(20, 16, bias=True)
    gate, up = _w(21, 20, 16), _w(22, 20, 16)
    gate_up.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight_loader(gate_up.weight, up, 1)
    fused_on_disk.weight_loader(fused_on_disk.weight, torch.cat([gate, up]))
    assert torch.equal(gate_up.weight, fused_on_disk.weight)
    down.weight_loader(down.weight, _w(23, 16, 20))
    down.weight_loader(down.bias, _w(24, 16))  # type: ignore[arg-type]
    x = _w(25, 7, 16)
    h, _ = gate_up(x)
    act = opmux.ops.silu_and_mul(h)
    out, _ = down(act)
    return {"gate_up_local": h, "out": out}


def case_qkv() -> dict[str, torch.Tensor]:
    """GQA (4 query, 2 KV heads) loaded per shard and fused; MQA (1 KV head, replicated)."""
    result = {}
    for tag, kv in (("gqa", 2), ("mqa", 1)):
        qkv = ol.QKVParallelLinear(32, 8, 4, kv, bias=True)
        fused = ol.QKVParallelLinear(32, 8, 4, kv, bias=True)
        q, k, v = _w(31, 32, 32), _w(32, 8 * kv, 32), _w(33, 8 * kv, 32)
        bq, bk, bv = _w(34, 32), _w(35, 8 * kv), _w(36, 8 * kv)
        for shard, w, b in (("q", q, bq), ("k", k, bk), ("v", v, bv)):
            qkv.weight_loader(qkv.weight, w, shard)
            qkv.weight_loader(qkv.bias, b, shard)  # type: ignore[arg-type]
        fused.weight_loader(fused.weight, torch.cat([q, k, v]))
        fused.weight_loader(fused.bias, torch.cat([bq, bk, bv]))  # type: ignore[arg-type]
        assert torch.equal(qkv.weight, fused.weight) and torch.equal(qkv.bias, fused.bias)
        out, _ = qkv(_w(37, 5, 32))
        result[tag] = out
    return result


def case_row() -> dict[str, torch.Tensor]:
    full_in = ol.RowParallelLinear(24, 10, bias=True, input_is_parallel=False)
    partial = ol.RowParallelLinear(24, 10, bias=True, skip_bias_add=True, reduce_results=False)
    for layer in (full_in, partial):
        layer.weight_loader(layer.weight, _w(41, 10, 24))
        layer.weight_loader(layer.bias, _w(42, 10))  # type: ignore[arg-type]
    x = _w(43, 4, 24)
    out, _ = full_in(x)
    size, rank = partial.input_size_per_partition, partial.tp_rank
    part, bias = partial(x[:, rank * size:(rank + 1) * size])
    return {"out": out, "partial": part, "bias": bias}


def case_embedding() -> dict[str, torch.Tensor]:
    emb = ol.VocabParallelEmbedding(100, 8)
    emb.weight_loader(emb.weight, _w(51, 100, 8))
    ids = torch.tensor([[0, 1, 63, 64], [65, 98, 99, 5]])
    return {"out": emb(ids), "padding_rows": emb.weight[emb.shard_indices.num_org_elements:]}


def case_logits() -> dict[str, torch.Tensor]:
    head = ol.ParallelLMHead(100, 8, bias=True)
    head.weight_loader(head.weight, _w(61, 100, 8))
    head.weight_loader(head.bias, _w(62, 100))  # type: ignore[arg-type]
    hidden = _w(63, 3, 8)
    plain = ol.LogitsProcessor(100)(head, hidden)
    capped = ol.LogitsProcessor(100, scale=0.5, soft_cap=0.4)(head, hidden, head.bias)
    local = ol.LogitsProcessor(100)(head, hidden, None, True)
    return {"plain": plain, "capped": capped, "local": local}


def case_moe() -> dict[str, torch.Tensor]:
    layer = ol.FusedMoE(8, 2, 16, 24, layer_name="moe", shared_intermediate_size=16)
    w13, w2 = _w(71, 8, 48, 16), _w(72, 8, 16, 24)
    for e in range(8):  # per expert, vLLM-style shard ids
        layer.weight_loader(layer.w13_weight, w13[e, :24], "w1", "w1", e)
        layer.weight_loader(layer.w13_weight, w13[e, 24:], "w3", "w3", e)
        layer.weight_loader(layer.w2_weight, w2[e], "w2", "w2", e)
    stacked = ol.FusedMoE(8, 2, 16, 24, layer_name="moe_stacked", shared_intermediate_size=16)
    stacked.weight_loader(stacked.w13_weight, w13)
    stacked.weight_loader(stacked.w2_weight, w2)
    assert torch.equal(stacked.w13_weight, layer.w13_weight)
    assert torch.equal(stacked.w2_weight, layer.w2_weight)
    assert layer.shared_experts is not None
    layer.weight_loader(layer.gate_weight, _w(73, 8, 16))
    layer.weight_loader(layer.shared_experts.gate_up_weight, _w(74, 32, 16))
    layer.weight_loader(layer.shared_experts.down_weight, _w(75, 16, 16))
    x = _w(76, 2, 3, 16)
    with torch.no_grad(), forward_context(layers={"moe": layer}):
        shared, fused = layer(x)
        n_shared, n_fused = layer.forward_native(x)
    assert shared is not None
    return {"shared": shared, "fused": fused, "native_shared": n_shared,
            "native_fused": n_fused}


LAYER_CASES: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "replicated": case_replicated, "column": case_column, "mlp": case_mlp, "qkv": case_qkv,
    "row": case_row, "embedding": case_embedding, "logits": case_logits, "moe": case_moe,
}


# ------------------------------------------------------------ rank-only checks
def check_group(rank: int) -> str:
    tp = od.get_tp_group()
    assert (tp.rank, tp.world_size, tp.name, tp.backend) == (rank, 2, "tp", "gloo"), tp
    assert od.get_tensor_model_parallel_rank() == rank
    assert od.get_tensor_model_parallel_world_size() == 2
    try:
        od.init_tensor_parallel()
    except od.DistributedError as exc:
        return str(exc)
    raise AssertionError("a second init_tensor_parallel did not raise")


def check_comm_ops(rank: int) -> str:
    ops = opmux.ops
    xs = [torch.arange(24.0).reshape(4, 6) * (r + 1) for r in range(2)]
    x = xs[rank]
    torch.testing.assert_close(ops.all_reduce(x, "tp"), xs[0] + xs[1], rtol=0, atol=0)
    torch.testing.assert_close(ops.all_reduce(x.t(), "tp"), (xs[0] + xs[1]).t())  # strided
    torch.testing.assert_close(ops.all_reduce(x.bfloat16(), "tp"), (xs[0] + xs[1]).bfloat16())
    for dim in (0, 1, -1):
        torch.testing.assert_close(ops.all_gather(x, dim, "tp"), torch.cat(xs, dim))
    for dim in (0, 1):
        want = (xs[0] + xs[1]).chunk(2, dim)[rank]
        torch.testing.assert_close(ops.reduce_scatter(x, dim, "tp"), want)
    assert ops.all_reduce(x, "tp") is not x and torch.equal(x, xs[rank])  # input untouched
    owned = x.clone()
    ops.all_reduce_(owned, "tp")
    torch.testing.assert_close(owned, xs[0] + xs[1], rtol=0, atol=0)
    torch.testing.assert_close(ops.all_reduce(torch.zeros(0, 3), "tp"), torch.zeros(0, 3))
    try:
        ops.reduce_scatter(torch.ones(3, 2), 0, "tp")
    except opmux.OpInputError as exc:
        return str(exc)
    raise AssertionError("reduce_scatter of 3 rows over 2 ranks did not raise")


def check_vendor_provider(rank: int) -> str:
    """A vendor collective registered for CPU wins by priority and really runs."""
    op = opmux.ops.all_reduce
    calls = []

    def gather_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
        calls.append(group_name)
        return opmux.ops.all_gather(x.unsqueeze(0), 0, group_name).sum(0)

    op.register_impl("test_gather_sum", dispatch_key="CPU")(gather_sum)
    try:
        with op.set_priority(["test_gather_sum", "native"]):
            x = torch.full((3,), float(rank + 1))
            assert op.dispatch(x, "tp").provider == "test_gather_sum"
            out = op(x, "tp")
        torch.testing.assert_close(out, torch.full((3,), 3.0))
        with op.set_priority(["native"]):  # priority alone decides
            assert op.dispatch(x, "tp").provider == "native"
            torch.testing.assert_close(op(x, "tp"), torch.full((3,), 3.0))
        assert calls == ["tp"], calls
    finally:
        op.unregister_impl("test_gather_sum")
    assert op.dispatch(x, "tp").provider == "native"
    # the layers reduce in place: a vendor's in-place collective serves them
    inplace = opmux.ops.all_reduce_
    inplace_calls = []

    def gather_sum_(x: torch.Tensor, group_name: str) -> None:
        inplace_calls.append(group_name)
        x.copy_(opmux.ops.all_gather(x.unsqueeze(0), 0, group_name).sum(0))

    inplace.register_impl("test_gather_sum_", dispatch_key="CPU")(gather_sum_)
    try:
        row = ol.RowParallelLinear(8, 4, bias=False, input_is_parallel=False, return_bias=False)
        row.weight_loader(row.weight, _w(91, 4, 8))
        x = _w(92, 3, 8)
        with inplace.set_priority(["native"]):
            want = row(x)
        with inplace.set_priority(["test_gather_sum_", "native"]):
            got = row(x)
        torch.testing.assert_close(got, want)
        assert inplace_calls == ["tp"], inplace_calls
    finally:
        inplace.unregister_impl("test_gather_sum_")
    return "ok"


def check_compile(rank: int) -> str:
    """fullgraph=True over layers that call the comm ops: no graph break at TP=2."""
    col = ol.ColumnParallelLinear(8, 6, bias=False, gather_output=True, return_bias=False)
    row = ol.RowParallelLinear(6, 8, bias=True, input_is_parallel=False, return_bias=False)
    col.weight_loader(col.weight, _w(81, 6, 8))
    row.weight_loader(row.weight, _w(82, 8, 6))
    row.weight_loader(row.bias, _w(83, 8))  # type: ignore[arg-type]

    def model(x: torch.Tensor) -> torch.Tensor:
        return row(col(x))  # type: ignore[no-any-return]

    from torch import _dynamo
    from torch._dynamo.utils import counters

    _dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # breaks would raise
    x = _w(84, 3, 8)
    torch.testing.assert_close(compiled(x), model(x))
    breaks = sum(counters["graph_break"].values())
    return f"graphs={counters['stats']['unique_graphs']} breaks={breaks}"


def check_divisibility(rank: int) -> str:
    messages = []
    builders: list[Callable[[], Any]] = [
        lambda: ol.ColumnParallelLinear(16, 5),
        lambda: ol.MergedColumnParallelLinear(16, [4, 5]),
        lambda: ol.QKVParallelLinear(32, 8, 3, 1),
        lambda: ol.QKVParallelLinear(32, 8, 4, 3),
        lambda: ol.RowParallelLinear(7, 4),
        lambda: ol.VocabParallelEmbedding(99, 8, padding_size=1),
        lambda: ol.ParallelLMHead(99, 8, padding_size=1),
        lambda: ol.FusedMoE(4, 2, 8, 5, layer_name="odd"),
    ]
    for build in builders:
        try:
            build()
        except od.ParallelSizeError as exc:
            assert isinstance(exc, ValueError) and isinstance(exc, opmux.OpmuxError)
            messages.append(str(exc))
        else:
            raise AssertionError(f"no ParallelSizeError from {build}")
    return "\n".join(messages)


RANK_CHECKS: dict[str, Callable[[int], str]] = {
    "group": check_group, "comm_ops": check_comm_ops, "vendor_provider": check_vendor_provider,
    "compile": check_compile, "divisibility": check_divisibility,
}


def main(out_dir: str) -> int:
    rank = int(os.environ["RANK"])
    od.init_tensor_parallel(timeout=datetime.timedelta(seconds=60))
    verdicts: dict[str, dict[str, Any]] = {}
    outputs: dict[str, Any] = {}
    for name, case in LAYER_CASES.items():
        try:
            outputs[name] = {k: v.detach() for k, v in case().items()}  # plain tensors
            verdicts[name] = {"ok": True, "detail": ""}
        except Exception:
            verdicts[name] = {"ok": False, "detail": traceback.format_exc()}
    for name, check in RANK_CHECKS.items():
        try:
            verdicts[name] = {"ok": True, "detail": check(rank)}
        except Exception:
            verdicts[name] = {"ok": False, "detail": traceback.format_exc()}
    torch.save(outputs, os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(verdicts, f)
    od.destroy_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
