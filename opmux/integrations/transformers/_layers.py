"""Forwards that run a transformers model's layers on opmux ops.

:func:`subclass_for` makes, once per transformers class, a subclass whose ``forward`` calls
the op and whose ``super().forward`` is transformers' own code, run whenever the op does not
apply (autograd, a dtype the op does not keep, hooks that a fused path would skip, ...).
``enable`` swaps an instance's ``__class__`` to it, ``disable`` swaps it back
(:func:`original_class`). The subclasses are attributes of this module by name
(``OpmuxLlamaRMSNorm``, made on first access), so an enabled model pickles and loads back.

The ops are called through :attr:`opmux.Op.eager` (the provider chosen from the tensor's
device, without the torch dispatcher's boxing of the arguments); under ``torch.compile``
that is the op's torch overload.
"""

from __future__ import annotations

import abc
import functools
import sys
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from torch import Tensor, nn
from transformers import activations

import opmux.ops as ops
from opmux.integrations.transformers import _attention
from opmux.layers import dense_linear

__all__ = ["ARCHS", "Arch", "OpmuxLinear", "original_class", "subclass_for"]


class Arch:
    """What differs between the supported architectures."""

    __slots__ = ("attention_kwargs", "gemma", "module", "prefix")

    def __init__(self, module: str, prefix: str, gemma: bool,
                 attention_kwargs: Callable[[Any], dict[str, Any]]) -> None:
        #: the modeling module, e.g. ``transformers.models.llama.modeling_llama``
        self.module = module
        #: class-name prefix, e.g. ``"Llama"``
        self.prefix = prefix
        #: Gemma's ``(1 + weight)`` norms and norm-around-block decoder layer
        self.gemma = gemma
        #: the keyword arguments the architecture's attention passes beyond Llama's
        self.attention_kwargs = attention_kwargs


def _no_kwargs(attn: Any) -> dict[str, Any]:
    return {}


def _layer_window(attn: Any) -> dict[str, Any]:
    return {"sliding_window": attn.sliding_window}


def _config_window(attn: Any) -> dict[str, Any]:
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


def _gemma_kwargs(attn: Any) -> dict[str, Any]:
    return {"sliding_window": attn.sliding_window, "softcap": attn.attn_logit_softcapping}


ARCHS: dict[str, Arch] = {
    "llama": Arch("transformers.models.llama.modeling_llama", "Llama", False, _no_kwargs),
    "qwen2": Arch("transformers.models.qwen2.modeling_qwen2", "Qwen2", False, _layer_window),
    "mixtral": Arch("transformers.models.mixtral.modeling_mixtral", "Mixtral", False,
                    _config_window),
    "gemma2": Arch("transformers.models.gemma2.modeling_gemma2", "Gemma2", True,
                   _gemma_kwargs),
}
"""``config.model_type`` → :class:`Arch`, for the architectures :func:`enable` supports."""


def _grad(*tensors: Tensor) -> bool:
    """Autograd would record this call (the ops have no backward) or the tensors carry no
    data (meta, FakeTensorMode): transformers' code runs."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return _attention.traced(tensors[0]) and not torch.compiler.is_compiling()


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


# ----------------------------------------------------------------------------------- norms
class _RMSNorm(nn.Module):
    """Llama-style ``weight * rms_norm(x)`` on ``opmux.ops.rms_norm``.

    transformers rounds the normalised value to ``x.dtype`` before the weight multiply;
    the op multiplies in fp32 and rounds once (the same in fp32). A weight of another
    dtype than ``x`` (transformers then returns the promoted dtype) runs transformers' code.
    """

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: Tensor) -> Tensor:
        weight = self.weight
        if weight.dtype != hidden_states.dtype or _grad(hidden_states, weight):
            return super().forward(hidden_states)  # type: ignore[no-any-return]
        return ops.rms_norm.eager(hidden_states, weight,  # type: ignore[no-any-return]
                                  self.variance_epsilon)


class _GemmaRMSNorm(nn.Module):
    """Gemma's ``(1 + weight) * rms_norm(x)`` (all in fp32) on ``opmux.ops.gemma_rms_norm``."""

    weight: nn.Parameter
    eps: float

    def forward(self, x: Tensor) -> Tensor:
        if _grad(x, self.weight):
            return super().forward(x)  # type: ignore[no-any-return]
        return ops.gemma_rms_norm.eager(x, self.weight, self.eps)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------- linear
