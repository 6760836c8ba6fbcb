"""Model configuration: the fields of a Hugging Face ``config.json`` that the models read.

One :class:`ModelConfig` serves every architecture; :func:`read_config` parses and checks
it (every field in range, heads dividing), so a bad checkpoint fails before any weight is
read. Both spellings of the rope settings are accepted: ``rope_theta`` + ``rope_scaling``
(transformers 4) and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from opmux.core.errors import ConfigError

__all__ = ["ARCHITECTURES", "ModelConfig", "read_config", "read_json_object"]

ARCHITECTURES: Final = ("Gemma2ForCausalLM", "LlamaForCausalLM", "MixtralForCausalLM",
                        "Qwen2ForCausalLM")
"""The ``architectures`` entries :mod:`opmux.models` builds."""


@dataclass(frozen=True)
class ModelConfig:
    """What a decoder needs from ``config.json``, checked.

    :ivar sliding_windows: per layer, the attention window or ``None`` (full attention).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope_parameters: dict[str, Any]
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    attn_scale: float = 1.0
    sliding_windows: tuple[int | None, ...] = field(default_factory=tuple)
    gemma: bool = False


_MAX_INT: Final = 2**31 - 1
"""Upper bound of every integer field (token ids and positions are int32 in the kernels)."""


def _get(raw: dict[str, Any], key: str, kind: type, default: Any = ..., *,
         low: float | None = 1) -> Any:
    value: Any = raw.get(key, default)
    if value is ...:
        raise ConfigError(f"config.json: field {key!r} is missing")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ConfigError(f"config.json: field {key!r} must be {kind.__name__}, got {value!r}")
    return _in_range(key, kind, value, low)


