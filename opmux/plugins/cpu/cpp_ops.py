"""The ``cpp`` provider: opmux's C++ CPU kernels (``csrc/cpu``) behind the native signatures.

Each impl allocates its outputs (``torch.empty_like``) and calls the matching out-variant in
``torch.ops.opmux_cpu``. The kernels check their arguments before writing anything and raise
``ValueError``; the impls re-raise it as :class:`opmux.OpInputError` (the message already names
op, provider, argument, expected and got). Each ``supports_args`` predicate accepts exactly what
the kernel handles (CPU tensors, fp32/bf16/fp16, the layouts it reads); anything else falls
through to the next provider in the priority list.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from opmux.core.errors import OpInputError
from opmux.ops._checks import (
    check_advance_step_flashattn,
    check_paged_attention,
    check_reshape_and_cache,
)

from . import _build

__all__ = [
    "OPS",
    "advance_step_flashattn",
    "fused_add_rms_norm",
    "gelu_and_mul",
    "paged_attention",
    "register",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]

PROVIDER = "cpp"
"""Provider name of the C++ CPU kernels."""

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_MAX_GQA_GROUP = 32  # query heads per kv head the attention kernel takes (kMaxRows)
_K = torch.ops.opmux_cpu


def _cpu_float(t: Tensor) -> bool:
    return t.is_cpu and t.dtype in _FLOATS


def _token_rows(t: Tensor) -> bool:
    """[T, W] with contiguous rows, or [T, H, D] with contiguous tokens."""
    if t.dim() == 2:
        return t.stride(1) == 1
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


# ----------------------------------------------------------------------------- norms
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    out = torch.empty_like(x)
    try:
        _K.rms_norm_out(out, x, weight, eps)
    except ValueError as exc:
        raise OpInputError(str(exc)) from None
    return out


def _rms_norm_ok(x: Tensor, weight: Tensor, eps: float = 1e-6) -> bool:
    return (_cpu_float(x) and weight.dtype == x.dtype and weight.is_cpu
            and x.is_contiguous() and weight.is_contiguous())


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
                       ) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    try:
        _K.fused_add_rms_norm_out(out, new_residual, x, residual, weight, eps)
    except ValueError as exc:
        raise OpInputError(str(exc)) from None
    return out, new_residual


def _fused_add_rms_norm_ok(x: Tensor, residual: Tensor, weight: Tensor,
                           eps: float = 1e-6) -> bool:
    return (_rms_norm_ok(x, weight) and residual.dtype == x.dtype
            and residual.is_cpu and residual.is_contiguous())


# ----------------------------------------------------------------------------- activations
def silu_and_mul(x: Tensor) -> Tensor:
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    try:
        _K.silu_and_mul_out(out, x)
    except ValueError as exc:
        raise OpInputError(str(exc)) from None
    return out


def _silu_and_mul_ok(x: Tensor) -> bool:
    return _cpu_float(x) and x.is_contiguous()


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    try:
        _K.gelu_and_mul_out(out, x, approximate)
    except ValueError as exc:
        raise OpInputError(str(exc)) from None
    return out


def _gelu_and_mul_ok(x: Tensor, approximate: str = "none") -> bool:
    return _cpu_float(x) and x.is_contiguous()


# ----------------------------------------------------------------------------- rotary
def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor,
                     head_size: int, is_neox: bool = True) -> tuple[Tensor, Tensor]:
    query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    try:
        _K.rotary_embedding_out(query_out, key_out, positions, query, key, cos_sin_cache,
                                head_size, is_neox)
    except ValueError as exc:
        raise OpInputError(str(exc)) from None
    return query_out, key_out


def _rotary_embedding_ok(positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor,
                         head_size: int, is_neox: bool = True) -> bool:
    return (_cpu_float(query) and key.dtype == query.dtype and cos_sin_cache.dtype == query.dtype
            and positions.dtype == torch.int64 and positions.is_cpu
            and key.is_cpu and cos_sin_cache.is_cpu
            and cos_sin_cache.is_contiguous() and _token_rows(query) and _token_rows(key))


# ----------------------------------------------------------------------------- kv cache
# The KV-cache impls run the catalog's own check first (provider 'cpp'), so they accept and
# reject exactly what native does (#11 items 4 and 7); the kernels' checks stay as a guard.
def _tensors(*ts: object) -> bool:
    return all(isinstance(t, Tensor) for t in ts)


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                            provider=PROVIDER)
    try:
        _K.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    except ValueError as exc:
        raise OpInputError(str(exc)) from None


def _reshape_and_cache_ok(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                          slot_mapping: Tensor) -> bool:
    # any cache and slot_mapping strides; heads must be contiguous rows of D elements
    return (_tensors(key, value, key_cache, value_cache, slot_mapping)
            and key_cache.is_cpu and key.is_cpu and value.is_cpu and value_cache.is_cpu
            and slot_mapping.is_cpu and key_cache.dim() == 4 and value_cache.dim() == 4
            and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
            and key.dtype == key_cache.dtype and value.dtype == key_cache.dtype
            and value_cache.dtype == key_cache.dtype and slot_mapping.dtype == torch.int64
            and key.dim() == 3 and key.stride(2) == 1
            and value.dim() == 3 and value.stride(2) == 1)


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                    sliding_window: Optional[int] = None,
                    soft_cap: Optional[float] = None) -> Tensor:
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, scale, sliding_window, soft_cap, provider=PROVIDER)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    try:
        _K.paged_attention_out(out, query, key_cache, value_cache, block_tables, seq_lens,
                               query_start_loc, scale,
                               -1 if sliding_window is None else sliding_window,
                               0.0 if soft_cap is None else soft_cap)
    except ValueError as exc:
        raise OpInputError(str(exc)) from None
    return out


def _paged_attention_ok(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                        block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                        scale: float, sliding_window: Optional[int] = None,
                        soft_cap: Optional[float] = None) -> bool:
    # the kernel reads contiguous caches; strided cache views run on the next provider
    return (_tensors(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
            and _cpu_float(query) and key_cache.dtype == query.dtype
            and value_cache.dtype == query.dtype and key_cache.is_cpu and value_cache.is_cpu
            and block_tables.is_cpu and seq_lens.is_cpu and query_start_loc.is_cpu
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and query.dim() == 3 and query.stride(2) == 1 and key_cache.dim() == 4
            and query.shape[1] <= _MAX_GQA_GROUP * key_cache.shape[2]
            and block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
            and query_start_loc.dtype == torch.int32 and block_tables.is_contiguous()
            and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
            and (sliding_window is None or sliding_window > 0)
            and (soft_cap is None or soft_cap > 0))


def advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                           input_tokens: Tensor, sampled_token_ids: Tensor,
                           input_positions: Tensor, seq_lens: Tensor, slot_mapping: Tensor,
                           block_tables: Tensor) -> None:
    check_advance_step_flashattn(num_seqs, num_queries, block_size, input_tokens,
                                 sampled_token_ids, input_positions, seq_lens, slot_mapping,
                                 block_tables, provider=PROVIDER)
    try:
        _K.advance_step_flashattn(num_seqs, num_queries, block_size, input_tokens,
                                  sampled_token_ids, input_positions, seq_lens, slot_mapping,
                                  block_tables)
    except ValueError as exc:
        raise OpInputError(str(exc)) from None


def _advance_step_ok(num_seqs: int, num_queries: int, block_size: int, input_tokens: Tensor,
                     sampled_token_ids: Tensor, input_positions: Tensor, seq_lens: Tensor,
                     slot_mapping: Tensor, block_tables: Tensor) -> bool:
    # sampled_token_ids ([n], [n, 1] or more rows) and block_tables are read through their
    # strides; the four state tensors are contiguous (native requires it)
    state = (input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping,
             block_tables)
    return (_tensors(*state) and all(t.is_cpu for t in state)
            and input_tokens.dtype == torch.int64
            and sampled_token_ids.dtype == torch.int64 and input_positions.dtype == torch.int64
            and seq_lens.dtype == torch.int32 and slot_mapping.dtype == torch.int64
            and block_tables.dtype == torch.int32)


OPS: dict[str, tuple[Callable[..., Any], Callable[..., bool]]] = {
    "rms_norm": (rms_norm, _rms_norm_ok),
    "fused_add_rms_norm": (fused_add_rms_norm, _fused_add_rms_norm_ok),
    "silu_and_mul": (silu_and_mul, _silu_and_mul_ok),
    "gelu_and_mul": (gelu_and_mul, _gelu_and_mul_ok),
    "rotary_embedding": (rotary_embedding, _rotary_embedding_ok),
    "reshape_and_cache": (reshape_and_cache, _reshape_and_cache_ok),
    "paged_attention": (paged_attention, _paged_attention_ok),
    "advance_step_flashattn": (advance_step_flashattn, _advance_step_ok),
}
"""Op name -> (impl, supports_args) of every op this provider serves."""


def register(registry: Any) -> tuple[bool, str]:
    """Register every impl as provider ``cpp`` on dispatch key ``CPU``.

    Builds (or loads from the cache) the kernels first: ``supported`` is the build outcome and,
    when the build failed, the compiler message becomes the provider's ``reason``.

    :param registry: an object with ``get_op(name)`` (the global registry in production).
    :returns: the build status ``(ok, message)``.
    """
    ok, message = _build.build_status()
    for name, (fn, pred) in OPS.items():
        registry.get_op(name).register_impl(
            PROVIDER, dispatch_key="CPU", supported=ok, supports_args=pred,
            reason=None if ok else f"C++ CPU kernels unavailable: {message}",
        )(fn)
    return ok, message
