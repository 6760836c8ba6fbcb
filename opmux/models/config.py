"""Model configuration: the fields of a Hugging Face ``config.json`` that the models read.

One :class:`ModelConfig` serves every architecture; :func:`read_config` parses and checks
it (every field in range, heads dividing), so a bad checkpoint fails before any weight is
read. Both spellings of the rope settings are accepted: ``rope_theta`` + ``rope_scaling``
(transformers 4) and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from opmux.core.errors import ConfigError

__all__ = ["ARCHITECTURES", "ModelConfig", "read_config"]

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


def _get(raw: dict[str, Any], key: str, kind: type, default: Any = ..., *,
         low: float | None = 1) -> Any:
    value = raw.get(key, default)
    if value is ...:
        raise ConfigError(f"config.json: field {key!r} is missing")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ConfigError(f"config.json: field {key!r} must be {kind.__name__}, got {value!r}")
    if low is not None and kind in (int, float) and isinstance(value, int | float) \
            and value < low:
        raise ConfigError(f"config.json: field {key!r} = {value} is out of range "
                          f"(expected >= {low})")
    return value


def _eos(raw: dict[str, Any], directory: Path) -> tuple[int, ...]:
    value = raw.get("eos_token_id")
    gen = directory / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id", value)
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"config.json: field 'eos_token_id' must be token ids, got {value!r}")
    return tuple(ids)


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    theta = params.get("rope_theta", 10000.0)
    if not isinstance(theta, int | float) or theta <= 0:
        raise ConfigError(f"config.json: rope_theta must be positive, got {theta!r}")
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
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(f"{path}: architecture {archs!r} is not supported; known: "
                          f"{', '.join(ARCHITECTURES)}")
    hidden = _get(raw, "hidden_size", int)
    heads = _get(raw, "num_attention_heads", int)
    kv_heads = _get(raw, "num_key_value_heads", int, heads)
    head_dim = raw.get("head_dim") or hidden // heads
    head_dim = _get({"head_dim": head_dim}, "head_dim", int)
    layers = _get(raw, "num_hidden_layers", int)
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
    common: dict[str, Any] = dict(
        architecture=arch, vocab_size=_get(raw, "vocab_size", int), hidden_size=hidden,
        intermediate_size=_get(raw, "intermediate_size", int), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=eps,
        max_position=_get(raw, "max_position_embeddings", int, 4096),
        rope_parameters=_rope(raw), eos_token_ids=_eos(raw, directory),
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
        if len(types) != layers:
            raise ConfigError(f"config.json: layer_types has {len(types)} entries for "
                              f"{layers} layers")
        scalar = _get(raw, "query_pre_attn_scalar", float, float(head_dim), low=None)
        if not scalar > 0:
            raise ConfigError(f"config.json: field 'query_pre_attn_scalar' = {scalar} is out "
                              f"of range (expected > 0)")
        act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
        attn_cap = raw.get("attn_logit_softcapping")
        final_cap = raw.get("final_logit_softcapping")
        for key, cap in (("attn_logit_softcapping", attn_cap),
                         ("final_logit_softcapping", final_cap)):
            if cap is not None and not (isinstance(cap, int | float) and cap > 0):
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
