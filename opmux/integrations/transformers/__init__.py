"""opmux inside Hugging Face transformers: a loaded model's layers run on opmux ops.

>>> from opmux.integrations import transformers as opmux_tf
>>> model = opmux_tf.enable(model)        # doctest: +SKIP
>>> model.generate(ids, max_new_tokens=32) # doctest: +SKIP
>>> model = opmux_tf.disable(model)       # doctest: +SKIP

:func:`enable` works in place on a Llama, Qwen2, Mixtral or Gemma2 model (``config.model_type``
in :data:`SUPPORTED_MODEL_TYPES`) and returns it. It swaps the class of the RMSNorm, MLP,
attention, experts and decoder-layer modules for ``Opmux*`` subclasses whose forwards call
``rms_norm`` / ``gemma_rms_norm``, the fused-add norms, ``silu_and_mul`` / ``gelu_and_mul``,
``rotary_embedding``, ``fused_moe`` and ``paged_attention`` (prefill and decode, GQA, sliding
window, soft cap, padding masks), and of every plain ``nn.Linear`` for one on
:func:`opmux.layers.dense_linear`. The model's config is not changed: it keeps its
``attn_implementation`` and ``experts_implementation``, whose functions run wherever an op
does not express the call (autograd, attention weights asked for, another dtype, a custom
rotary table, a traced or meta model), so each fallback is transformers' own code.

What :func:`enable` did is kept on the model itself, so a deep copy or a pickled and loaded
enabled model is enabled too and :func:`disable` undoes it there. It also registers the
attention implementation :data:`ATTN_IMPLEMENTATION` (``"opmux"``, usable by hand on any
model), the continuous-batching variant :data:`PAGED_ATTN_IMPLEMENTATION` and the experts
implementation :data:`EXPERTS_IMPLEMENTATION` in transformers' interfaces.

Every op runs on the provider that wins on the platform (``cpp`` on CPU, a vendor plugin's
where installed and preferred). The page ``docs/transformers.md`` tells what is replaced,
what falls back, and why.
"""

from __future__ import annotations

import threading
from typing import Any, Final

from opmux.core.errors import OpmuxError

__all__ = ["ATTN_IMPLEMENTATION", "EXPERTS_IMPLEMENTATION", "PAGED_ATTN_IMPLEMENTATION",
           "SUPPORTED_MODEL_TYPES", "UnsupportedModelError", "disable", "enable", "is_enabled"]

ATTN_IMPLEMENTATION: Final = "opmux"
"""The ``attn_implementation`` :func:`enable` registers: attention on ``paged_attention``
with ``sdpa``'s masks and fallback, for a model set to it by hand (an enabled model keeps its
own implementation and runs the same path from its attention modules)."""

PAGED_ATTN_IMPLEMENTATION: Final = "opmux_paged_flash"
"""The implementation an enabled model switches to while continuous batching runs.

transformers 5.23's continuous batching admits only ``"paged|eager"``, ``"sdpa"`` and names
containing ``"flash"``, its mark of a mask-free variable-length kernel (it then hands the
attention cumulative sequence lengths and builds no masks), which is what
``paged_attention`` is. :func:`enable` wraps the model's ``init_continuous_batching`` (the
entry point of ``generate_batch``) to switch to this name; the batching manager switches
back to the model's implementation when it stops, as after its own switch to flash attention.
"""

EXPERTS_IMPLEMENTATION: Final = "opmux"
"""The ``experts_implementation`` :func:`enable` registers (``fused_moe``, else the experts
class's own forward), for a model set to it by hand; an enabled model's experts modules run
``fused_moe`` themselves."""

SUPPORTED_MODEL_TYPES: Final = ("gemma2", "llama", "mixtral", "qwen2")
"""``config.model_type`` values :func:`enable` accepts."""


class UnsupportedModelError(OpmuxError, TypeError):
    """:func:`enable` was given a model whose architecture it does not know."""

    __module__ = "opmux.integrations.transformers"


#: the instance attribute that marks an enabled model (its value: ``True``)
_MARK: Final = "_opmux_enabled"
_LOCK = threading.Lock()
_REGISTERED: list[bool] = [False]


def _unwrap(model: Any) -> Any:
    """The model inside a ``torch.compile`` wrapper (``OptimizedModule._orig_mod``)."""
    inner = getattr(model, "__dict__", {}).get("_modules", {}).get("_orig_mod")
    return inner if inner is not None and type(model).__name__ == "OptimizedModule" else model


