"""Tensor parallelism with a real 2-process gloo group: every layer at TP=2 equals TP=1.

One pair of processes (spawned once per module, with the environment torchrun sets and a
free port on 127.0.0.1, killed after a timeout) runs every case of ``_tp_worker.py``; each
test here compares one case's TP=2 outputs with the same case built in this process,
where no group is initialised (TP=1), or reads one rank-only check's verdict.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import opmux
import opmux.distributed as od

WORKER = Path(__file__).with_name("_tp_worker.py")
_spec = importlib.util.spec_from_file_location("opmux_tests_tp_worker", WORKER)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)
TIMEOUT_S = 150
WORLD = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run both ranks once; ``{"outputs": [rank0, rank1], "verdicts": [...]}``."""
    opmux.load_plugins()  # a first build of the C++ kernels happens here, not in each rank
    out = tmp_path_factory.mktemp("tp2")
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(Path(od.__file__).parents[1]),
                                              os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"TP=2 workers did not finish within {TIMEOUT_S}s (a hung collective?)")
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{logs[rank]}"
    return {
        "outputs": [torch.load(out / f"rank{r}.pt") for r in range(WORLD)],
        "verdicts": [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)],
    }


@pytest.fixture
def tp1() -> Iterator[None]:
    """This process: no group initialised, TP=1."""
    od.destroy_tensor_parallel()
    assert od.get_tensor_model_parallel_world_size() == 1
    yield
    od.destroy_tensor_parallel()


def _verdict(tp2: dict[str, Any], name: str) -> list[str]:
    details = []
    for rank, verdicts in enumerate(tp2["verdicts"]):
        assert verdicts[name]["ok"], f"rank {rank}, {name}:\n{verdicts[name]['detail']}"
        details.append(verdicts[name]["detail"])
    return details


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _case(tp2: dict[str, Any], name: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    _verdict(tp2, name)
    return [tp2["outputs"][r][name] for r in range(WORLD)], worker.LAYER_CASES[name]()


def test_replicated_linear(tp2: dict[str, Any], tp1: None) -> None:
    ranks, ref = _case(tp2, "replicated")
    for got in ranks:
        _close(got["out"], ref["out"])
        _close(got["bias"], ref["bias"])


def test_column_parallel_linear(tp2: dict[str, Any], tp1: None) -> None:
    ranks, ref = _case(tp2, "column")
    for rank, got in enumerate(ranks):
        _close(got["gathered"], ref["gathered"])
        _close(got["local"], ref["local"].chunk(WORLD, -1)[rank])  # this rank's slice


def test_merged_column_and_row_parallel_mlp(tp2: dict[str, Any], tp1: None) -> None:
    ranks, ref = _case(tp2, "mlp")
    gate, up = ref["gate_up_local"].chunk(2, -1)
    for rank, got in enumerate(ranks):
        _close(got["out"], ref["out"])
        want = torch.cat([gate.chunk(WORLD, -1)[rank], up.chunk(WORLD, -1)[rank]], -1)
        _close(got["gate_up_local"], want)


def test_qkv_parallel_linear(tp2: dict[str, Any], tp1: None) -> None:
    ranks, ref = _case(tp2, "qkv")
    for tag, kv in (("gqa", 2), ("mqa", 1)):
        q, k, v = ref[tag].split([32, 8 * kv, 8 * kv], -1)
        for rank, got in enumerate(ranks):
            kv_rank = rank if kv == WORLD else 0  # one KV head is replicated on both ranks
            want = torch.cat([q.chunk(WORLD, -1)[rank],
                              k.chunk(min(kv, WORLD), -1)[kv_rank],
                              v.chunk(min(kv, WORLD), -1)[kv_rank]], -1)
            _close(got[tag], want)


def test_row_parallel_linear(tp2: dict[str, Any], tp1: None) -> None:
    ranks, ref = _case(tp2, "row")
    for got in ranks:
        _close(got["out"], ref["out"])
        _close(got["bias"], ref["bias"])
    # reduce_results=False: partial sums that add up to the bias-free output
    _close(ranks[0]["partial"] + ranks[1]["partial"], ref["partial"])


def test_vocab_parallel_embedding(tp2: dict[str, Any], tp1: None) -> None:
    ranks, ref = _case(tp2, "embedding")
    for got in ranks:
        _close(got["out"], ref["out"])
    assert ranks[1]["padding_rows"].shape == (64 - 36, 8)  # ids 100..127 are padding
    assert not ranks[1]["padding_rows"].any()


def test_parallel_lm_head_and_logits_processor(tp2: dict[str, Any], tp1: None) -> None:
    ranks, ref = _case(tp2, "logits")
    assert ref["plain"].shape == (3, 100)
    for rank, got in enumerate(ranks):
        _close(got["plain"], ref["plain"])
        _close(got["capped"], ref["capped"])
        assert got["local"].shape == (3, 64)  # skip_gather: this rank's padded shard
        _close(got["local"], ref["local"][:, rank * 64:(rank + 1) * 64])


def test_fused_moe(tp2: dict[str, Any], tp1: None) -> None:
    ranks, ref = _case(tp2, "moe")
    for got in ranks:
        for key in ("shared", "fused", "native_shared", "native_fused"):
            _close(got[key], ref[key])


def test_group_from_torchrun_environment(tp2: dict[str, Any]) -> None:
    for detail in _verdict(tp2, "group"):
        assert "already initialised" in detail and "destroy_tensor_parallel" in detail


def test_communication_ops(tp2: dict[str, Any]) -> None:
    for detail in _verdict(tp2, "comm_ops"):
        assert "divisible by the 2 ranks of group 'tp'" in detail


def test_vendor_collective_wins_by_priority(tp2: dict[str, Any]) -> None:
    assert _verdict(tp2, "vendor_provider") == ["ok", "ok"]


def test_fullgraph_compile_has_no_graph_break(tp2: dict[str, Any]) -> None:
    for detail in _verdict(tp2, "compile"):
        assert detail == "graphs=1 breaks=0"


def test_world_size_that_does_not_divide(tp2: dict[str, Any]) -> None:
    detail = _verdict(tp2, "divisibility")[0]
    for what in ("ColumnParallelLinear output_size = 5", "output_sizes[1] = 5",
                 "total_num_heads = 3", "total_num_kv_heads = 3",
                 "RowParallelLinear input_size = 7", "padded vocab size = 99",
                 "ParallelLMHead padded vocab size = 99", "intermediate_size = 5"):
        assert what in detail, what
    assert "not divisible by the tensor-parallel world size 2" in detail
