"""opmux inside Hugging Face transformers: a loaded model's layers run on opmux ops.

>>> from opmux.integrations import transformers as opmux_tf
>>> model = opmux_tf.enable(model)        # doctest: +SKIP
>>> model.generate(ids, max_new_tokens=32) # doctest: +SKIP
>>> model = opmux_tf.disable(model)       # doctest: +SKIP

:func:`enable` works in place on a Llama, Qwen2, Mixtral or Gemma2 model (``config.model_type``
in :data:`SUPPORTED_MODEL_TYPES`) and returns it. It

* registers the attention implementation :data:`ATTN_IMPLEMENTATION` (``"opmux"``) in
  transformers' ``AttentionInterface`` and ``AttentionMaskInterface``, and the
  continuous-batching variant :data:`PAGED_ATTN_IMPLEMENTATION`, and sets the model to
  ``"opmux"`` (``model.set_attn_implementation``): attention runs on
  ``opmux.ops.paged_attention`` (prefill and decode, GQA, sliding window, soft cap);
* registers the experts implementation ``"opmux"`` (``ExpertsInterface``) and sets Mixtral
  models to it: the experts run on ``opmux.ops.fused_moe``;
* swaps the class of the RMSNorm, MLP, attention and decoder-layer modules for ``Opmux*``
  subclasses whose forwards call ``rms_norm`` / ``gemma_rms_norm``, the fused-add norms,
  ``silu_and_mul`` / ``gelu_and_mul`` and ``rotary_embedding``.

Every op runs on the provider that wins on the platform (``cpp`` on CPU, a vendor plugin's
where installed and preferred). What an op does not express (a padding mask, autograd,
dropout, attention weights asked for, another dtype, a custom rotary table) runs
transformers' own code instead. :func:`disable` puts the classes and implementations back.
The page ``docs/transformers.md`` tells what is replaced, what falls back, and why.
"""

from __future__ import annotations

import threading
import types
import weakref
from typing import Any, Final

from opmux.core.errors import OpmuxError

__all__ = ["ATTN_IMPLEMENTATION", "EXPERTS_IMPLEMENTATION", "PAGED_ATTN_IMPLEMENTATION",
           "SUPPORTED_MODEL_TYPES", "UnsupportedModelError", "disable", "enable", "is_enabled"]

ATTN_IMPLEMENTATION: Final = "opmux"
"""The ``attn_implementation`` :func:`enable` registers and sets."""

PAGED_ATTN_IMPLEMENTATION: Final = "opmux_paged_flash"
"""The implementation an enabled model switches to while continuous batching runs.

transformers 5.23's continuous batching admits only ``"paged|eager"``, ``"sdpa"`` and names
containing ``"flash"``, its mark of a mask-free variable-length kernel (it then hands the
attention cumulative sequence lengths and builds no masks), which is what
``paged_attention`` is. :func:`enable` wraps the model's ``init_continuous_batching`` (the
entry point of ``generate_batch``) to switch to this name; the batching manager switches
back to ``"opmux"`` when it stops, as it does after its own switch to flash attention.
"""

EXPERTS_IMPLEMENTATION: Final = "opmux"
"""The ``experts_implementation`` :func:`enable` registers and sets on MoE models."""

SUPPORTED_MODEL_TYPES: Final = ("gemma2", "llama", "mixtral", "qwen2")
"""``config.model_type`` values :func:`enable` accepts."""


class UnsupportedModelError(OpmuxError, TypeError):
    """:func:`enable` was given a model whose architecture it does not know."""

    __module__ = "opmux.integrations.transformers"


class _State:
    __slots__ = ("attn", "experts", "swaps")

    def __init__(self, attn: Any, experts: Any, swaps: list[tuple[Any, type]]) -> None:
        self.attn = attn          # the attn_implementation before enable
        self.experts = experts    # the experts_implementation before enable (MoE), or None
        self.swaps = swaps        # (module, its class before enable)


_LOCK = threading.Lock()
_ENABLED: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
_REGISTERED: list[bool] = [False]


def is_enabled(model: Any) -> bool:
    """Whether :func:`enable` was applied to ``model`` (and not undone)."""
    return model in _ENABLED


