"""The ``cpp`` provider: opmux's C++ CPU kernels (``csrc/cpu``) behind the native signatures.

Each ``supports_args`` predicate accepts what the kernel handles of the inputs native accepts
(CPU tensors, fp32/bf16/fp16, the layouts it reads) and never raises; anything else falls
through to the next provider in the priority list, finally native, whose check gives the
error. Every impl checks once: the predicate is the acceptance test (native's static
conditions on metadata, written inline for the ops called per layer; ``quant_fp8``'s runs
native's static check itself, :func:`opmux.ops.checks.with_static_check`), the impl calls
its kernel directly, the kernel's own checks (index values included) are the last guard,
and a ``ValueError`` from them becomes the op's :class:`opmux.OpInputError`. Index values a
kernel does not read are checked in the impl, with a comment saying so.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Optional

import torch
from torch import Tensor

from opmux.ops.checks import (
    GATE_ACTIVATIONS,
    check_dual_chunk_rotary_embedding,
    check_quant_fp8,
    check_slot_values,
    kernel_error,
    with_static_check,
)
from opmux.ops.kv_formats import (
    HND,
    declare_kv_cache_formats,
    register_kv_cache_format,
    require_kv_cache_format,
    resolve_kv_cache_format,
)
from opmux.plugins.registration import OpTable, op_table, predicate

from . import build, cpp_activation, cpp_attention, cpp_linear, cpp_moe, cpp_ssd, cpp_ssm
from ._kernels import FLOATS, PROVIDER, K, call, cpu_float
from .amx_format import AMX_BF16

if TYPE_CHECKING:
    from opmux.plugins.registration import RegistryLike

__all__ = [
    "OPS",
    "advance_step_flashattn",
    "apply_rotary_emb",
    "dual_chunk_rotary_embedding",
    "fused_add_rms_norm",
    "gelu_and_mul",
    "gemma_fused_add_rms_norm",
    "gemma_rms_norm",
    "paged_attention",
    "quant_fp8",
    "register",
    "reshape_and_cache",
    "rms_norm",
    "rms_norm_gated",
    "rotary_embedding",
    "silu_and_mul",
]

_MAX_GQA_GROUP = 32  # query heads per kv head the attention kernel takes (kMaxRows)


def _cpu_tensor(t: object) -> bool:
    return isinstance(t, Tensor) and t.is_cpu


def _token_rows(t: Tensor, tokens: int) -> Tensor:
    """``t`` as ``[tokens, width]`` with contiguous rows (a view when the strides allow)."""
    if t.dim() == 2 and t.stride(1) == 1:  # already rows (the shape was checked)
        return t
    rows = t.reshape(tokens, t.numel() // tokens if tokens else 0)
    return rows if rows.stride(1) == 1 or rows.shape[1] <= 1 else rows.contiguous()


# ----------------------------------------------------------------------------- norms
# The norms and the gated activations check once: each predicate is the provider's whole
# acceptance test (metadata only; every call it takes is one native takes too, which the
# conformance kit's bad-input cases check), the impl calls its kernel directly, and the
# kernel's own checks are the last guard (a ValueError becomes the op's OpInputError). A
# call a predicate declines runs the next provider, finally native, whose check says what
# is wrong. One frame each for predicate and impl: ``benchmarks/dispatch_overhead.py`` and
# ``tests/plugins/cpu/test_cpp_frames.py``.
def _norm_impl(op: str, kernel: str) -> Callable[..., Tensor]:
    """The impl of norm ``op``: ``K.<kernel>(out, x, weight, eps)`` (looked up per call:
    the kernels are loaded after this module is imported)."""

    def impl(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
        out = torch.empty_like(x)
        try:
            getattr(K, kernel)(out, x, weight, eps)
        except ValueError as exc:
            raise kernel_error(op, PROVIDER, exc) from None
        return out

    impl.__name__ = impl.__qualname__ = op
    return impl


def _fused_add_norm_impl(op: str, kernel: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The impl of fused-add norm ``op``: ``K.<kernel>(out, new_residual, x, residual,
    weight, eps)``."""

    def impl(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
             ) -> tuple[Tensor, Tensor]:
        out = torch.empty_like(x)
        new_residual = torch.empty_like(x)
        try:
            getattr(K, kernel)(out, new_residual, x, residual, weight, eps)
        except ValueError as exc:
            raise kernel_error(op, PROVIDER, exc) from None
        return out, new_residual

    impl.__name__ = impl.__qualname__ = op
    return impl


