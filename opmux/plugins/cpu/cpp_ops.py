"""The ``cpp`` provider: opmux's C++ CPU kernels (``csrc/cpu``) behind the native signatures.

Each impl first runs the op's shared check (:mod:`opmux.ops._checks`, the one native runs,
with ``provider='cpp'``), so ``cpp`` refuses exactly what native refuses, with the same
:class:`opmux.OpInputError` (#11); then it allocates its outputs and calls the matching
out-variant in ``torch.ops.opmux_cpu``. The kernels check again before writing anything; a
``ValueError`` from them becomes an ``OpInputError`` too. Each ``supports_args`` predicate
accepts exactly what the kernel handles (CPU tensors, fp32/bf16/fp16, the layouts it reads)
and never raises; anything else falls through to the next provider in the priority list.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from opmux.ops._checks import (
    check_advance_step_flashattn,
    check_fused_add_rms_norm,
    check_gelu_and_mul,
    check_paged_attention,
    check_reshape_and_cache,
    check_rms_norm,
    check_rotary_embedding,
    check_silu_and_mul,
    kernel_error,
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


def _cpu_float(t: object) -> bool:
    return isinstance(t, Tensor) and t.is_cpu and t.dtype in _FLOATS


def _cpu_tensor(t: object) -> bool:
    return isinstance(t, Tensor) and t.is_cpu


def _token_rows(t: Tensor, tokens: int) -> Tensor:
    """``t`` as ``[tokens, width]`` with contiguous rows (a view when the strides allow)."""
    rows = t.reshape(tokens, t.numel() // tokens if tokens else 0)
    return rows if rows.stride(1) == 1 or rows.shape[1] <= 1 else rows.contiguous()


# ----------------------------------------------------------------------------- norms
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    check_rms_norm(x, weight, eps, provider=PROVIDER)
    out = torch.empty_like(x)
    try:
        _K.rms_norm_out(out, x, weight, eps)
    except ValueError as exc:
        raise kernel_error("rms_norm", PROVIDER, exc) from None
    return out


def _rms_norm_ok(x: Tensor, weight: Tensor, eps: float = 1e-6) -> bool:
    # contiguous x and weight only: strided and stride-0 views go to native
    return (_cpu_float(x) and isinstance(weight, Tensor) and weight.dtype == x.dtype
            and weight.is_cpu and x.is_contiguous() and weight.is_contiguous())


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
                       ) -> tuple[Tensor, Tensor]:
    check_fused_add_rms_norm(x, residual, weight, eps, provider=PROVIDER)
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    try:
        _K.fused_add_rms_norm_out(out, new_residual, x, residual, weight, eps)
    except ValueError as exc:
        raise kernel_error("fused_add_rms_norm", PROVIDER, exc) from None
    return out, new_residual


def _fused_add_rms_norm_ok(x: Tensor, residual: Tensor, weight: Tensor,
                           eps: float = 1e-6) -> bool:
    return (_rms_norm_ok(x, weight) and isinstance(residual, Tensor)
            and residual.dtype == x.dtype and residual.is_cpu and residual.is_contiguous())


# ----------------------------------------------------------------------------- activations
def silu_and_mul(x: Tensor) -> Tensor:
    check_silu_and_mul(x, provider=PROVIDER)
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    try:
        _K.silu_and_mul_out(out, x)
    except ValueError as exc:
        raise kernel_error("silu_and_mul", PROVIDER, exc) from None
    return out


def _silu_and_mul_ok(x: Tensor) -> bool:
    return _cpu_float(x) and x.is_contiguous()


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    check_gelu_and_mul(x, approximate, provider=PROVIDER)
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    try:
        _K.gelu_and_mul_out(out, x, approximate)
    except ValueError as exc:
        raise kernel_error("gelu_and_mul", PROVIDER, exc) from None
    return out


def _gelu_and_mul_ok(x: Tensor, approximate: str = "none") -> bool:
    return _cpu_float(x) and x.is_contiguous()


# ----------------------------------------------------------------------------- rotary
def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor,
                     head_size: int, is_neox: bool = True) -> tuple[Tensor, Tensor]:
    # the kernel checks the position range itself before writing (no second pass here)
    check_rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox,
                           provider=PROVIDER, read_data=False)
    # any positions shape and either query form (#19): the kernel reads [T] positions and
    # [T, H*D] rows; strided or stride-0 positions are copied (#11), rows are views when the
    # strides allow
    flat = positions.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    tokens = flat.shape[0]
    q_rows, k_rows = _token_rows(query, tokens), _token_rows(key, tokens)
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    try:
        _K.rotary_embedding_out(query_out.view(tokens, -1) if tokens else query_out,
                                key_out.view(tokens, -1) if tokens else key_out, flat,
                                q_rows, k_rows, cos_sin_cache, head_size, is_neox)
    except ValueError as exc:
        raise kernel_error("rotary_embedding", PROVIDER, exc,
                           "positions" if "positions[" in str(exc) else None) from None
    return query_out, key_out


def _rotary_embedding_ok(positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor,
                         head_size: int, is_neox: bool = True) -> bool:
    return (_cpu_float(query) and isinstance(key, Tensor) and key.dtype == query.dtype
            and isinstance(cos_sin_cache, Tensor) and cos_sin_cache.dtype == query.dtype
            and _cpu_tensor(positions) and positions.dtype == torch.int64
            and key.is_cpu and cos_sin_cache.is_cpu and cos_sin_cache.is_contiguous())


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
        raise kernel_error("reshape_and_cache", PROVIDER, exc) from None


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
        raise kernel_error("paged_attention", PROVIDER, exc) from None
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
            and (sliding_window is None
                 or (isinstance(sliding_window, int) and sliding_window > 0))
            and (soft_cap is None or (isinstance(soft_cap, (int, float)) and soft_cap > 0)))


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
        raise kernel_error("advance_step_flashattn", PROVIDER, exc) from None


def _advance_step_ok(num_seqs: int, num_queries: int, block_size: int, input_tokens: Tensor,
                     sampled_token_ids: Tensor, input_positions: Tensor, seq_lens: Tensor,
                     slot_mapping: Tensor, block_tables: Tensor) -> bool:
    # sampled_token_ids ([n], [n, 1] or more rows) and block_tables are read through their
    # strides; the kernel writes the four state vectors as contiguous arrays (native takes
    # strided ones)
    state = (input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping,
             block_tables)
    return (_tensors(*state) and all(t.is_cpu for t in state)
            and input_tokens.is_contiguous() and input_positions.is_contiguous()
            and seq_lens.is_contiguous() and slot_mapping.is_contiguous()
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
