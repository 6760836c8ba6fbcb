"""Out-of-tree subclasses of vLLM's layers whose forward paths call opmux ops.

vLLM swaps a ``CustomOp`` class for the one registered with
``CustomOp.register_oot(name=<in-tree class name>)`` when the model builds it; the
replacement must subclass the original. Each class here overrides ``forward_cpu``,
``forward_cuda`` (also reached by ``forward_hip`` / ``forward_xpu``) and ``forward_oot``
with one method that calls the catalog op, so whichever opmux provider wins on the platform
runs -- a vendor plugin's included. ``forward_native`` calls the same op in eager code and
runs vLLM's own native code while torch.compile traces it (custom ops off: Inductor fuses
that code, see :func:`_native_path`). What the op does not cover (an RMSNorm
with ``var_hidden_size``, a weight in another dtype than the input) runs the parent's
``forward_native``. The registered ``name`` stays vLLM's in-tree one (``rms_norm``, ...), so
``compilation_config.custom_ops`` (``"none,+rms_norm"``) keeps working on the replacements.

Only :mod:`opmux.integrations.vllm` imports this module, and only with vLLM installed.

The ops are called through :attr:`opmux.Op.eager`: in eager code the provider is called
without the torch dispatcher's trip, and while torch.compile traces a layer (a custom op
switched on) it is the torch op, one graph node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from vllm.model_executor import custom_op
from vllm.model_executor.layers import activation, layernorm
from vllm.model_executor.layers import rotary_embedding as vllm_rotary

from opmux.integrations.vllm._rope_classes import ROPE_CLASSES
from opmux.ops import activation as act
from opmux.ops.layernorm import (
    fused_add_rms_norm,
    gemma_fused_add_rms_norm,
    gemma_rms_norm,
    rms_norm,
)
from opmux.ops.rotary import rotary_embedding

__all__ = ["LAYER_NAMES", "OpmuxGemmaRMSNorm", "OpmuxRMSNorm", "install", "layer_classes"]

_LOG = logging.getLogger("opmux.integrations.vllm")

_PATHS = ("forward_cpu", "forward_cuda", "forward_oot")


def _with_paths(cls: type) -> type:
    """Point the platform paths of ``cls`` at its ``_opmux_forward``, and its
    ``forward_native`` at :func:`_native_path`."""
    for path in _PATHS:
        setattr(cls, path, cls._opmux_forward)  # type: ignore[attr-defined]
    cls.forward_native = _native_path(cls)  # type: ignore[attr-defined]
    return cls


def _native_path(cls: type) -> Callable[..., Any]:
    """``forward_native`` of ``cls``: the opmux op in eager code; vLLM's own native code
    while torch.compile traces it.

    vLLM switches custom ops off under Inductor so that the layer's native code fuses with
    its neighbours; an opaque op there would only stop that fusion. A custom op switched
    on (``compilation_config.custom_ops=["+rms_norm"]``) runs ``forward_cpu`` & co., which
    call the opmux op under torch.compile as well, as one graph node.
    """

    def forward_native(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # the parent's method, static or not
            return getattr(super(cls, self), "forward_native")(*args, **kwargs)  # noqa: B009
        return self._opmux_forward(*args, **kwargs)

    forward_native.__qualname__ = f"{cls.__qualname__}.forward_native"
    return forward_native


# ------------------------------------------------------------------------- norms
@_with_paths
class OpmuxRMSNorm(layernorm.RMSNorm):  # type: ignore[misc, name-defined]
    """vLLM's ``RMSNorm`` on ``opmux::rms_norm`` / ``opmux::fused_add_rms_norm``."""

    def _opmux_forward(self, x: Tensor, residual: Tensor | None = None
                       ) -> Tensor | tuple[Tensor, Tensor]:
        weight = self.weight.data  # ones when has_weight=False: the same result
        if self.variance_size_override is not None or weight.dtype != x.dtype:
            return super().forward_native(x, residual)  # type: ignore[no-any-return]
        if residual is None:
            return rms_norm.eager(x, weight, self.variance_epsilon)  # type: ignore[no-any-return]
        return fused_add_rms_norm.eager(  # type: ignore[no-any-return]
            x, residual, weight, self.variance_epsilon)