def is_enabled(model: Any) -> bool:
    """Whether :func:`enable` was applied to ``model`` (and not undone); ``False`` for any
    other object."""
    return getattr(_unwrap(model), "__dict__", {}).get(_MARK) is True


def _register() -> None:
    """Register the functions in transformers' interfaces (process-wide, once)."""
    if _REGISTERED[0]:
        return
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    from opmux.integrations.transformers import _attention

    _attention.PAGED_NAME[0] = PAGED_ATTN_IMPLEMENTATION
    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention.attention_forward)
    AttentionInterface.register(PAGED_ATTN_IMPLEMENTATION, _attention.paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _attention.experts_forward)
    _REGISTERED[0] = True


def _unsupported(func: str, model: Any, model_type: Any) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"opmux.integrations.transformers.{func}() supports transformers models of the types "
        f"{sorted(SUPPORTED_MODEL_TYPES)} (or torch.compile of one); got "
        f"{type(model).__name__} with model_type {model_type!r}")


def enable(model: Any) -> Any:
    """Run ``model`` on opmux ops (in place); returns ``model``. Enabling twice is a no-op.

    :param model: a transformers ``PreTrainedModel`` of a supported architecture
        (``LlamaForCausalLM``, ``Qwen2Model``, ``MixtralForCausalLM``, ...), or
        ``torch.compile`` of one (the compiled module's model is enabled).
    :raises UnsupportedModelError: for another architecture or object.
    """
    from transformers import PreTrainedModel

    from opmux.integrations.transformers import _layers

    inner = _unwrap(model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    arch = _layers.ARCHS.get(model_type) if isinstance(model_type, str) else None
    if not isinstance(inner, PreTrainedModel) or arch is None:
        raise _unsupported("enable", model, model_type)
    with _LOCK:
        if is_enabled(inner):
            return model
        import importlib

        importlib.import_module(arch.module)
        swaps = []
        for module in inner.modules():
            sub = _layers.subclass_for(type(module), arch)
            if sub is not None:
                swaps.append((module, sub))
        _register()
        for module, sub in swaps:
            module.__class__ = sub
        if hasattr(type(inner), "init_continuous_batching"):
            # an instance attribute (nn.Module keeps it in __dict__), removed by disable()
            inner.__dict__["init_continuous_batching"] = _ContinuousBatchingEntry(inner)
        inner.__dict__[_MARK] = True
    return model


def disable(model: Any) -> Any:
    """Undo :func:`enable` on ``model`` (in place); returns ``model``. A supported model that
    is not enabled is returned unchanged. The registered implementations stay registered.

    :raises UnsupportedModelError: for an object that is not a transformers model.
    """
    from transformers import PreTrainedModel

    from opmux.integrations.transformers import _layers

    inner = _unwrap(model)
    if not isinstance(inner, PreTrainedModel):
        raise _unsupported("disable", model,
                           getattr(getattr(inner, "config", None), "model_type", None))
    with _LOCK:
        if not is_enabled(inner):
            return model
        for module in inner.modules():
            original = _layers.original_class(type(module))
            if original is not None:
                module.__class__ = original
        inner.__dict__.pop("init_continuous_batching", None)
        del inner.__dict__[_MARK]
    return model


class _ContinuousBatchingEntry:
    """``model.init_continuous_batching`` of an enabled model: the batching manager runs
    :data:`PAGED_ATTN_IMPLEMENTATION` and restores the model's implementation when it stops.
    An object (not a bound function), so the model deep-copies and pickles."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        original = type(model).init_continuous_batching
        config = model.config
        previous = config._attn_implementation
        if previous not in ("sdpa", "eager", ATTN_IMPLEMENTATION):
            return original(model, *args, **kwargs)
        # set directly: set_attn_implementation would look for a flash-attention kernel of
        # that name (the name only tells continuous batching what the function accepts)
        config._attn_implementation = PAGED_ATTN_IMPLEMENTATION
        try:
            manager = original(model, *args, **kwargs)
        except BaseException:
            config._attn_implementation = previous
            raise
        if getattr(manager, "_original_attn_impl", previous) is None:
            # what the manager does after its own switch to flash attention: stop() restores
            manager._original_attn_impl = previous
        return manager
