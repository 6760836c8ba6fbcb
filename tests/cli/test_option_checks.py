"""Bad option values end a command with one line naming the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opmux.cli import main
from opmux.models.synthetic import LlamaShape, write_random_llama


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = LlamaShape(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=32, vocab=64,
                       max_position=8)
    return write_random_llama(tmp_path_factory.mktemp("m"), shape)


@pytest.mark.parametrize(("argv", "message"), [
    (["--block-size", "100000000"], "argument --block-size: must be an integer in 1..65536"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["--top-p", "0"], "argument --top-p: must be a finite number in (0, 1]"),
    (["--seed", str(2**64)], "argument --seed: must be an integer in 0..9223372036854775807"),
    (["--tp", "0"], "argument --tp: must be an integer in 1..1024"),
    (["--prompt-ids", "1,-2"], "argument --prompt-ids: expected comma-separated token ids"),
    (["--prompt", "caf\udce9"], "argument --prompt: is not valid UTF-8 text"),
    (["--dist-timeout", "-1"], "argument --dist-timeout: must be a finite number"),
])
def test_generate_options(ckpt: Path, argv: list[str], message: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(ckpt), "--max-tokens", "1", "--prompt-ids", "1",
              *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and err.count("\n") == 1


def test_a_prompt_of_max_position_with_no_new_tokens_is_taken(
        ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(ckpt), "--max-tokens", "0", "--prompt-ids",
                 ",".join(["1"] * 8), "--json"]) == 0, capsys.readouterr().err


def test_a_broken_tokenizer_is_named(ckpt: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / "tokenizer.json").write_text("{\"model\": 3}")
    try:
        assert main(["generate", "--model", str(ckpt), "--max-tokens", "1",
                     "--prompt", "hi"]) == 2
    finally:
        (ckpt / "tokenizer.json").unlink()
    err = capsys.readouterr().err
    assert "tokenizer.json: not a tokenizers file" in err and err.count("\n") == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["explain", "rms_norm", "--shape=-4,8", "--shape", "8"],
     "--shape '-4,8': a shape is sizes >= 0"),
    (["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--arg", "eps=-1"],
     "opmux::rms_norm rejects these arguments"),
    (["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--arg", "eps=abc"],
     "opmux::rms_norm rejects these arguments"),
    (["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--dtype", "int8"],
     "opmux::rms_norm rejects these arguments"),
    (["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--device", "nope"],
     "--device 'nope' is not a torch device"),
    (["tune", "--ops", "", "--dry-run"], "--ops '' names no op"),
    (["tune", "--ops", "rms_norm", "--shape", "rms_norm=-4x8,8", "--dry-run"],
     "a shape is sizes >= 0"),
])
def test_explain_and_tune_options(argv: list[str], message: str, fresh_plugins: None,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here")
def test_explain_on_a_missing_device(fresh_plugins: None,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--device",
                 "cuda"]) == 2
    assert "no cuda device here" in capsys.readouterr().err


def test_tune_repeat_zero_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["tune", "--repeat", "0", "--dry-run"])
    assert "argument --repeat: must be an integer in 1..100000" in capsys.readouterr().err


_NO_CUDA = pytest.mark.skipif(__import__("torch").cuda.is_available(),
                              reason="a CUDA device is here")
_DEMO = ["demo", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
         "--vocab", "64", "--steps", "2", "--batch", "1"]


@pytest.mark.parametrize(("argv", "message"), [
    (["check", "--op", "rms_norm", "--device", "nonsense"],
     "opmux check: --device 'nonsense' is not a torch device"),
    (["check", "--op", "rms_norm", "--device", "meta"], "meta tensors hold no values"),
    pytest.param(["check", "--op", "rms_norm", "--device", "cuda"], "no cuda device here",
                 marks=_NO_CUDA),
    (["check", "--op", "rms_norm", "--json", "--label", " "], "--label must not be empty"),
    (["bench", "--op", "rms_norm", "--device", "nonsense"], "not a torch device"),
    (["bench", "--op", "rms_norm", "--device", "meta"], "meta tensors hold no values"),
    (["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--shape", "3"],
     "takes 2 Tensor argument(s): give one --shape"),
    (["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--dtype", "fp32",
      "--dtype", "fp32", "--dtype", "fp32"], "takes 2 Tensor argument(s)"),
    (["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--device", "cpu:x"],
     "is not a torch device"),
])
def test_devices_and_shapes_are_checked_before_any_work(
        argv: list[str], message: str, fresh_plugins: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1
    assert captured.out == ""


@pytest.mark.parametrize("repeat", ["0", "-3"])
def test_bench_repeat_below_one_is_refused(repeat: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--op", "rms_norm", "--repeat", repeat])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --repeat: must be an integer in 1..100000" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(("device", "message"), [
    ("meta", "meta tensors hold no values"),
    pytest.param("cuda", "no cuda device here", marks=_NO_CUDA),
    ("nonsense", "is not a torch device")])
def test_demo_device_is_checked_before_the_checkpoint_is_written(
        device: str, message: str, tmp_path: Path, fresh_plugins: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "model"
    assert main([*_DEMO, "--device", device, "--model-dir", str(target)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_explain_never_allocates_the_tensors(fresh_plugins: None,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # 40000 x 40000 float32 is 6.4 GB: explained from fake tensors, nothing is allocated
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(["explain", "rms_norm", "--shape", "40000,40000", "--shape", "40000",
                 "--json"]) == 0
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert json.loads(capsys.readouterr().out)["op"] == "opmux::rms_norm"
    assert grown_kb < 1 << 20  # far below the 6.4 GB the real tensor would take