class OpmuxLinear(nn.Linear):
    """``nn.Linear`` on :func:`opmux.layers.dense_linear`: oneDNN's matmul where it is much
    faster than ``F.linear`` (float32, 1-64 rows, a weight of 2**20 elements or more, more
    than one thread), ``F.linear`` otherwise."""

    def forward(self, input: Tensor) -> Tensor:
        return dense_linear(input, self.weight, self.bias)


# ------------------------------------------------------------------------------ activation
def _gated_op(act: nn.Module) -> tuple[Any, tuple[Any, ...]] | None:
    """The catalog op computing ``act(gate) * up`` from ``[gate, up]``, with its extra
    arguments, for transformers' activation module ``act``; ``None`` if there is none."""
    kind = type(act)
    if kind in (activations.SiLUActivation, nn.SiLU):
        return ops.silu_and_mul, ()
    fn = getattr(act, "act", None)
    if kind is activations.GELUTanh and isinstance(fn, functools.partial) \
            and fn.func is nn.functional.gelu and fn.keywords == {"approximate": "tanh"}:
        return ops.gelu_and_mul, ("tanh",)
    if kind is activations.GELUActivation and fn is nn.functional.gelu:
        return ops.gelu_and_mul, ("none",)
    return None


def _gate_up(x: Tensor, gate: nn.Module, up: nn.Module) -> Tensor:
    """``[gate(x), up(x)]`` along the last dimension, the input of the gated activation op.

    Plain linear layers run as :func:`~opmux.layers.dense_linear` and the halves are
    concatenated: in one process, two ``F.linear`` and a ``cat`` beat two ``torch.mm``
    writing the halves of one buffer, at the sizes of ``benchmarks/transformers_cpu.py``.
    """
    if not (_plain_linear(gate) and _plain_linear(up)):
        return torch.cat((gate(x), up(x)), dim=-1)
    return torch.cat((dense_linear(x, gate.weight, gate.bias),
                      dense_linear(x, up.weight, up.bias)), dim=-1)


def _plain_linear(module: nn.Module) -> TypeGuard[nn.Linear]:
    return type(module) in (nn.Linear, OpmuxLinear) and not _hooked(module)


class _GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``act(gate) * up`` on ``silu_and_mul`` or
    ``gelu_and_mul`` (Llama, Qwen2, Gemma2 MLPs)."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: nn.Module

    def forward(self, x: Tensor) -> Tensor:
        act, gate = self.act_fn, self.gate_proj  # each submodule read once: nn.Module.__getattr__
        spec = _gated_op(act)
        weight = gate.weight
        if spec is None or _hooked(act) or weight.dtype != x.dtype or _grad(x, weight):
            return super().forward(x)  # type: ignore[no-any-return]
        op, extra = spec
        hidden = op.eager(_gate_up(x, gate, self.up_proj), *extra)
        return self.down_proj(hidden)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------- rotary
#: the last step's (cos, sin, batch, cos_sin_cache or None, positions): every layer of a
#: forward gets the same position embeddings, so the cache is built once per step
_ROPE_MEMO: list[tuple[Tensor, Tensor, int, Tensor | None, Tensor | None]] = []
#: (rows of cos, tokens, batch, device) -> the positions that read those rows in order
_POSITIONS: dict[tuple[int, int, int, torch.device], Tensor] = {}


