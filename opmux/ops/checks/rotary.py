"""Input checks of the rotary ops (:mod:`opmux.ops.rotary`): ``rotary_embedding``,
``apply_rotary_emb`` and ``dual_chunk_rotary_embedding``.

Same contract as every module of :mod:`opmux.ops.checks`: each ``check_<op>`` takes the op's
arguments plus ``provider`` and ``read_data`` and raises :class:`opmux.OpInputError` before
anything is written; ``positions`` are read (range) only when ``read_data`` and the tensors
hold data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from opmux.core.errors import OpInputError
from opmux.ops.checks.input_errors import input_error, shape_text
from opmux.ops.checks.single_arguments import (
    INDEX_DTYPES,
    check_bool,
    check_devices,
    check_dtype,
    check_floating,
    check_int,
    check_rank,
    check_same_device,
    check_tensor,
)
from opmux.ops.checks.symbolic import has_data, require

__all__ = [
    "check_apply_rotary_emb",
    "check_dual_chunk_rotary_embedding",
    "check_dual_chunk_rotary_embedding_values",
    "check_rotary_embedding",
    "check_rotary_embedding_values",
    "rotary_heads",
]

def rotary_heads(t: Tensor, lead: int, head_size: int) -> int:
    """Heads of a rotary ``query``/``key`` with ``lead`` token dims (``[..., H*D]`` or
    ``[..., H, D]``; the form follows from ``t.dim() - lead``); call after the check."""
    return t.shape[-2] if t.dim() == lead + 2 else t.shape[-1] // head_size


def _rotary_layouts(pshape: Sequence[object], head_size: object) -> str:
    if len(pshape) == 1:
        return (f"[T, heads*{head_size}] or [T, heads, {head_size}] with T={pshape[0]} "
                f"(positions' length)")
    return (f"[*P, heads*{head_size}] or [*P, heads, {head_size}] with P={list(pshape)} "
            f"(positions' shape)")


def _rotary_layout_error(provider: str, name: str, t: Tensor, pshape: Sequence[object],
                         head_size: object) -> OpInputError:
    return input_error("rotary_embedding", provider, name, _rotary_layouts(pshape, head_size),
                           shape_text(t))


def _check_rotary_operand(provider: str, name: str, t: Tensor, pshape: torch.Size,
                          head_size: int) -> None:
    op = "rotary_embedding"
    lead = len(pshape)
    check_floating(op, provider, name, t)
    per_head = t.dim() == lead + 2
    if not per_head and t.dim() != lead + 1:
        raise _rotary_layout_error(provider, name, t, pshape, head_size)
    if not torch.compiler.is_compiling():
        # eager fast path: plain comparisons, the detailed checks below only on failure
        last = t.shape[-1]
        if t.shape[:lead] == pshape and (last == head_size if per_head
                                         else last % head_size == 0):
            return
    for a, b in zip(t.shape[:lead], pshape, strict=True):
        require(a == b, op, provider, name, lambda: _rotary_layouts(pshape, head_size),
                    lambda: shape_text(t))
    if per_head:
        require(t.shape[-1] == head_size, op, provider, name,
                    lambda: _rotary_layouts(pshape, head_size), lambda: shape_text(t))
    else:
        require(t.shape[-1] % head_size == 0, op, provider, name,
                    lambda: f"{_rotary_layouts(pshape, head_size)}; the last dimension a "
                    f"multiple of head_size={head_size}", lambda: shape_text(t))


def check_rotary_embedding(positions: Tensor, query: Tensor, key: Tensor,
                           cos_sin_cache: Tensor, head_size: int, is_neox: bool = True, *,
                           provider: str = "native", read_data: bool = True) -> None:
    """Validate ``rotary_embedding``; reads ``positions`` (range) when ``read_data``.

    Layouts (vLLM's): ``positions`` has any shape ``P`` (at least 1-d; its elements are the
    tokens); ``query`` and ``key`` are ``[*P, heads*head_size]`` (flattened heads) or
    ``[*P, heads, head_size]`` (per-head), told apart by their rank.
    """
    _static_rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox,
                             provider)
    if read_data:
        check_rotary_embedding_values(positions, cos_sin_cache, provider=provider)


def check_rotary_embedding_values(positions: Tensor, cos_sin_cache: Tensor, *,
                                  provider: str = "native") -> None:
    """The value check of :func:`check_rotary_embedding` alone (its static checks passed):
    every position indexes ``cos_sin_cache``; nothing when ``positions`` holds no data."""
    if positions.numel() == 0 or not has_data(positions):
        return
    lo_t, hi_t = torch.aminmax(positions)
    lo, hi = int(lo_t), int(hi_t)
    max_pos = cos_sin_cache.shape[0]
    if lo < 0 or hi >= max_pos:
        raise input_error("rotary_embedding", provider, "positions",
                          f"values in [0, {max_pos}) (cos_sin_cache rows)",
                          f"values in [{lo}, {hi}]")


def _static_rotary_embedding(positions: Tensor, query: Tensor, key: Tensor,
                             cos_sin_cache: Tensor, head_size: int, is_neox: bool,
                             provider: str) -> None:
    op = "rotary_embedding"
    positions = check_tensor(op, provider, "positions", positions)
    query = check_tensor(op, provider, "query", query)
    key = check_tensor(op, provider, "key", key)
    cos_sin_cache = check_tensor(op, provider, "cos_sin_cache", cos_sin_cache)
    check_int(op, provider, "head_size", head_size, minimum=1)
    check_bool(op, provider, "is_neox", is_neox)
    check_dtype(op, provider, "positions", positions, INDEX_DTYPES)
    lead = positions.dim()
    if lead < 1:
        raise input_error(op, provider, "positions", "a tensor of token positions with at "
                              "least one dimension ([T] or [batch, seq])",
                              shape_text(positions))
    pshape = positions.shape
    _check_rotary_operand(provider, "query", query, pshape, head_size)
    _check_rotary_operand(provider, "key", key, pshape, head_size)
    if key.dtype != query.dtype:
        raise input_error(op, provider, "key", f"query's dtype {query.dtype}", key.dtype)
    check_floating(op, provider, "cos_sin_cache", cos_sin_cache)
    check_rank(op, provider, "cos_sin_cache", cos_sin_cache, 2, "[max_position, rot]")
    rot = cos_sin_cache.shape[1]
    require((rot % 2 == 0) & (rot > 0) & (rot <= head_size), op, provider, "cos_sin_cache",
                lambda: f"an even rotary width 0 < rot <= head_size={head_size} in dim 1",
                lambda: shape_text(cos_sin_cache))
    check_devices(op, provider, {"positions": positions, "query": query, "key": key,
                                     "cos_sin_cache": cos_sin_cache})


def check_apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, is_neox_style: bool = True,
                           enable_fp32_compute: bool = False, *, provider: str = "native",
                           read_data: bool = True) -> None:
    """Validate ``apply_rotary_emb``: ``x[..., S, H, D]``, ``cos``/``sin`` ``[S, D/2]``."""
    op = "apply_rotary_emb"
    x = check_tensor(op, provider, "x", x)
    cos = check_tensor(op, provider, "cos", cos)
    sin = check_tensor(op, provider, "sin", sin)
    check_floating(op, provider, "x", x)
    if x.dim() < 3 or x.shape[-1] % 2 != 0:
        raise input_error(op, provider, "x", "a tensor [batch (optional), seq_len, num_heads, "
                              "head_size] with an even head_size", shape_text(x))
    seq_len, half = x.shape[-3], x.shape[-1] // 2
    for name, t in (("cos", cos), ("sin", sin)):
        check_floating(op, provider, name, t)
        if tuple(t.shape) != (seq_len, half):
            raise input_error(op, provider, name, f"shape [{seq_len}, {half}] "
                                  f"(x's seq_len, head_size/2)", shape_text(t))
    check_same_device(op, provider, x, cos=cos, sin=sin)


def check_dual_chunk_rotary_embedding(
        positions: Tensor, query: Tensor, key: Tensor, cos_sin_q_cache: Tensor,
        cos_sin_qc_cache: Tensor, cos_sin_k_cache: Tensor, cos_sin_qc_no_clamp_cache: Tensor,
        cos_sin_q_inter_cache: Tensor, head_size: int, is_neox_style: bool = True,
        offsets: Tensor | None = None, *, provider: str = "native",
        read_data: bool = True) -> None:
    """Validate ``dual_chunk_rotary_embedding``; reads ``positions`` (+ ``offsets``) when
    ``read_data``: every position must index ``cos_sin_k_cache``."""
    op = "dual_chunk_rotary_embedding"
    positions = check_tensor(op, provider, "positions", positions)
    if positions.dtype not in INDEX_DTYPES or positions.dim() != 1:
        raise input_error(op, provider, "positions", "a 1-d int32/int64 tensor [T]",
                              f"{positions.dtype} {shape_text(positions)}")
    tokens = positions.shape[0]
    if offsets is not None:
        offsets = check_tensor(op, provider, "offsets", offsets)
        if offsets.dtype not in INDEX_DTYPES or tuple(offsets.shape) != (tokens,):
            raise input_error(op, provider, "offsets", f"None or an int32/int64 tensor "
                                  f"[{tokens}] (positions' shape)",
                                  f"{offsets.dtype} {shape_text(offsets)}")
    if head_size <= 0:
        raise input_error(op, provider, "head_size", "a positive int", head_size)
    for name in ("query", "key"):
        t = check_tensor(op, provider, name, query if name == "query" else key)
        check_floating(op, provider, name, t)
        if t.dim() != 2 or t.shape[0] != tokens or t.shape[1] % head_size != 0:
            raise input_error(op, provider, name, f"[{tokens}, heads*{head_size}] (T = "
                                  f"positions' length, a multiple of head_size)", shape_text(t))
    if key.dtype != query.dtype:
        raise input_error(op, provider, "key", f"query's dtype {query.dtype}", key.dtype)
    caches = {"cos_sin_q_cache": cos_sin_q_cache, "cos_sin_qc_cache": cos_sin_qc_cache,
              "cos_sin_k_cache": cos_sin_k_cache,
              "cos_sin_qc_no_clamp_cache": cos_sin_qc_no_clamp_cache,
              "cos_sin_q_inter_cache": cos_sin_q_inter_cache}
    q_cache = check_tensor(op, provider, "cos_sin_q_cache", cos_sin_q_cache)
    check_floating(op, provider, "cos_sin_q_cache", q_cache)
    if q_cache.dim() != 2 or q_cache.shape[0] < 1:
        raise input_error(op, provider, "cos_sin_q_cache", "a 2-d tensor [chunk_len, rot] with "
                              "chunk_len >= 1", shape_text(q_cache))
    chunk_len, rot = q_cache.shape
    if rot % 2 != 0 or rot <= 0 or rot > head_size:
        raise input_error(op, provider, "cos_sin_q_cache", f"an even rotary width 0 < rot <= "
                              f"head_size={head_size} in dim 1", shape_text(q_cache))
    for name, c in caches.items():
        c = check_tensor(op, provider, name, c)
        if c.dtype != q_cache.dtype:
            raise input_error(op, provider, name, f"cos_sin_q_cache's dtype {q_cache.dtype}",
                                  c.dtype)
        rows = "max_position" if name == "cos_sin_k_cache" else str(chunk_len)
        if c.dim() != 2 or c.shape[1] != rot or (
                name != "cos_sin_k_cache" and c.shape[0] != chunk_len):
            raise input_error(op, provider, name, f"shape [{rows}, {rot}] (like "
                                  f"cos_sin_q_cache)", shape_text(c))
    others = dict(caches, positions=positions, key=key)
    if offsets is not None:
        others["offsets"] = offsets
    check_same_device(op, provider, query, **others)
    if read_data:
        check_dual_chunk_rotary_embedding_values(positions, cos_sin_k_cache, offsets,
                                                 provider=provider)


def check_dual_chunk_rotary_embedding_values(positions: Tensor, cos_sin_k_cache: Tensor,
                                             offsets: Tensor | None = None, *,
                                             provider: str = "native") -> None:
    """The value check of :func:`check_dual_chunk_rotary_embedding` alone (its static checks
    passed): every position (plus its offset) indexes ``cos_sin_k_cache``; nothing when the
    index tensors hold no data."""
    if positions.shape[0] == 0 or not has_data(positions) or (
            offsets is not None and not has_data(offsets)):
        return
    pos = positions.long() if offsets is None else positions.long() + offsets.long()
    lo, hi = int(pos.min()), int(pos.max())
    max_pos = cos_sin_k_cache.shape[0]
    if lo < 0 or hi >= max_pos:
        what = "positions" if offsets is None else "positions + offsets"
        raise input_error("dual_chunk_rotary_embedding", provider, "positions",
                          f"{what} in [0, {max_pos}) (cos_sin_k_cache rows)",
                          f"values in [{lo}, {hi}]")