@_with_paths
class OpmuxGemmaRMSNorm(layernorm.GemmaRMSNorm):  # type: ignore[misc, name-defined]
    """vLLM's ``GemmaRMSNorm`` (scale ``1 + weight``) on the gemma norm ops."""

    def _opmux_forward(self, x: Tensor, residual: Tensor | None = None
                       ) -> Tensor | tuple[Tensor, Tensor]:
        weight = self.weight.data
        if weight.dtype != x.dtype:
            return super().forward_native(x, residual)  # type: ignore[no-any-return]
        if residual is None:
            return gemma_rms_norm.eager(  # type: ignore[no-any-return]
                x, weight, self.variance_epsilon)
        return gemma_fused_add_rms_norm.eager(  # type: ignore[no-any-return]
            x, residual, weight, self.variance_epsilon)


# ------------------------------------------------------------------- activations
_ACTIVATIONS: dict[str, tuple[str, Callable[[Any, Tensor], Tensor]]] = {
    # vLLM's registered name: (vLLM class, the call of the opmux op on (layer, x))
    "silu_and_mul": ("SiluAndMul", lambda layer, x: act.silu_and_mul.eager(x)),
    "mul_and_silu": ("MulAndSilu", lambda layer, x: act.mul_and_silu.eager(x)),
    "gelu_and_mul": ("GeluAndMul", lambda layer, x: act.gelu_and_mul.eager(x, layer.approximate)),
    "fatrelu_and_mul": ("FatreluAndMul",
                        lambda layer, x: act.fatrelu_and_mul.eager(x, float(layer.threshold))),
    "swigluoai_and_mul": ("SwigluOAIAndMul", lambda layer, x: act.swigluoai_and_mul.eager(
        x, float(layer.alpha), float(layer.limit))),
    "gelu_new": ("NewGELU", lambda layer, x: act.gelu_new.eager(x)),
    # tanh-approximated GELU is gelu_new's formula
    "gelu_tanh": ("GELUTanh", lambda layer, x: act.gelu_new.eager(x)),
    "gelu_fast": ("FastGELU", lambda layer, x: act.gelu_fast.eager(x)),
    "quick_gelu": ("QuickGELU", lambda layer, x: act.quick_gelu.eager(x)),
    "relu2": ("ReLUSquaredActivation", lambda layer, x: act.relu2.eager(x)),
}


def _activation_class(base: type, call: Callable[[Any, Tensor], Tensor]) -> type:
    def _opmux_forward(self: Any, x: Tensor) -> Tensor:
        return call(self, x)

    name = f"Opmux{base.__name__}"
    cls = type(name, (base,), {
        "_opmux_forward": _opmux_forward,
        "__doc__": f"vLLM's ``{base.__name__}`` on its opmux catalog op.",
        "__module__": __name__,
        "__qualname__": name,
    })
    return _with_paths(cls)


