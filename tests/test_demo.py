"""``opmux demo``: writes a checkpoint, generates through opmux, checks against native."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest
import torch

import opmux
from opmux.cli import demo

_SMALL = ["--layers", "2", "--steps", "4", "--batch", "3", "--hidden", "64", "--heads", "4",
          "--kv-heads", "2", "--vocab", "200", "--block-size", "4", "--device", "cpu"]


def _run(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = demo.run(parser.parse_args(list(argv)), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_demo_json_report(tmp_path: Path) -> None:
    code, out, _ = _run(*_SMALL, "--json", "--model-dir", str(tmp_path))
    report = json.loads(out)
    assert code == 0 and report["ok"] is True
    assert report["max_abs_diff"] <= report["tolerance"]
    assert report["model"]["layers"] == 2 and report["model"]["vocab"] == 200
    assert len(set(report["prompt_lens"])) > 1  # prompt lengths differ per sequence
    assert [len(o) for o in report["outputs"]] == [4, 4, 4]
    assert all(0 <= tok < 200 for row in report["outputs"] for tok in row)
    assert report["tokens_agree"] == report["tokens_total"] == 12
    used = {"rms_norm", "fused_add_rms_norm", "rotary_embedding", "reshape_and_cache",
            "paged_attention", "silu_and_mul", "advance_step_flashattn"}
    assert used == set(report["providers"])
    registered = {op.qualname: set(op.impls) for op in opmux.list_ops()}
    for name, provider in report["providers"].items():
        assert provider in registered[f"opmux::{name}"]
        assert sum(report["calls"][name].values()) > 0
    assert report["tokens_per_s"]["native"] > 0 and report["tokens_per_s"]["selected"] > 0
    # the checkpoint is a real Hugging Face directory, kept when --model-dir is given
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]
    assert (tmp_path / "model.safetensors").is_file()


def test_demo_text_output() -> None:
    code, out, err = _run(*_SMALL)
    assert code == 0, err
    assert "logits vs all-native" in out and "OK" in out and "tokens/s" in out
    assert "paged_attention" in out and "LlamaForCausalLM" in out
    assert err == ""  # no progress bar when stderr is not a TTY


def test_demo_fails_when_a_provider_is_wrong() -> None:
    op = opmux.ops.silu_and_mul

    def off_by_a_bit(x: torch.Tensor) -> torch.Tensor:
        return op.native(x) + 0.05

    op.register_impl("demo_test_wrong", dispatch_key="CPU")(off_by_a_bit)
    try:
        with op.set_priority(["demo_test_wrong"]):
            code, out, _ = _run(*_SMALL, "--json")
    finally:
        op.unregister_impl("demo_test_wrong")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert report["providers"]["silu_and_mul"] == "demo_test_wrong"
    assert report["max_abs_diff"] > report["tolerance"]


def test_demo_rejects_bad_sizes() -> None:
    code, _, err = _run("--hidden", "60", "--heads", "8")
    assert code == 2 and "multiple of --heads" in err


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_demo_low_precision(dtype: str) -> None:
    code, out, _ = _run(*_SMALL, "--dtype", dtype, "--json")
    assert code == 0, out
    assert json.loads(out)["dtype"] == dtype


def test_demo_refuses_a_non_empty_model_dir_unless_forced(tmp_path: Path) -> None:
    root, tmp_path = tmp_path, tmp_path / "ckpt"
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text("{\"mine\": 1}")
    (tmp_path / "tokenizer.json").write_text("{}")
    code, out, err = _run(*_SMALL, "--json", "--model-dir", str(tmp_path))
    assert code == 2 and out == ""
    assert "is not empty (holds config.json, tokenizer.json)" in err and "--force" in err
    assert (tmp_path / "config.json").read_text() == "{\"mine\": 1}"
    code, out, err = _run(*_SMALL, "--json", "--model-dir", str(tmp_path), "--force")
    assert code == 0, err
    # replaced whole: the foreign tokenizer.json is gone, nothing is left beside the folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in root.iterdir()] == ["ckpt"]


def test_demo_model_dir_appears_whole_or_not_at_all(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from opmux.models import synthetic

    def broken(directory: Path, *args: object, **kwargs: object) -> Path:
        (Path(directory) / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(synthetic, "write_random_llama", broken)
    target = tmp_path / "new"
    with pytest.raises(OSError, match="No space"):
        _run(*_SMALL, "--model-dir", str(target))
    assert list(tmp_path.iterdir()) == []


def test_demo_rejects_a_file_as_model_dir_and_a_bad_device(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    code, _, err = _run(*_SMALL, "--model-dir", str(tmp_path / "f"))
    assert code == 2 and "is not a directory" in err
    code, _, err = _run(*_SMALL[:-2], "--device", "nope")
    assert code == 2 and "--device 'nope' is not a torch device" in err


def test_demo_sizes_are_checked_before_anything_is_written(tmp_path: Path) -> None:
    code, _, err = _run("--hidden", "65536", "--heads", "1024", "--vocab", "16000000",
                        "--model-dir", str(tmp_path / "m"))
    assert code == 2 and "random checkpoint of" in err and "lower --layers" in err
    assert not (tmp_path / "m").exists()
    with pytest.raises(SystemExit):
        _run("--seed", "99999999999999999999999")
