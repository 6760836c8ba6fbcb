"""The ``cpp`` provider: opmux's C++ CPU kernels (``csrc/cpu``) behind the native signatures.

Each impl first runs the op's shared check (:mod:`opmux.ops.checks`, the one native runs,
with ``provider='cpp'``), so ``cpp`` refuses exactly what native refuses, with the same
:class:`opmux.OpInputError`; then it allocates its outputs and calls the matching
out-variant in ``torch.ops.opmux_cpu``. The kernels check again before writing anything; a
``ValueError`` from them becomes an ``OpInputError`` too. ``paged_attention`` reverses the
order: its kernel checks every tensor condition first, and the shared check runs only when
the kernel refuses (it then raises native's error). Each ``supports_args`` predicate
accepts what the kernel handles of the inputs native accepts (CPU tensors, fp32/bf16/fp16,
the layouts it reads) and never raises; anything else falls through to the next provider in
the priority list.
"""

# no ``from __future__ import annotations``: opmux infers torch schemas from these annotations
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Optional

import torch
from torch import Tensor

from opmux.ops.checks import (
    check_paged_attention,
    check_quant_fp8,
    check_reshape_and_cache,
    check_rms_norm_gated,
    check_rotary_embedding,
    checked_advance_step,
    kernel_error,
)
from opmux.ops.kv_formats import (
    HND,
    declare_kv_cache_formats,
    register_kv_cache_format,
    require_kv_cache_format,
    resolve_kv_cache_format,
)
from opmux.plugins.registration import OpTable, op_table, predicate

from . import build, cpp_activation, cpp_attention, cpp_moe, cpp_ssd, cpp_ssm
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


def _rows_view(out: Tensor, tokens: int) -> Tensor:
    """A fresh contiguous output as ``[tokens, width]`` for the kernel (as it is when empty)."""
    return out if out.dim() == 2 or not tokens else out.view(tokens, -1)


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
    # the kernel checks the position range itself before writing (no second pass here)
    check_rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox,
                           provider=PROVIDER, read_data=False)
    # any positions shape and either query form: the kernel reads [T] positions and
    # [T, H*D] rows; strided or stride-0 positions are copied, rows are views when the
    # strides allow
    flat = positions if positions.dim() == 1 else positions.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    tokens = flat.shape[0]
    q_rows, k_rows = _token_rows(query, tokens), _token_rows(key, tokens)
    query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    try:
        K.rotary_embedding_out(_rows_view(query_out, tokens), _rows_view(key_out, tokens),
                                flat, q_rows, k_rows, cos_sin_cache, head_size, is_neox)
    except ValueError as exc:
        raise kernel_error("rotary_embedding", PROVIDER, exc,
                           "positions" if "positions[" in str(exc) else None) from None
    return query_out, key_out


def _rotary_tensors_ok(positions: Tensor, query: Tensor, key: Tensor,
                       cos_sin_cache: Tensor) -> bool:
    return (cpu_float(query) and isinstance(key, Tensor) and key.dtype == query.dtype
            and isinstance(cos_sin_cache, Tensor) and cos_sin_cache.dtype == query.dtype
            and _cpu_tensor(positions) and positions.dtype == torch.int64
            and key.is_cpu and cos_sin_cache.is_cpu and cos_sin_cache.is_contiguous())


rotary_embedding_supports = predicate(rotary_embedding, _rotary_tensors_ok)


# ----------------------------------------------------------------------------- kv cache
# The KV-cache impls run the catalog's own check first (provider 'cpp'), so they accept and
# reject exactly what native does; the kernels' checks stay as a guard.
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
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                            provider=PROVIDER)
    call("reshape_and_cache", K.reshape_and_cache, key, value, key_cache, value_cache,
          slot_mapping)


def reshape_and_cache_supports(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                               slot_mapping: Tensor, kv_cache_format: str = "canonical") -> bool:
    if kv_cache_format != "canonical":
        if not (kv_cache_format in _FORMATS and _tensors(key_cache, value_cache)
                and key_cache.dim() == 4 and value_cache.dim() == 4):
            return False
        key_cache, value_cache = HND.to_canonical(key_cache, value_cache)
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
                    soft_cap: Optional[float] = None,
                    kv_cache_format: str = "canonical") -> Tensor:
    if kv_cache_format != "canonical":
        require_kv_cache_format("paged_attention", kv_cache_format, PROVIDER, _FORMATS)
        key_cache, value_cache = HND.to_canonical(key_cache, value_cache)
    # The kernel checks every tensor condition of the shared check (types, ranks, sizes,
    # dtypes, and the values of the int32 tensors it reads) before it writes anything, so
    # only the scalars are checked here first and each tensor is inspected once per call
    # (benchmarks/transformers_cpu.py). When the kernel refuses, the shared check runs and
    # raises native's error for the bad argument; a condition it does not cover becomes
    # kernel_error.
    if not _attention_scalars_ok(scale, sliding_window, soft_cap):
        check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc, scale, sliding_window, soft_cap,
                              provider=PROVIDER, read_data=False)
    try:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        K.paged_attention_out(out, query, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc, scale,
                              -1 if sliding_window is None else sliding_window,
                              0.0 if soft_cap is None else soft_cap)
    except Exception as exc:
        check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc, scale, sliding_window, soft_cap,
                              provider=PROVIDER)
        if isinstance(exc, ValueError):
            raise kernel_error("paged_attention", PROVIDER, exc) from None
        raise
    return out