def _norm_supports(float32_weight: bool) -> Callable[..., bool]:
    """The predicate of a norm: contiguous CPU ``x[..., d]`` of a kernel dtype, a contiguous
    ``weight[d]`` of x's dtype (or float32 with ``float32_weight``), a real ``eps >= 0``
    (NaN fails the comparison)."""

    def supports(x: Tensor, weight: Tensor, eps: float = 1e-6) -> bool:
        return (isinstance(x, Tensor) and x.dtype in FLOATS and x.is_cpu and x.dim() >= 1
                and x.is_contiguous() and isinstance(weight, Tensor)
                and (weight.dtype == x.dtype
                     or (float32_weight and weight.dtype == torch.float32))
                and weight.is_cpu and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
                and weight.is_contiguous() and type(eps) in (float, int) and eps >= 0)

    return supports


def _fused_add_supports(float32_weight: bool) -> Callable[..., bool]:
    """The predicate of a fused-add norm: :func:`_norm_supports`'s conditions, and a
    contiguous CPU residual of x's shape and dtype."""

    def supports(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> bool:
        return (isinstance(x, Tensor) and x.dtype in FLOATS and x.is_cpu and x.dim() >= 1
                and x.is_contiguous() and isinstance(weight, Tensor)
                and (weight.dtype == x.dtype
                     or (float32_weight and weight.dtype == torch.float32))
                and weight.is_cpu and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
                and weight.is_contiguous() and type(eps) in (float, int) and eps >= 0
                and isinstance(residual, Tensor) and residual.dtype == x.dtype
                and residual.is_cpu and residual.shape == x.shape and residual.is_contiguous())

    return supports


rms_norm_supports = _norm_supports(float32_weight=False)
rms_norm = _norm_impl("rms_norm", "rms_norm_out")
fused_add_rms_norm = _fused_add_norm_impl("fused_add_rms_norm", "fused_add_rms_norm_out")
fused_add_rms_norm_supports = _fused_add_supports(float32_weight=False)


# ----------------------------------------------------------------------------- activations
def silu_and_mul(x: Tensor) -> Tensor:
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    try:
        K.silu_and_mul_out(out, x)
    except ValueError as exc:
        raise kernel_error("silu_and_mul", PROVIDER, exc) from None
    return out


def silu_and_mul_supports(x: Tensor) -> bool:
    return (isinstance(x, Tensor) and x.dtype in FLOATS and x.is_cpu and x.dim() >= 1
            and x.shape[-1] % 2 == 0 and x.is_contiguous())


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    try:
        K.gelu_and_mul_out(out, x, approximate)
    except ValueError as exc:
        raise kernel_error("gelu_and_mul", PROVIDER, exc) from None
    return out


def gelu_and_mul_supports(x: Tensor, approximate: str = "none") -> bool:
    return silu_and_mul_supports(x) and approximate in ("none", "tanh")


# ----------------------------------------------------------------------------- rotary
def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor,
                     head_size: int, is_neox: bool = True) -> tuple[Tensor, Tensor]:
    # the kernel reads [T] positions and [T, H*D] rows and checks the position range itself
    # before writing; other layouts of the same elements are reshaped (views when the strides
    # allow, else copies)
    if positions.dim() == 1 and positions.stride(0) == 1:
        flat = positions
    else:
        flat = positions.reshape(-1).contiguous()
    tokens = flat.shape[0]
    if query.dim() == 2 and query.stride(1) == 1 and key.dim() == 2 and key.stride(1) == 1:
        q_rows, k_rows = query, key
    else:
        q_rows, k_rows = _token_rows(query, tokens), _token_rows(key, tokens)
    query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    try:
        K.rotary_embedding_out(
            query_out if query.dim() == 2 or not tokens else query_out.view(tokens, -1),
            key_out if key.dim() == 2 or not tokens else key_out.view(tokens, -1),
            flat, q_rows, k_rows, cos_sin_cache, head_size, is_neox)
    except ValueError as exc:
        raise kernel_error("rotary_embedding", PROVIDER, exc,
                           "positions" if "positions[" in str(exc) else None) from None
    return query_out, key_out