def _register() -> None:
    """Register the functions in transformers' interfaces (process-wide, once)."""
    if _REGISTERED[0]:
        return
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from opmux.integrations.transformers import _attention

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention.attention_forward)
    AttentionInterface.register(PAGED_ATTN_IMPLEMENTATION, _attention.paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _attention.mask_interface)
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _attention.experts_forward)
    _REGISTERED[0] = True


def enable(model: Any) -> Any:
    """Run ``model`` on opmux ops (in place); returns ``model``. Enabling twice is a no-op.

    :param model: a transformers ``PreTrainedModel`` of a supported architecture
        (``LlamaForCausalLM``, ``Qwen2Model``, ``MixtralForCausalLM``, ...).
    :raises UnsupportedModelError: for another architecture or object.
    """
    from transformers import PreTrainedModel

    from opmux.integrations.transformers import _attention, _layers

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    arch = _layers.ARCHS.get(model_type) if isinstance(model_type, str) else None
    if not isinstance(model, PreTrainedModel) or arch is None:
        raise UnsupportedModelError(
            f"opmux.integrations.transformers.enable() supports model types "
            f"{sorted(SUPPORTED_MODEL_TYPES)}; got {type(model).__name__} with model_type "
            f"{model_type!r}")
    with _LOCK:
        if model in _ENABLED:
            return model
        import importlib

        importlib.import_module(arch.module)
        swaps = []
        for module in model.modules():
            sub = _layers.subclass_for(type(module), arch)
            if sub is not None:
                swaps.append((module, type(module), sub))
        _register()
        config = model.config
        attn = config._attn_implementation
        fallback = attn if attn in ("eager", "sdpa") else "sdpa"
        if getattr(config, "attn_logit_softcapping", None) is not None:
            fallback = "eager"  # transformers' sdpa refuses a soft cap
        experts = getattr(config, "_experts_implementation", None) if model_type == "mixtral" \
            else None
        _attention.remember_config(config, fallback, experts)
        try:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            if experts is not None:
                model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        except Exception:
            _attention.forget_config(config)
            raise
        for module, _, sub in swaps:
            module.__class__ = sub
        if hasattr(type(model), "init_continuous_batching"):
            # an instance attribute (nn.Module keeps it in __dict__), removed by disable()
            model.__dict__["init_continuous_batching"] = types.MethodType(
                _init_continuous_batching, model)
        _ENABLED[model] = _State(attn, experts, [(m, cls) for m, cls, _ in swaps])
    return model


def disable(model: Any) -> Any:
    """Undo :func:`enable` on ``model`` (in place); returns ``model``. A model that is not
    enabled is returned unchanged. The registered implementations stay registered."""
    from opmux.integrations.transformers import _attention

    with _LOCK:
        state = _ENABLED.pop(model, None)
        if state is None:
            return model
        for module, cls in state.swaps:
            module.__class__ = cls
        model.__dict__.pop("init_continuous_batching", None)
        if model.config._attn_implementation != state.attn:
            model.set_attn_implementation(state.attn)
        if state.experts is not None:
            model.set_experts_implementation(state.experts)
        _attention.forget_config(model.config)
    return model


def _init_continuous_batching(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``model.init_continuous_batching`` of an enabled model: the batching manager runs
    :data:`PAGED_ATTN_IMPLEMENTATION` and restores ``"opmux"`` when it stops."""
    original = type(model).init_continuous_batching
    config = model.config
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        return original(model, *args, **kwargs)
    # set directly: set_attn_implementation would look for a flash-attention kernel of
    # that name (the name only tells continuous batching what the function accepts)
    config._attn_implementation = PAGED_ATTN_IMPLEMENTATION
    try:
        manager = original(model, *args, **kwargs)
    except BaseException:
        config._attn_implementation = ATTN_IMPLEMENTATION
        raise
    if getattr(manager, "_original_attn_impl", ATTN_IMPLEMENTATION) is None:
        # what the manager does after its own switch to flash attention: stop() restores
        manager._original_attn_impl = ATTN_IMPLEMENTATION
    return manager