def _attention_scalars_ok(scale: float, sliding_window: Optional[int],
                          soft_cap: Optional[float]) -> bool:
    # what the shared check asks of the scalars, which the kernel cannot see (it takes -1
    # and 0.0 for "none"): a real scale that is not NaN, a positive window and soft cap
    return (type(scale) in (float, int) and scale == scale
            and (sliding_window is None
                 or (type(sliding_window) is int and sliding_window > 0))
            and (soft_cap is None or (type(soft_cap) in (float, int) and soft_cap > 0)))


def _dense_blocks(cache: Tensor) -> bool:
    # dense NHD [bs, Hkv, D] or HND [Hkv, bs, D] blocks (canonical, or the hnd format's view)
    if cache.dim() != 4 or cache.stride(3) != 1:
        return False
    _, bs, hkv, d = cache.shape
    return ((cache.stride(2) == d and cache.stride(1) == hkv * d)
            or (cache.stride(1) == d and cache.stride(2) == bs * d))


def paged_attention_supports(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                             block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                             scale: float, sliding_window: Optional[int] = None,
                             soft_cap: Optional[float] = None,
                             kv_cache_format: str = "canonical") -> bool:
    # what the kernel needs of an input native accepts: a CPU float query with a contiguous
    # head dim, caches whose blocks are dense [bs, Hkv, D] or [Hkv, bs, D] and share strides
    # (blocks may lie apart: key and value halves of one buffer), at most _MAX_GQA_GROUP query
    # heads per kv head, contiguous int32 index tensors; other views run on the next
    # provider. What native refuses too (mismatched dtypes, devices or sizes, bad scalars)
    # is left to the impl, which raises native's error for it.
    if kv_cache_format != "canonical":
        if not (kv_cache_format in _FORMATS and _tensors(key_cache, value_cache)
                and key_cache.dim() == 4 and value_cache.dim() == 4):
            return False
        key_cache, value_cache = HND.to_canonical(key_cache, value_cache)
    return (_tensors(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
            and cpu_float(query) and query.dim() == 3 and query.stride(2) == 1
            and _dense_blocks(key_cache) and value_cache.stride() == key_cache.stride()
            and query.shape[1] <= _MAX_GQA_GROUP * key_cache.shape[2]
            and block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
            and query_start_loc.dtype == torch.int32 and block_tables.is_contiguous()
            and seq_lens.is_contiguous() and query_start_loc.is_contiguous())


advance_step_flashattn = checked_advance_step(
    PROVIDER, lambda *args: call("advance_step_flashattn", K.advance_step_flashattn, *args))


def _advance_step_tensors_ok(input_tokens: Tensor, sampled_token_ids: Tensor,
                             input_positions: Tensor, seq_lens: Tensor, slot_mapping: Tensor,
                             block_tables: Tensor) -> bool:
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


advance_step_flashattn_supports = predicate(advance_step_flashattn, _advance_step_tensors_ok)


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
    return (cpu_float(x) and x.is_contiguous() and x.dim() >= 3
            and cos.is_cpu and sin.is_cpu and cos.dtype in FLOATS and sin.dtype == cos.dtype
            and cos.dim() == 2 and sin.dim() == 2 and cos.stride(1) == 1
            and sin.stride(1) == 1)


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


dual_chunk_rotary_embedding_supports = predicate(dual_chunk_rotary_embedding,
                                                 _dual_chunk_tensors_ok)


# ------------------------------------------------------- gemma / gated norms, fp8 quant
gemma_rms_norm = _norm_impl("gemma_rms_norm", "gemma_rms_norm_out")
gemma_rms_norm_supports = _norm_supports(float32_weight=True)
gemma_fused_add_rms_norm = _fused_add_norm_impl("gemma_fused_add_rms_norm",
                                                "gemma_fused_add_rms_norm_out")
gemma_fused_add_rms_norm_supports = _fused_add_supports(float32_weight=True)


def rms_norm_gated(x: Tensor, weight: Tensor, z: Optional[Tensor] = None, eps: float = 1e-5,
                   group_size: Optional[int] = None, norm_before_gate: bool = False,
                   activation: str = "swish") -> Tensor:
    check_rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate, activation,
                         provider=PROVIDER)
    out = torch.empty_like(x)
    call("rms_norm_gated", K.rms_norm_gated_out, out, x, weight, z, eps,
          -1 if group_size is None else group_size, norm_before_gate, activation == "sigmoid")
    return out


def _gated_tensors_ok(x: Tensor, weight: Tensor, z: Optional[Tensor]) -> bool:
    return (cpu_float(x) and x.is_contiguous() and weight.is_cpu and weight.is_contiguous()
            and weight.dtype in (x.dtype, torch.float32)) and (
        z is None or (z.dtype == x.dtype and z.is_cpu and z.is_contiguous()))


rms_norm_gated_supports = predicate(rms_norm_gated, _gated_tensors_ok)


def quant_fp8(x: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
              scale_ub: Optional[Tensor] = None, group_size: Optional[int] = None,
              use_ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    check_quant_fp8(x, scale, per_token, scale_ub, group_size, use_ue8m0, provider=PROVIDER)
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


quant_fp8_supports = predicate(quant_fp8, _quant_tensors_ok)


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
