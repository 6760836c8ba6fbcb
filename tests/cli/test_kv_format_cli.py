"""``opmux explain`` and ``opmux info`` show the KV-cache format an engine would allocate."""

from __future__ import annotations

import json

import pytest

from opmux.cli import main

_ARGV = ["explain", "paged_attention", "--shape", "3,4,16", "--shape", "4,8,2,16",
         "--shape", "4,8,2,16", "--shape", "2,2", "--shape", "2", "--shape", "3",
         "--dtype", "float32", "--dtype", "float32", "--dtype", "float32", "--dtype", "int32",
         "--arg", "scale=0.25"]


def test_explain_prints_the_format(fresh_plugins: None, capsys: pytest.CaptureFixture[str]
                                   ) -> None:
    assert main(_ARGV) == 0
    out = capsys.readouterr().out
    assert "kv_cache_format(cpu, torch.float32, head_size=16, num_kv_heads=2, block_size=8): " \
           "'canonical'" in out
    assert main([*_ARGV, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "'canonical' (preferred by" in data["kv_cache_format"]


def test_info_lists_the_formats(fresh_plugins: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    kv = data["kv_cache_formats"]
    assert {"canonical", "hnd"} <= set(kv["registered"])
    assert kv["preferred"]["float32"] == "canonical"
    assert main(["info"]) == 0
    assert "KV-cache formats: canonical, hnd" in capsys.readouterr().out