def rotary_embedding_supports(positions: Tensor, query: Tensor, key: Tensor,
                              cos_sin_cache: Tensor, head_size: int,
                              is_neox: bool = True) -> bool:
    # native's static conditions on CPU tensors of a kernel dtype: int64 positions of any
    # shape P (at least 1-d); query and key [*P, heads*head_size] or [*P, heads, head_size]
    # of one dtype; a contiguous [max_position, rot] cache of that dtype with an even
    # 0 < rot <= head_size. Written inline: this runs on every call.
    if not (isinstance(positions, Tensor) and positions.dtype == torch.int64
            and positions.is_cpu and isinstance(query, Tensor) and query.dtype in FLOATS
            and query.is_cpu and isinstance(key, Tensor) and key.dtype == query.dtype
            and key.is_cpu and isinstance(cos_sin_cache, Tensor)
            and cos_sin_cache.dtype == query.dtype and cos_sin_cache.is_cpu
            and cos_sin_cache.dim() == 2 and cos_sin_cache.is_contiguous()
            and type(head_size) is int and head_size > 0 and type(is_neox) is bool):
        return False
    lead = positions.dim()
    rot = cos_sin_cache.shape[1]
    pshape = positions.shape
    qdim, kdim = query.dim(), key.dim()
    return (lead >= 1 and rot % 2 == 0 and 0 < rot <= head_size
            and query.shape[:lead] == pshape and key.shape[:lead] == pshape
            and ((qdim == lead + 2 and query.shape[-1] == head_size)
                 or (qdim == lead + 1 and query.shape[-1] % head_size == 0))
            and ((kdim == lead + 2 and key.shape[-1] == head_size)
                 or (kdim == lead + 1 and key.shape[-1] % head_size == 0)))


# ----------------------------------------------------------------------------- kv cache
def _tensors(*ts: object) -> bool:
    return all(isinstance(t, Tensor) for t in ts)


_FORMATS: Final = ("canonical", "hnd")
"""KV-cache formats both kernels read and write: strided views of the canonical cache (the
attention kernel needs dense ``[bs, Hkv, D]`` or ``[Hkv, bs, D]`` blocks)."""


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor, kv_cache_format: str = "canonical") -> None:
    if kv_cache_format != "canonical":
        key_cache, value_cache = resolve_kv_cache_format(
            "reshape_and_cache", kv_cache_format, provider=PROVIDER).to_canonical(
                key_cache, value_cache)
    # slot values are data: the kernel checks their range, but not that each slot is written
    # once, which native requires (two tokens on one slot leave an order-dependent winner)
    check_slot_values("reshape_and_cache", PROVIDER, slot_mapping,
                      key_cache.shape[0] * key_cache.shape[1])
    call("reshape_and_cache", K.reshape_and_cache, key, value, key_cache, value_cache,
          slot_mapping)


def reshape_and_cache_supports(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                               slot_mapping: Tensor, kv_cache_format: str = "canonical") -> bool:
    # native's static conditions on CPU tensors of one kernel dtype: caches [nb, bs, Hkv, D]
    # of one shape with positive bs, Hkv and D whose elements do not overlap, key and value
    # [T, Hkv, D], an int64 slot_mapping [T]; the kernel reads rows of D contiguous
    # elements, any other strides
    if kv_cache_format != "canonical":
        if not (kv_cache_format in _FORMATS and _tensors(key_cache, value_cache)
                and key_cache.dim() == 4 and value_cache.dim() == 4):
            return False
        key_cache, value_cache = HND.to_canonical(key_cache, value_cache)
    if not (_tensors(key, value, key_cache, value_cache, slot_mapping)
            and key_cache.dtype in FLOATS and key_cache.is_cpu and key_cache.dim() == 4
            and value_cache.dtype == key_cache.dtype and value_cache.is_cpu
            and value_cache.shape == key_cache.shape and key.dtype == key_cache.dtype
            and key.is_cpu and key.dim() == 3 and value.dtype == key_cache.dtype
            and value.is_cpu and value.shape == key.shape and slot_mapping.dtype == torch.int64
            and slot_mapping.is_cpu and slot_mapping.dim() == 1
            and slot_mapping.shape[0] == key.shape[0]):
        return False
    _, bs, hkv, d = key_cache.shape
    return (bs > 0 and hkv > 0 and d > 0 and key.shape[1] == hkv and key.shape[2] == d
            and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
            and key.stride(2) == 1 and value.stride(2) == 1
            and torch._debug_has_internal_overlap(key_cache) != 1
            and torch._debug_has_internal_overlap(value_cache) != 1)