# ------------------------------------------------------------------------ rotary
class _OpmuxRotary:
    """Forward paths of vLLM's ``RotaryEmbedding`` family on ``opmux::rotary_embedding``.

    The platform paths rotate in place and return ``(query, key)`` as vLLM's kernels do;
    ``forward_native`` returns new tensors as vLLM's does.
    """

    head_size: int
    is_neox_style: bool
    _match_cos_sin_cache_dtype: Callable[[Tensor], Tensor]

    def _rotate(self, positions: Tensor, query: Tensor, key: Tensor | None
                ) -> tuple[Tensor, Tensor]:
        # the op takes any positions shape with [*P, H*D] or [*P, H, D] operands; vLLM
        # hands [T] positions with [T, H*D] (or other) operands: pass those as rows
        cache = self._match_cos_sin_cache_dtype(query)
        if positions.dim() != 1:
            positions = positions.flatten()
        tokens = positions.shape[0]
        rows = max(tokens, 1)
        q = query if query.dim() == 2 else query.reshape(tokens, query.numel() // rows)
        k = (query.new_empty((tokens, 0)) if key is None
             else key if key.dim() == 2 else key.reshape(tokens, key.numel() // rows))
        return rotary_embedding.eager(  # type: ignore[no-any-return]
            positions, q, k, cache, self.head_size, self.is_neox_style)

    def forward_native(self, positions: Tensor, query: Tensor, key: Tensor | None = None
                       ) -> tuple[Tensor, Tensor | None]:
        if torch.compiler.is_compiling():  # as _native_path: vLLM's code for Inductor
            return super().forward_native(positions, query, key)  # type: ignore[misc, no-any-return]
        q_out, k_out = self._rotate(positions, query, key)
        return _as(q_out, query), None if key is None else _as(k_out, key)

    def _opmux_forward(self, positions: Tensor, query: Tensor, key: Tensor | None = None
                       ) -> tuple[Tensor, Tensor | None]:
        q_out, k_out = self._rotate(positions, query, key)
        query.copy_(_as(q_out, query))
        if key is not None:
            key.copy_(_as(k_out, key))
        return query, key

    forward_cpu = forward_cuda = forward_oot = _opmux_forward


def _as(out: Tensor, like: Tensor) -> Tensor:
    """``out`` (contiguous, ``like``'s elements) in ``like``'s shape."""
    return out if out.dim() == like.dim() else out.view(like.shape)


def _rotary_class(base: type) -> type:
    name = f"Opmux{base.__name__}"
    return type(name, (_OpmuxRotary, base), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"vLLM's ``{base.__name__}`` on ``opmux::rotary_embedding``."})


# ------------------------------------------------------------------------ tables
def _build() -> dict[str, list[tuple[type, type]]]:
    table: dict[str, list[tuple[type, type]]] = {
        "rms_norm": [(layernorm.RMSNorm, OpmuxRMSNorm)],
        "gemma_rms_norm": [(layernorm.GemmaRMSNorm, OpmuxGemmaRMSNorm)],
    }
    for name, (class_name, call) in _ACTIVATIONS.items():
        base = getattr(activation, class_name, None)
        if base is not None:
            table[name] = [(base, _activation_class(base, call))]
    table["rotary_embedding"] = [
        (base, _rotary_class(base)) for class_name in ROPE_CLASSES
        if (base := getattr(vllm_rotary, class_name, None)) is not None]
    for pairs in table.values():  # importable by name (pickling, reprs)
        for _, cls in pairs:
            globals()[cls.__name__] = cls
    return table


_TABLE = _build()

LAYER_NAMES = tuple(_TABLE)
"""The layer names :func:`install` understands (vLLM's registered custom-op names)."""


def layer_classes(names: Iterable[str]) -> dict[str, list[tuple[type, type]]]:
    """``{name: [(vLLM class, opmux subclass), ...]}`` for the layer names asked for."""
    wanted = set(names)
    return {name: list(pairs) for name, pairs in _TABLE.items() if name in wanted}


def _register(base: type, cls: type) -> bool:
    """Register ``cls`` as vLLM's out-of-tree replacement of ``base``; keep vLLM's name."""
    current = custom_op.op_registry_oot.get(base.__name__)
    if current is not None:
        if current is not cls:
            _LOG.warning("opmux: vLLM's %s is already replaced by %s.%s; leaving it",
                         base.__name__, current.__module__, current.__qualname__)
        return current is cls
    in_tree_name = base.name  # type: ignore[attr-defined]
    custom_op.CustomOp.register_oot(name=base.__name__)(cls)
    cls.name = in_tree_name  # type: ignore[attr-defined]
    return True


def install(names: Iterable[str]) -> list[str]:
    """Register the opmux subclasses of the named layers; return the vLLM classes now
    served by opmux (a class another plugin replaced first is left to it, with a warning)."""
    replaced = []
    for pairs in layer_classes(names).values():
        for base, cls in pairs:
            if _register(base, cls):
                replaced.append(base.__name__)
    return replaced
