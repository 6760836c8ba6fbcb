"""Bad checkpoints and configs get clear errors, before any weight is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import opmux
from opmux.models import ARCHITECTURES, CheckpointError, load_model, read_config
from opmux.models.synthetic import LlamaShape, write_random_llama

SHAPE = LlamaShape(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48, vocab=64)


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    return write_random_llama(tmp_path / "m", SHAPE, seed=1)


def _edit_config(directory: Path, **fields: object) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def _edit_tensors(directory: Path, drop: tuple[str, ...] = (),
                  add: dict[str, torch.Tensor] | None = None) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, str(path))


def test_unknown_architecture_lists_the_known_ones(ckpt: Path) -> None:
    _edit_config(ckpt, architectures=["FalconForCausalLM"])
    with pytest.raises(opmux.ConfigError, match="FalconForCausalLM") as info:
        load_model(ckpt)
    assert all(a in str(info.value) for a in ARCHITECTURES)


def test_missing_tensors_are_named(ckpt: Path) -> None:
    _edit_tensors(ckpt, drop=("model.layers.1.mlp.up_proj.weight", "model.norm.weight"))
    with pytest.raises(CheckpointError, match="2 missing") as info:
        load_model(ckpt)
    assert "model.layers.1.mlp.up_proj.weight" in str(info.value)
    assert "model.norm.weight" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_extra_tensors_are_named(ckpt: Path) -> None:
    _edit_tensors(ckpt, add={"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError,
                       match=r"1 unexpected: model\.layers\.0\.mlp\.extra\.weight"):
        load_model(ckpt)


def test_a_config_with_fewer_layers_than_the_tensors_lists_the_extras(ckpt: Path) -> None:
    _edit_config(ckpt, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"unexpected: model\.layers\.1"):
        load_model(ckpt)


def test_shape_mismatch_names_tensor_and_shapes(ckpt: Path) -> None:
    _edit_tensors(ckpt, add={"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)})
    with pytest.raises(CheckpointError,
                       match=r"k_proj.weight \[8, 32\] \(expected \[16, 32\]\)"):
        load_model(ckpt)


def test_pickle_only_checkpoint_is_refused_unread(tmp_path: Path) -> None:
    write_random_llama(tmp_path, SHAPE)
    (tmp_path / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    # a pickle that would create a file if it were ever loaded
    (tmp_path / "pytorch_model.bin").write_bytes(
        b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(CheckpointError, match=r"pickle.*pytorch_model\.bin"):
        load_model(tmp_path)
    assert not marker.exists()


def test_no_weights_at_all(tmp_path: Path) -> None:
    write_random_llama(tmp_path, SHAPE)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_model(tmp_path)


def test_no_config(tmp_path: Path) -> None:
    with pytest.raises(opmux.ConfigError, match=r"no config\.json"):
        load_model(tmp_path)


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_attention_heads": 0}, "'num_attention_heads' = 0 is out of range"),
    ({"hidden_size": -4}, "'hidden_size' = -4 is out of range"),
    ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    ({"rms_norm_eps": 0.0}, "'rms_norm_eps' = 0.0 is out of range"),
    ({"head_dim": 7}, "head_dim = 7 is out of range"),
    ({"head_dim": 0}, "'head_dim' = 0 is out of range"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None},
     r"hidden_size \(32\) is not a multiple of num_attention_heads \(3\)"),
    ({"num_key_value_heads": 8}, r"num_key_value_heads \(8\) must not exceed"),
    ({"rms_norm_eps": float("inf")}, "'rms_norm_eps' = inf is out of range"),
    ({"vocab_size": 10**11}, "'vocab_size' = 100000000000 is out of range"),
    ({"rope_theta": True}, "rope_theta must be positive"),
    ({"rope_theta": float("nan")}, "rope_theta must be positive"),
    ({"rope_scaling": [1, 2]}, "'rope_scaling' must be an object or null"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, "'factor' must be a finite"),
    ({"eos_token_id": 10**30}, r"'eos_token_id' must be token ids in \[0, vocab_size=64\)"),
    ({"vocab_size": "many"}, "'vocab_size' must be int"),
    ({"hidden_act": "relu"}, "activation 'relu' is not supported"),
    ({"rope_theta": -1.0}, "rope_theta must be positive"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 2,
      "num_experts_per_tok": 3}, "num_experts_per_tok = 3 is out of range"),
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_act": None,
      "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": -1.0},
     "'final_logit_softcapping' = -1.0 is out of range"),
])
def test_config_field_out_of_range(ckpt: Path, fields: dict[str, object], message: str) -> None:
    _edit_config(ckpt, **fields)
    with pytest.raises(opmux.ConfigError, match=message):
        read_config(ckpt)


def test_loader_reads_both_rope_spellings(ckpt: Path) -> None:
    assert read_config(ckpt).rope_parameters["rope_theta"] == 500000.0
    _edit_config(ckpt, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                        "rope_theta": 1000.0})
    params = read_config(ckpt).rope_parameters
    assert params["rope_type"] == "linear" and params["rope_theta"] == 1000.0


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]", r"config\.json: expected a JSON object, got list"),
    ("{\"architectures\": ", r"config\.json: not valid JSON"),
    ("[" * 100_000, r"config\.json: not valid JSON"),
])
def test_config_json_that_is_no_object_names_the_file(ckpt: Path, text: str,
                                                      message: str) -> None:
    (ckpt / "config.json").write_text(text)
    with pytest.raises(opmux.ConfigError, match=message):
        read_config(ckpt)


def test_generation_config_that_is_a_list_names_the_file(ckpt: Path) -> None:
    (ckpt / "generation_config.json").write_text("[]")
    with pytest.raises(opmux.ConfigError, match=r"generation_config\.json: expected a JSON"):
        read_config(ckpt)


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage", "directory", "loop"])
def test_unreadable_weight_files_are_named(ckpt: Path, damage: str) -> None:
    path = ckpt / "model.safetensors"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(b"\xff" * 64)
    elif damage == "directory":
        (ckpt / "x.safetensors").mkdir()
    else:
        (ckpt / "loop.safetensors").symlink_to(ckpt / "loop.safetensors")
    with pytest.raises(CheckpointError, match=r"\.safetensors"):
        load_model(ckpt)


def test_a_tensor_in_two_files_and_integer_weights_are_refused(ckpt: Path) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    save_file({"model.norm.weight": tensors["model.norm.weight"]},
              str(ckpt / "model-2.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is in two files"):
        load_model(ckpt)
    (ckpt / "model-2.safetensors").unlink()
    _edit_tensors(ckpt, add={"model.norm.weight": torch.ones(32, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match=r"floating point, got model\.norm\.weight \(I32\)"):
        load_model(ckpt)


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_position_embeddings": 2**31 - 1}, r"cos/sin cache of .* \(max_position_embeddings="),
    ({"vocab_size": 2**31 - 1}, r"weights of .* \(vocab_size=2147483647"),
])
def test_sizes_that_do_not_fit_are_refused_before_allocating(
        ckpt: Path, fields: dict[str, object], message: str) -> None:
    from opmux.models import MemoryBudgetError

    _edit_config(ckpt, **fields)
    with pytest.raises(MemoryBudgetError, match=message + ".*does not fit the"):
        load_model(ckpt)