_INDEXES: Final = ("query_start_loc", "seq_lens", "block_tables")


def _index_culprit(message: str) -> Optional[str]:
    """The index argument a kernel's value error names first (its messages quote them)."""
    found = [(message.find(name), name) for name in _INDEXES if name in message]
    return min(found)[1] if found else None


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                    sliding_window: Optional[int] = None,
                    soft_cap: Optional[float] = None,
                    kv_cache_format: str = "canonical") -> Tensor:
    if kv_cache_format != "canonical":
        require_kv_cache_format("paged_attention", kv_cache_format, PROVIDER, _FORMATS)
        key_cache, value_cache = HND.to_canonical(key_cache, value_cache)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    try:
        # the kernel checks the values of the index tensors (native's value checks) before
        # it writes anything
        K.paged_attention_out(out, query, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc, scale,
                              -1 if sliding_window is None else sliding_window,
                              0.0 if soft_cap is None else soft_cap)
    except ValueError as exc:
        raise kernel_error("paged_attention", PROVIDER, exc,
                           _index_culprit(str(exc))) from None
    return out


def paged_attention_supports(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                             block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                             scale: float, sliding_window: Optional[int] = None,
                             soft_cap: Optional[float] = None,
                             kv_cache_format: str = "canonical") -> bool:
    # native's static conditions as the kernel takes them: a CPU query [T, H, D] of a kernel
    # dtype with a contiguous head dim; caches of its dtype and one shape [nb, bs, Hkv, D]
    # (positive bs, Hkv, D = query's D, H a multiple of Hkv, at most _MAX_GQA_GROUP query
    # heads per kv head) whose blocks are dense [bs, Hkv, D] or [Hkv, bs, D] with shared
    # strides (blocks may lie apart: key and value halves of one buffer); contiguous int32
    # block_tables [S, max_blocks], seq_lens [S] and query_start_loc [S + 1]; a real scale
    # that is not NaN, a positive sliding_window and soft_cap or None. Written inline: this
    # runs on every call.
    if kv_cache_format != "canonical":
        if not (kv_cache_format in _FORMATS and _tensors(key_cache, value_cache)
                and key_cache.dim() == 4 and value_cache.dim() == 4):
            return False
        key_cache, value_cache = HND.to_canonical(key_cache, value_cache)
    if not (isinstance(query, Tensor) and query.dtype in FLOATS and query.is_cpu
            and query.dim() == 3 and query.stride(2) == 1
            and isinstance(key_cache, Tensor) and key_cache.dtype == query.dtype
            and key_cache.is_cpu and key_cache.dim() == 4 and key_cache.stride(3) == 1
            and isinstance(value_cache, Tensor) and value_cache.dtype == query.dtype
            and value_cache.is_cpu and value_cache.shape == key_cache.shape
            and value_cache.stride() == key_cache.stride()
            and isinstance(block_tables, Tensor) and block_tables.dtype == torch.int32
            and block_tables.is_cpu and block_tables.dim() == 2
            and block_tables.is_contiguous()
            and isinstance(seq_lens, Tensor) and seq_lens.dtype == torch.int32
            and seq_lens.is_cpu and seq_lens.dim() == 1 and seq_lens.is_contiguous()
            and isinstance(query_start_loc, Tensor) and query_start_loc.dtype == torch.int32
            and query_start_loc.is_cpu and query_start_loc.dim() == 1
            and query_start_loc.is_contiguous()
            and type(scale) in (float, int) and scale == scale
            and (sliding_window is None
                 or (type(sliding_window) is int and sliding_window > 0))
            and (soft_cap is None or (type(soft_cap) in (float, int) and soft_cap > 0))):
        return False
    _, bs, hkv, d = key_cache.shape
    _, heads, head_size = query.shape
    s1, s2 = key_cache.stride(1), key_cache.stride(2)
    seqs = block_tables.shape[0]
    return (bs > 0 and hkv > 0 and d > 0 and head_size == d and heads % hkv == 0
            and heads <= _MAX_GQA_GROUP * hkv
            and ((s2 == d and s1 == hkv * d) or (s1 == d and s2 == bs * d))
            and seq_lens.shape[0] == seqs and query_start_loc.shape[0] == seqs + 1)