def _rope_inputs(cos: Tensor, sin: Tensor, batch: int) -> tuple[Tensor | None, Tensor | None]:
    """The ``cos_sin_cache`` and ``positions`` of ``rotary_embedding`` for the model's own
    ``cos``/``sin [B or 1, S, D]``, or ``(None, None)`` when they are not neox-style rows.

    Built once per step, on the first layer, from one ``stack``, one ``equal`` and (for
    several rows) one copy, the cheapest way measured on a decode step of
    ``benchmarks/transformers_cpu.py``'s tiny model.
    """
    for memo in _ROPE_MEMO:
        if memo[0] is cos and memo[1] is sin and memo[2] == batch:
            return memo[3], memo[4]
    cache: Tensor | None = None
    positions: Tensor | None = None
    if (cos.dim() == 3 and sin.shape == cos.shape and cos.shape[0] in (1, batch)
            and cos.shape[-1] % 2 == 0):
        rows, tokens, dim = cos.shape
        n = rows * tokens
        # [n, low|high half, cos|sin, D/2]: neox style needs each row's halves equal
        # (transformers' cat((freqs, freqs))); a row of the cache is its low cos|sin
        pairs = torch.stack((cos.reshape(n, 2, dim // 2), sin.reshape(n, 2, dim // 2)), dim=2)
        if torch.equal(pairs[:, 0], pairs[:, 1]):
            cache = pairs[:, 0].reshape(n, dim).contiguous()  # no copy for one row
            positions = _positions(rows, tokens, batch, cos.device)
    _ROPE_MEMO[:] = [(cos, sin, batch, cache, positions)]
    return cache, positions


def _positions(rows: int, tokens: int, batch: int, device: torch.device) -> Tensor:
    """``[batch, tokens]`` indices of the cache rows built from ``[rows, tokens]`` cos/sin
    (memoised: the same for every step of a decode)."""
    key = (rows, tokens, batch, device)
    positions = _POSITIONS.get(key)
    if positions is None:
        if len(_POSITIONS) > 64:
            _POSITIONS.clear()
        positions = torch.arange(rows * tokens, device=device).view(rows, tokens)
        positions = _POSITIONS[key] = positions.expand(batch, -1)
    return positions


def _rotate(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor
            ) -> tuple[Tensor, Tensor] | None:
    """``query``/``key [B, S, H, D]`` rotated by ``opmux.ops.rotary_embedding`` from the
    model's own ``cos``/``sin [B or 1, S, D]``; ``None`` when the op does not apply."""
    if cos.dtype != query.dtype or cos.shape[-1] != query.shape[-1] \
            or cos.shape[-2] != query.shape[1] or _grad(query, key) \
            or _attention.traced(cos):
        return None  # (the table check reads the data of cos and sin)
    cache, positions = _rope_inputs(cos, sin, query.shape[0])
    if cache is None or positions is None:
        return None
    return ops.rotary_embedding.eager(  # type: ignore[no-any-return]
        positions, query, key, cache, query.shape[-1], True)


# ------------------------------------------------------------------------------- attention
class _Attention(nn.Module):
    """The architectures' attention forward with the rotary embedding on
    ``opmux.ops.rotary_embedding`` and the attention on
    :func:`~opmux.integrations.transformers._attention.module_attention` (``paged_attention``
    where it expresses the call, else the implementation the config names)."""

    config: Any
    head_dim: int
    layer_idx: int
    scaling: float
    attention_dropout: float
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    _opmux_arch: Arch
    _opmux_modeling: Any

    def forward(self, hidden_states: Tensor,
                position_embeddings: tuple[Tensor, Tensor] | None = None,
                attention_mask: Tensor | None = None, past_key_values: Any = None,
                **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        modeling = self._opmux_modeling
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is None:
            raise TypeError(f"{type(self).__name__}.forward needs position_embeddings")
        cos, sin = position_embeddings
        rotated = _rotate(query, key, cos, sin)
        if rotated is None:
            query, key = modeling.apply_rotary_pos_emb(query.transpose(1, 2),
                                                       key.transpose(1, 2), cos, sin)
        else:
            query, key = rotated[0].transpose(1, 2), rotated[1].transpose(1, 2)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        output, weights = _attention.module_attention(
            self, query, key, value, attention_mask,
            dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
            **self._opmux_arch.attention_kwargs(self), **kwargs)
        output = output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(output), weights


# ---------------------------------------------------------------------------- decoder layer
def _fusable(norm: Any, x: Tensor, kind: type) -> bool:
    return issubclass(type(norm), kind) and not _hooked(norm) and not _grad(x, norm.weight) \
        and (kind is _GemmaRMSNorm or norm.weight.dtype == x.dtype)


class _FusedDecoderLayer(nn.Module):
    """A decoder layer whose residual add after attention is fused with the norm named
    ``_fused_norm`` (an instance of ``_fused_kind``); any other call runs the model's own
    forward."""

    _fused_norm: str
    _fused_kind: type
    input_layernorm: nn.Module
    self_attn: nn.Module
    mlp: nn.Module

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        norm = getattr(self, self._fused_norm)
        if args or not _fusable(norm, hidden_states, self._fused_kind):
            return super().forward(hidden_states, *args, **kwargs)  # type: ignore[no-any-return]
        attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                     **kwargs)
        return self._after_attention(norm, attended, hidden_states)

    @abc.abstractmethod
    def _after_attention(self, norm: Any, attended: Tensor, residual: Tensor) -> Tensor:
        """The rest of the layer, from the attention's output and the layer's input."""


class _DecoderLayer(_FusedDecoderLayer):
    """Llama / Qwen2 / Mixtral layer: the residual add after attention and the
    post-attention norm in one ``fused_add_rms_norm``."""

    _fused_norm = "post_attention_layernorm"
    _fused_kind = _RMSNorm

    def _after_attention(self, norm: Any, attended: Tensor, residual: Tensor) -> Tensor:
        if attended.dtype != residual.dtype:  # autocast: the add promotes, as in transformers
            residual = residual + attended
            return residual + self.mlp(norm(residual))  # type: ignore[no-any-return]
        hidden_states, residual = ops.fused_add_rms_norm.eager(
            attended, residual, norm.weight, norm.variance_epsilon)
        return residual + self.mlp(hidden_states)  # type: ignore[no-any-return]


class _GemmaDecoderLayer(_FusedDecoderLayer):
    """Gemma2 layer: the residual add after the post-attention norm and the pre-feedforward
    norm in one ``gemma_fused_add_rms_norm``."""

    _fused_norm = "pre_feedforward_layernorm"
    _fused_kind = _GemmaRMSNorm
    post_attention_layernorm: nn.Module
    post_feedforward_layernorm: nn.Module

    def _after_attention(self, norm: Any, attended: Tensor, residual: Tensor) -> Tensor:
        attended = self.post_attention_layernorm(attended)
        if attended.dtype != residual.dtype:  # autocast: the add promotes, as in transformers
            residual = residual + attended
            hidden_states = norm(residual)
        else:
            hidden_states, residual = ops.gemma_fused_add_rms_norm.eager(
                attended, residual, norm.weight, norm.eps)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return residual + hidden_states  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------- experts
class _Experts(nn.Module):
    """MoE experts on ``opmux.ops.fused_moe`` where it computes them (SiLU, ``[gate; up]``
    weights, no bias, no autograd); otherwise the forward of transformers' class, which runs
    the experts implementation the config names."""

    def forward(self, hidden_states: Tensor, top_k_index: Tensor,
                top_k_weights: Tensor) -> Tensor:
        if _attention.fused_moe_applies(self, hidden_states):
            return ops.fused_moe.eager(  # type: ignore[no-any-return]
                hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index)
        return super().forward(hidden_states, top_k_index,  # type: ignore[no-any-return]
                               top_k_weights)


# ------------------------------------------------------------------------------- subclasses
_SUBCLASSES: dict[type, type] = {}


def _roles(arch: Arch) -> dict[str, type]:
    """transformers class name → the mixin replacing its forward."""
    p = arch.prefix
    return {
        f"{p}RMSNorm": _GemmaRMSNorm if arch.gemma else _RMSNorm,
        f"{p}MLP": _GatedMLP,
        f"{p}Attention": _Attention,
        f"{p}DecoderLayer": _GemmaDecoderLayer if arch.gemma else _DecoderLayer,
        f"{p}Experts": _Experts,
    }


def subclass_for(cls: type, arch: Arch) -> type | None:
    """The opmux subclass of ``cls`` (``Opmux<Name>``; :class:`OpmuxLinear` for
    ``nn.Linear``), or ``None`` for a class opmux does not replace. ``cls`` must be the
    architecture's own class or ``nn.Linear`` itself (not a user subclass)."""
    if cls is nn.Linear:
        return OpmuxLinear
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub
    modeling = sys.modules.get(arch.module)
    mixin = _roles(arch).get(cls.__name__)
    if mixin is None or modeling is None or getattr(modeling, cls.__name__, None) is not cls:
        return None
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": f"Opmux{cls.__name__}",
                                 "_opmux_base": cls}
    if mixin is _Attention:
        namespace["_opmux_arch"] = arch
        namespace["_opmux_modeling"] = modeling
    sub = type(f"Opmux{cls.__name__}", (mixin, cls), namespace)
    if mixin is _Attention:
        _attention.EAGER_FUNCTIONS[sub] = modeling.eager_attention_forward
    _SUBCLASSES[cls] = sub
    return sub


def original_class(cls: type) -> type | None:
    """The transformers class (or ``nn.Linear``) an opmux subclass replaced, else ``None``."""
    if cls is OpmuxLinear:
        return nn.Linear
    base = cls.__dict__.get("_opmux_base")
    return base if isinstance(base, type) else None


def __getattr__(name: str) -> type:
    """``Opmux<Name>`` for a class :func:`subclass_for` replaces (what pickle looks up)."""
    import importlib

    for arch in ARCHS.values():
        wanted = name.removeprefix(f"Opmux{arch.prefix}")
        if name.startswith("Opmux") and f"{arch.prefix}{wanted}" in _roles(arch):
            modeling = importlib.import_module(arch.module)
            sub = subclass_for(getattr(modeling, f"{arch.prefix}{wanted}"), arch)
            if sub is not None:
                return sub
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