def _in_range(key: str, kind: type, value: Any, low: float | None) -> Any:
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"config.json: field {key!r} = {value} is out of range (expected a "
                          f"finite number)")
    if low is not None and kind in (int, float) and value < low:
        raise ConfigError(f"config.json: field {key!r} = {value} is out of range "
                          f"(expected >= {low})")
    if kind is int and value > _MAX_INT:
        raise ConfigError(f"config.json: field {key!r} = {value} is out of range "
                          f"(expected <= {_MAX_INT})")
    return value


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``.

    :raises opmux.ConfigError: the file cannot be read, is not JSON (or nested too deep),
        or holds something other than an object; the message names the file.
    """
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{path}: not valid JSON ({str(exc)[:120] or type(exc).__name__})"
                          ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _token_id(value: Any, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab


def _eos(raw: dict[str, Any], directory: Path, vocab: int) -> tuple[int, ...]:
    value = raw.get("eos_token_id")
    where = "config.json"
    gen = directory / "generation_config.json"
    if gen.is_file():
        gen_raw = read_json_object(gen)
        if "eos_token_id" in gen_raw:
            value, where = gen_raw["eos_token_id"], "generation_config.json"
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(_token_id(i, vocab) for i in ids):
        raise ConfigError(f"{where}: field 'eos_token_id' must be token ids in "
                          f"[0, vocab_size={vocab}), got {str(value)[:80]}")
    return tuple(ids)


def _number(params: dict[str, Any], key: str, where: str, *, positive: bool = True) -> None:
    value = params.get(key)
    if value is None:
        return
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value) or (positive and value <= 0)):
        raise ConfigError(f"config.json: {where} {key!r} must be a finite number"
                          f"{' > 0' if positive else ''}, got {value!r}")


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ConfigError(f"config.json: field {key!r} must be an object or null, got "
                              f"{str(raw[key])[:80]}")
    params = dict(raw.get("rope_parameters") or {})
    where = "rope_parameters"
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
        where = "rope_scaling"
    theta = params.get("rope_theta", 10000.0)
    if not isinstance(theta, int | float) or isinstance(theta, bool) \
            or not math.isfinite(theta) or theta <= 0:
        raise ConfigError(f"config.json: rope_theta must be positive (a finite number), got "
                          f"{theta!r}")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                "original_max_position_embeddings", "partial_rotary_factor"):
        _number(params, key, where)
    return params


def read_config(directory: str | Path) -> ModelConfig:
    """Parse and check ``directory/config.json``.

    :raises opmux.ConfigError: no ``config.json``, an unknown architecture (the known ones
        are listed), or a field missing, of the wrong type or out of range.
    """
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory}: no config.json (expected a Hugging Face checkpoint "
                          f"directory)")
    raw = read_json_object(path)
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    arch = next((a for a in archs if isinstance(a, str) and a in ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(f"{path}: architecture {archs!r} is not supported; known: "
                          f"{', '.join(ARCHITECTURES)}")
    hidden = _get(raw, "hidden_size", int)
    heads = _get(raw, "num_attention_heads", int)
    kv_heads = _get(raw, "num_key_value_heads", int, heads)
    if raw.get("head_dim") is not None:
        head_dim = _get(raw, "head_dim", int)
    elif hidden % heads:
        raise ConfigError(f"config.json: hidden_size ({hidden}) is not a multiple of "
                          f"num_attention_heads ({heads}) and no head_dim is given; fix one "
                          f"of them or give head_dim")
    else:
        head_dim = hidden // heads
    layers = _get(raw, "num_hidden_layers", int)
    if kv_heads > heads:
        raise ConfigError(f"config.json: num_key_value_heads ({kv_heads}) must not exceed "
                          f"num_attention_heads ({heads})")
    if heads % kv_heads:
        raise ConfigError(f"config.json: num_attention_heads ({heads}) must be a multiple of "
                          f"num_key_value_heads ({kv_heads})")
    if head_dim % 2:
        raise ConfigError(f"config.json: head_dim = {head_dim} is out of range (must be even "
                          f"for rotary embeddings)")
    eps = _get(raw, "rms_norm_eps", float, 1e-6, low=None)
    if not eps > 0:
        raise ConfigError(f"config.json: field 'rms_norm_eps' = {eps} is out of range "
                          f"(expected > 0)")
    vocab = _get(raw, "vocab_size", int)
    common: dict[str, Any] = dict(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=_get(raw, "intermediate_size", int), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=eps,
        max_position=_get(raw, "max_position_embeddings", int, 4096),
        rope_parameters=_rope(raw), eos_token_ids=_eos(raw, directory, vocab),
        tie_word_embeddings=_get(raw, "tie_word_embeddings", bool,
                                 arch == "Gemma2ForCausalLM"),
        attn_scale=head_dim ** -0.5, sliding_windows=(None,) * layers)
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if arch == "Qwen2ForCausalLM":
        common["qkv_bias"] = True
        if raw.get("use_sliding_window"):
            raise ConfigError("config.json: use_sliding_window=true (Qwen2) is not supported")
    elif arch == "MixtralForCausalLM":
        experts = _get(raw, "num_local_experts", int)
        top_k = _get(raw, "num_experts_per_tok", int)
        if top_k > experts:
            raise ConfigError(f"config.json: num_experts_per_tok = {top_k} is out of range "
                              f"(at most num_local_experts = {experts})")
        common.update(num_experts=experts, experts_per_token=top_k)
        if raw.get("sliding_window") is not None:
            common["sliding_windows"] = (_get(raw, "sliding_window", int),) * layers
    elif arch == "Gemma2ForCausalLM":
        window = _get(raw, "sliding_window", int, 4096)
        types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0
                                           else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers:
            raise ConfigError(f"config.json: layer_types must be a list of {layers} entries "
                              f"(one per layer), got {str(types)[:80]}")
        scalar = _get(raw, "query_pre_attn_scalar", float, float(head_dim), low=None)
        if not scalar > 0:
            raise ConfigError(f"config.json: field 'query_pre_attn_scalar' = {scalar} is out "
                              f"of range (expected > 0)")
        act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
        attn_cap = raw.get("attn_logit_softcapping")
        final_cap = raw.get("final_logit_softcapping")
        for key, cap in (("attn_logit_softcapping", attn_cap),
                         ("final_logit_softcapping", final_cap)):
            if cap is not None and not (isinstance(cap, int | float) and not isinstance(
                    cap, bool) and math.isfinite(cap) and cap > 0):
                raise ConfigError(f"config.json: field {key!r} = {cap!r} is out of range "
                                  f"(expected > 0 or null)")
        common.update(gemma=True, attn_scale=scalar ** -0.5,
                      attn_soft_cap=None if attn_cap is None else float(attn_cap),
                      final_soft_cap=None if final_cap is None else float(final_cap),
                      sliding_windows=tuple(window if t == "sliding_attention" else None
                                            for t in types))
    expected_act = "gelu_pytorch_tanh" if arch == "Gemma2ForCausalLM" else "silu"
    if act != expected_act and not (arch == "Gemma2ForCausalLM" and act == "gelu_tanh"):
        raise ConfigError(f"config.json: activation {act!r} is not supported for {arch} "
                          f"(expected {expected_act!r})")
    return ModelConfig(**common)