_STEP_TENSORS: Final = ("input_tokens", "sampled_token_ids", "input_positions", "seq_lens",
                        "slot_mapping", "block_tables")


def advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                           input_tokens: Tensor, sampled_token_ids: Tensor,
                           input_positions: Tensor, seq_lens: Tensor, slot_mapping: Tensor,
                           block_tables: Tensor) -> None:
    try:
        # the kernel checks the next positions against seq_lens and block_tables (native's
        # value checks) before it writes anything
        K.advance_step_flashattn(num_seqs, num_queries, block_size, input_tokens,
                                 sampled_token_ids, input_positions, seq_lens, slot_mapping,
                                 block_tables)
    except ValueError as exc:
        text = str(exc)
        found = [(text.find(name), name) for name in _STEP_TENSORS if name in text]
        raise kernel_error("advance_step_flashattn", PROVIDER, exc,
                           min(found)[1] if found else None) from None


def advance_step_flashattn_supports(num_seqs: int, num_queries: int, block_size: int,
                                    input_tokens: Tensor, sampled_token_ids: Tensor,
                                    input_positions: Tensor, seq_lens: Tensor,
                                    slot_mapping: Tensor, block_tables: Tensor) -> bool:
    # native's static conditions on CPU tensors: ints 0 <= num_queries <= num_seqs and
    # block_size >= 1; int64 input_tokens, input_positions, slot_mapping and int32 seq_lens,
    # each [num_seqs] (the kernel writes them as contiguous arrays, native takes strided
    # ones); int64 sampled_token_ids [num_queries] or [rows >= num_queries, 1]; int32
    # block_tables [num_seqs, max_blocks] (both read through their strides)
    state = (input_tokens, input_positions, seq_lens, slot_mapping)
    if not (type(num_seqs) is int and type(num_queries) is int and type(block_size) is int
            and 0 <= num_queries <= num_seqs and block_size >= 1
            and _tensors(*state, sampled_token_ids, block_tables)):
        return False
    sampled = sampled_token_ids
    return (all(t.is_cpu and t.dim() == 1 and t.shape[0] == num_seqs and t.is_contiguous()
                for t in state)
            and input_tokens.dtype == torch.int64 and input_positions.dtype == torch.int64
            and seq_lens.dtype == torch.int32 and slot_mapping.dtype == torch.int64
            and sampled.dtype == torch.int64 and sampled.is_cpu
            and ((sampled.dim() == 1 and sampled.shape[0] == num_queries)
                 or (sampled.dim() == 2 and sampled.shape[0] >= num_queries
                     and sampled.shape[1] == 1))
            and block_tables.dtype == torch.int32 and block_tables.is_cpu
            and block_tables.dim() == 2 and block_tables.shape[0] == num_seqs)


# ----------------------------------------------------------------------------- more rotary
def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, is_neox_style: bool = True,
                     enable_fp32_compute: bool = False) -> Tensor:
    # the kernel computes in fp32 either way; without fp32 compute native rounds the tables
    # to x's dtype first, so they are handed over in x's dtype (a [S, D/2] copy at most)
    if not enable_fp32_compute and cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    elif cos.dtype not in (x.dtype, torch.float32):
        cos, sin = cos.float(), sin.float()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    call("apply_rotary_emb", K.apply_rotary_emb_out, out, x, cos, sin, is_neox_style)
    return out


def _apply_rotary_tensors_ok(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    # native's static conditions as the kernel takes them: a contiguous CPU x[..., S, H, D]
    # with an even D, cos and sin [S, D/2] of one kernel dtype with unit-stride rows
    return (cpu_float(x) and x.is_contiguous() and x.dim() >= 3 and x.shape[-1] % 2 == 0
            and isinstance(cos, Tensor) and isinstance(sin, Tensor)
            and cos.is_cpu and sin.is_cpu and cos.dtype in FLOATS and sin.dtype == cos.dtype
            and cos.shape == (x.shape[-3], x.shape[-1] // 2) and sin.shape == cos.shape
            and cos.stride(1) == 1 and sin.stride(1) == 1)


apply_rotary_emb_supports = predicate(apply_rotary_emb, _apply_rotary_tensors_ok)


def dual_chunk_rotary_embedding(positions: Tensor, query: Tensor, key: Tensor,
                                cos_sin_q_cache: Tensor, cos_sin_qc_cache: Tensor,
                                cos_sin_k_cache: Tensor, cos_sin_qc_no_clamp_cache: Tensor,
                                cos_sin_q_inter_cache: Tensor, head_size: int,
                                is_neox_style: bool = True, offsets: Optional[Tensor] = None
                                ) -> tuple[Tensor, Tensor]:
    tokens = positions.shape[0]
    query_out = query.new_empty((tokens, 5 * query.shape[-1]))
    key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    call("dual_chunk_rotary_embedding", K.dual_chunk_rotary_embedding_out, query_out,
          key_out, positions, query, key, cos_sin_q_cache, cos_sin_qc_cache, cos_sin_k_cache,
          cos_sin_qc_no_clamp_cache, cos_sin_q_inter_cache, head_size, is_neox_style, offsets)
    return query_out, key_out


def _dual_chunk_tensors_ok(positions: Tensor, query: Tensor, key: Tensor,
                           cos_sin_q_cache: Tensor, cos_sin_qc_cache: Tensor,
                           cos_sin_k_cache: Tensor, cos_sin_qc_no_clamp_cache: Tensor,
                           cos_sin_q_inter_cache: Tensor, offsets: Optional[Tensor]) -> bool:
    caches = (cos_sin_q_cache, cos_sin_qc_cache, cos_sin_k_cache, cos_sin_qc_no_clamp_cache,
              cos_sin_q_inter_cache)
    return (cpu_float(query) and key.dtype == query.dtype and key.is_cpu
            and query.dim() == 2 and key.dim() == 2
            and query.stride(1) == 1 and key.stride(1) == 1
            and positions.dtype == torch.int64 and positions.is_cpu
            and positions.is_contiguous()
            and (offsets is None or (offsets.dtype == torch.int64 and offsets.is_contiguous()))
            and all(c.dtype == query.dtype and c.is_cpu and c.is_contiguous() and c.dim() == 2
                    for c in caches))


# a rarely used op with a long check: the predicate runs native's static check itself; the
# kernel checks the positions against cos_sin_k_cache
dual_chunk_rotary_embedding_supports = with_static_check(
    dual_chunk_rotary_embedding, check_dual_chunk_rotary_embedding, PROVIDER,
    predicate(dual_chunk_rotary_embedding, _dual_chunk_tensors_ok))


# ------------------------------------------------------- gemma / gated norms, fp8 quant
gemma_rms_norm = _norm_impl("gemma_rms_norm", "gemma_rms_norm_out")
gemma_rms_norm_supports = _norm_supports(float32_weight=True)
gemma_fused_add_rms_norm = _fused_add_norm_impl("gemma_fused_add_rms_norm",
                                                "gemma_fused_add_rms_norm_out")
gemma_fused_add_rms_norm_supports = _fused_add_supports(float32_weight=True)


def rms_norm_gated(x: Tensor, weight: Tensor, z: Optional[Tensor] = None, eps: float = 1e-5,
                   group_size: Optional[int] = None, norm_before_gate: bool = False,
                   activation: str = "swish") -> Tensor:
    out = torch.empty_like(x)
    call("rms_norm_gated", K.rms_norm_gated_out, out, x, weight, z, eps,
          -1 if group_size is None else group_size, norm_before_gate, activation == "sigmoid")
    return out


def _gated_tensors_ok(x: Tensor, weight: Tensor, z: Optional[Tensor], eps: float,
                      group_size: Optional[int], activation: str) -> bool:
    # native's static conditions as the kernel takes them: a contiguous CPU x[..., d] of a
    # kernel dtype, a contiguous weight [d] of its dtype or float32, z None or like x, a real
    # eps >= 0, group_size None or a positive divisor of d, a known activation
    if not (cpu_float(x) and x.dim() >= 1 and x.is_contiguous() and isinstance(weight, Tensor)
            and weight.is_cpu and weight.is_contiguous() and weight.dim() == 1
            and weight.dtype in (x.dtype, torch.float32) and weight.shape[0] == x.shape[-1]
            and type(eps) in (float, int) and eps >= 0 and activation in GATE_ACTIVATIONS):
        return False
    return ((z is None or (isinstance(z, Tensor) and z.dtype == x.dtype and z.is_cpu
                           and z.shape == x.shape and z.is_contiguous()))
            and (group_size is None or (type(group_size) is int and group_size > 0
                                        and x.shape[-1] % group_size == 0)))


rms_norm_gated_supports = predicate(rms_norm_gated, _gated_tensors_ok)


def quant_fp8(x: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
              scale_ub: Optional[Tensor] = None, group_size: Optional[int] = None,
              use_ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    try:
        if scale is not None:
            s2 = scale.float().reshape(1, 1) if scale.numel() == 1 else scale.float()
            K.quant_fp8_static_out(q, x, s2.contiguous())
            return q, scale.clone()
        if group_size is not None:
            groups = (x.shape[-1] + group_size - 1) // group_size
            scales = torch.empty((*x.shape[:-1], groups), dtype=torch.float32)
            K.quant_fp8_group_out(q, scales, x, group_size, use_ue8m0)
            return q, scales
        scales = torch.empty((*x.shape[:-1], 1) if per_token else (1,), dtype=torch.float32)
        K.quant_fp8_dynamic_out(q, scales, x, per_token, scale_ub)
    except ValueError as exc:
        raise kernel_error("quant_fp8", PROVIDER, exc) from None
    return q, scales


def _quant_tensors_ok(x: Tensor, scale: Optional[Tensor], scale_ub: Optional[Tensor]) -> bool:
    return (cpu_float(x) and x.is_contiguous() and (scale is None or scale.is_cpu)
            and (scale_ub is None or scale_ub.is_cpu))


quant_fp8_supports = with_static_check(quant_fp8, check_quant_fp8, PROVIDER,
                                       predicate(quant_fp8, _quant_tensors_ok))


OPS: OpTable = op_table(
    (rms_norm, rms_norm_supports),
    (fused_add_rms_norm, fused_add_rms_norm_supports),
    (silu_and_mul, silu_and_mul_supports),
    (gelu_and_mul, gelu_and_mul_supports),
    (rotary_embedding, rotary_embedding_supports),
    (reshape_and_cache, reshape_and_cache_supports),
    (paged_attention, paged_attention_supports),
    (advance_step_flashattn, advance_step_flashattn_supports),
    (gemma_rms_norm, gemma_rms_norm_supports),
    (gemma_fused_add_rms_norm, gemma_fused_add_rms_norm_supports),
    (rms_norm_gated, rms_norm_gated_supports),
    (quant_fp8, quant_fp8_supports),
    cpp_activation.OPS,
    (apply_rotary_emb, apply_rotary_emb_supports),
    (dual_chunk_rotary_embedding, dual_chunk_rotary_embedding_supports),
    cpp_attention.OPS,
    cpp_ssm.OPS,
    cpp_ssd.OPS,
    cpp_moe.OPS,
    cpp_linear.OPS,
)
"""Op name -> (impl, supports_args) of every op this provider serves."""


def register(registry: "RegistryLike", dispatch_key: str = "CPU") -> list[str]:
    """Register every impl of :data:`OPS` as provider ``cpp`` (the registration contract).

    Builds (or loads from the cache) the kernels first: ``supported`` is the build outcome and,
    when the build failed, the compiler message becomes the provider's ``reason``.

    :param registry: the registry (the global one from the plugin hook; tests pass their own).
    :param dispatch_key: the torch dispatch key served (the kernels take CPU tensors).
    :returns: the ``op:provider`` pairs registered.
    """
    from opmux.plugins.registration import register_table

    ok, message = build.build_status()
    register_kv_cache_format(AMX_BF16)  # its own packed format; the kernels do not read it yet
    declare_kv_cache_formats(PROVIDER, _FORMATS[:1])
    return register_table(registry, PROVIDER, dispatch_key, OPS, supported=ok,
                          reason=None if ok else f"C++ CPU kernels unavailable: {message}")
