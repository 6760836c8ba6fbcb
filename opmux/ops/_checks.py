"""Input validation of the catalog ops: one error builder, one message format, one check per op.

Every ``check_<op>`` function takes the op's arguments (same names and order), plus
``provider`` (named in the error) and ``read_data``. Static properties (type, dtype, rank,
sizes, contiguity, device) are always checked; value checks (index ranges) run only when
``read_data`` is true *and* the tensors hold data: never on meta or fake tensors, never
while tracing. Providers on devices where reading values costs a sync pass
``read_data=False``. The native reference and every provider of an op call the same
``check_<op>`` (with their own ``provider`` name), so a provider never accepts what native
rejects (#11).

Every error is an :class:`opmux.OpInputError` built by :func:`input_error`, with ``.op``
(``"opmux::name"``), ``.provider`` and ``.argument`` set and one message format::

    opmux::rms_norm (provider 'cpp'): argument 'eps' expected a non-negative float, got -1.0

It is raised before the op writes anything.

The helpers (``check_tensor``, ``check_floating``, ``check_int``, ...) are shared by every
op family. Size conditions go through :func:`require`, which turns a symbolic condition
(``torch.SymBool`` under ``torch.compile(dynamic=True)``) into a deferred runtime assert
(``torch._check``) instead of a guard, and helpers never call ``int()``/``bool()`` on a
symbolic size, so checks never specialise a compiled graph.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from typing import Final

import torch
from torch import Tensor

from opmux.core.errors import OpInputError

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check_advance_step_flashattn",
    "check_bool",
    "check_contiguous",
    "check_devices",
    "check_dtype",
    "check_floating",
    "check_fused_add_rms_norm",
    "check_gelu_and_mul",
    "check_int",
    "check_paged_attention",
    "check_rank",
    "check_real",
    "check_reshape_and_cache",
    "check_rms_norm",
    "check_rotary_embedding",
    "check_same_device",
    "check_silu_and_mul",
    "check_tensor",
    "has_data",
    "input_error",
    "is_concrete",
    "kernel_error",
    "require",
    "rotary_heads",
]

FLOAT_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""Floating dtypes the native references accept."""

INDEX_DTYPES: Final = (torch.int32, torch.int64)
"""Dtypes accepted for block tables, sequence lengths and query offsets."""

GELU_APPROXIMATIONS: Final = ("none", "tanh")
"""Valid values of ``gelu_and_mul``'s ``approximate``."""

_ARGUMENT_RE: Final = re.compile(r"argument '([A-Za-z_][A-Za-z0-9_]*)'")
_PREFIX_RE: Final = re.compile(r"^[\w:]+ \(provider '\w+'\): ")


def _qualname(op: str) -> str:
    return op if "::" in op else f"opmux::{op}"


def input_error(op: str, provider: str, argument: str, expected: str,
                got: object) -> OpInputError:
    """Build the one error every check raises.

    Message: ``opmux::op (provider 'p'): argument 'a' expected E, got G``; the error
    carries ``op`` (qualified), ``provider`` and ``argument``.

    :param op: op name, bare (``"rms_norm"``, namespace ``opmux``) or qualified.
    :param provider: the provider that refused the call (``"native"``, ``"cpp"``, ...).
    :param argument: the offending argument's name.
    :param expected: what the op needs, as a phrase (``"a 2-d tensor [T, H*D]"``).
    :param got: what it received (formatted with ``str``).
    """
    qualname = _qualname(op)
    return OpInputError(
        f"{qualname} (provider {provider!r}): argument {argument!r} expected {expected}, "
        f"got {got}", op=qualname, provider=provider, argument=argument,
    )


def kernel_error(op: str, provider: str, exc: BaseException,
                 argument: str | None = None) -> OpInputError:
    """Wrap an error a compiled kernel raised for bad input into the standard error.

    The shared checks run before any kernel, so this is the backstop for a condition only
    the kernel can see. The argument is taken from ``argument``, else from the kernel's
    message (``argument 'x'``), else ``"<kernel>"``.
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _PREFIX_RE.sub("", text)
    if argument is None:
        found = _ARGUMENT_RE.search(text)
        argument = found.group(1) if found else "<kernel>"
    qualname = _qualname(op)
    return OpInputError(f"{qualname} (provider {provider!r}): argument {argument!r} rejected "
                        f"by the kernel: {text}", op=qualname, provider=provider,
                        argument=argument)


def is_concrete(*values: object) -> bool:
    """Whether none of ``values`` is symbolic (``SymInt``/``SymFloat``/``SymBool``)."""
    return not any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
                   for v in values)


def require(ok: object, op: str, provider: str, argument: str,
            expected: str | Callable[[], str], got: object) -> None:
    """Raise :func:`input_error` unless ``ok``.

    A symbolic ``ok`` (``torch.SymBool`` while tracing with dynamic shapes) becomes a
    deferred runtime assert (``torch._check``), so the check adds no guard and never
    specialises the graph; a concrete ``ok`` is tested directly. ``expected`` may be a
    function returning the phrase (and ``got`` a function returning the value), so a passing
    check formats nothing.
    """
    if isinstance(ok, torch.SymBool):
        torch._check(ok, lambda: str(input_error(op, provider, argument, str(_text(expected)),
                                                 _text(got))))
        return
    if not ok:
        raise input_error(op, provider, argument, str(_text(expected)), _text(got))


def _text(value: object) -> object:
    return value() if callable(value) else value


def has_data(*tensors: Tensor) -> bool:
    """Whether the values of ``tensors`` can be read (not meta, not fake, not tracing)."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t.is_meta:
            return False
        if type(t) is not Tensor:  # subclasses only: a plain tensor is never fake
            from torch._subclasses.fake_tensor import is_fake

            if is_fake(t):
                return False
    return True


def _shape(t: Tensor) -> str:
    return f"shape {list(t.shape)}"


def _type_name(value: object) -> str:
    return f"{type(value).__name__} {value!r}" if isinstance(value, (int, float, str)) \
        else type(value).__name__


def check_tensor(op: str, provider: str, name: str, t: object) -> Tensor:
    """``t`` must be a ``torch.Tensor``; returns it (typed)."""
    if not isinstance(t, Tensor):
        raise input_error(op, provider, name, "a torch.Tensor", _type_name(t))
    return t


def check_floating(op: str, provider: str, name: str, t: Tensor) -> None:
    """``t`` must have one of :data:`FLOAT_DTYPES`."""
    if t.dtype not in FLOAT_DTYPES:
        raise input_error(op, provider, name,
                          "a floating tensor (float32/float16/bfloat16/float64)", t.dtype)


def check_dtype(op: str, provider: str, name: str, t: Tensor,
                dtypes: Sequence[torch.dtype]) -> None:
    """``t.dtype`` must be one of ``dtypes``."""
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise input_error(op, provider, name, f"dtype {want}", t.dtype)


def check_rank(op: str, provider: str, name: str, t: Tensor, rank: int, layout: str) -> None:
    """``t`` must have ``rank`` dimensions (``layout`` names them, e.g. ``"[T, H, D]"``)."""
    if t.dim() != rank:
        raise input_error(op, provider, name, f"a {rank}-d tensor {layout}", _shape(t))


def check_same_device(op: str, provider: str, ref: Tensor, **others: Tensor) -> None:
    """Every tensor of ``others`` must sit on ``ref``'s device (meta and CPU are different)."""
    for name, t in others.items():
        if t.device != ref.device:
            raise input_error(op, provider, name, f"device {ref.device} (like the other "
                              f"tensor arguments)", t.device)


def check_devices(op: str, provider: str, tensors: dict[str, Tensor]) -> None:
    """All ``tensors`` (name -> tensor, in argument order) must share one device.

    The error names the odd one out: the first tensor whose device differs from the device
    most of them share (ties: the first argument's device). Meta and CPU are different
    devices, so a meta tensor among CPU tensors is refused (#11).
    """
    it = iter(tensors.values())
    first = next(it, None)
    if first is None:
        return
    device = first.device
    if all(t.device == device for t in it):
        return
    counts: dict[torch.device, int] = {}
    for t in tensors.values():
        counts[t.device] = counts.get(t.device, 0) + 1
    ref = max(counts, key=lambda dev: (counts[dev], dev == device))
    for name, t in tensors.items():
        if t.device != ref:
            raise input_error(op, provider, name, f"device {ref} (like the other tensor "
                              f"arguments)", t.device)


def check_contiguous(op: str, provider: str, name: str, t: Tensor) -> None:
    """``t`` must be contiguous."""
    if not t.is_contiguous():
        raise input_error(op, provider, name, "a contiguous tensor",
                          f"strides {list(t.stride())} for {_shape(t)}")


def check_int(op: str, provider: str, name: str, value: object, *,
              minimum: int | None = None) -> None:
    """``value`` must be an int (not a bool; ``SymInt`` accepted) and ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise input_error(op, provider, name, "an int", _type_name(value))
    if minimum is not None:
        require(value >= minimum, op, provider, name,
                "a positive int" if minimum == 1 else f"an int >= {minimum}", value)


def check_real(op: str, provider: str, name: str, value: object, *,
               minimum: float | None = None, positive: bool = False) -> None:
    """``value`` must be a real number (int or float, not bool, not NaN).

    :param minimum: lower bound (inclusive).
    :param positive: require ``value > 0``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.SymInt,
                                                         torch.SymFloat)):
        raise input_error(op, provider, name, "a float", _type_name(value))
    if isinstance(value, float) and math.isnan(value):
        raise input_error(op, provider, name, "a float that is not NaN", value)
    if positive:
        require(value > 0, op, provider, name, "a positive float", value)
    elif minimum is not None:
        require(value >= minimum, op, provider, name,
                "a non-negative float" if minimum == 0 else f"a float >= {minimum}", value)


def check_bool(op: str, provider: str, name: str, value: object) -> None:
    """``value`` must be a bool."""
    if not isinstance(value, (bool, torch.SymBool)):
        raise input_error(op, provider, name, "a bool", _type_name(value))


# private names kept for the checks below that predate the public helpers
_tensor = check_tensor
_float = check_floating
_dtype = check_dtype
_rank = check_rank
_same_device = check_same_device
_contiguous = check_contiguous


# ---------------------------------------------------------------------------- activations
def _check_gated(op: str, provider: str, x: Tensor) -> None:
    x = check_tensor(op, provider, "x", x)
    check_floating(op, provider, "x", x)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., 2*d] with at least one dimension",
                          _shape(x))
    require(x.shape[-1] % 2 == 0, op, provider, "x",
            "a tensor [..., 2*d] with an even last dimension", lambda: _shape(x))


def check_silu_and_mul(x: Tensor, *, provider: str = "native", read_data: bool = True) -> None:
    """Validate ``silu_and_mul(x)``: a floating ``x[..., 2*d]`` (at least 1-d)."""
    _check_gated("silu_and_mul", provider, x)


def check_gelu_and_mul(x: Tensor, approximate: str = "none", *, provider: str = "native",
                       read_data: bool = True) -> None:
    """Validate ``gelu_and_mul(x, approximate)``; ``approximate`` is ``"none"``/``"tanh"``."""
    _check_gated("gelu_and_mul", provider, x)
    if not isinstance(approximate, str) or approximate not in GELU_APPROXIMATIONS:
        raise input_error("gelu_and_mul", provider, "approximate",
                          f"one of {sorted(GELU_APPROXIMATIONS)}", repr(approximate))


# ---------------------------------------------------------------------------------- norms
def _check_norm(op: str, provider: str, x: Tensor, weight: Tensor, eps: float) -> None:
    x = check_tensor(op, provider, "x", x)
    weight = check_tensor(op, provider, "weight", weight)
    check_floating(op, provider, "x", x)
    check_floating(op, provider, "weight", weight)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., d] with at least one dimension",
                          _shape(x))
    d = x.shape[-1]
    if weight.dim() != 1:
        raise input_error(op, provider, "weight", "a 1-d tensor [d] (x's last dimension)",
                          _shape(weight))
    require(weight.shape[0] == d, op, provider, "weight",
            lambda: f"shape [{d}] (x's last dimension)", lambda: _shape(weight))
    check_real(op, provider, "eps", eps, minimum=0.0)


def check_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, provider: str = "native",
                   read_data: bool = True) -> None:
    """Validate ``rms_norm(x, weight, eps)``: floating ``x[..., d]``, ``weight[d]`` on x's
    device, ``eps`` a non-negative, non-NaN float."""
    _check_norm("rms_norm", provider, x, weight, eps)
    check_devices("rms_norm", provider, {"x": x, "weight": weight})


def check_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                             *, provider: str = "native", read_data: bool = True) -> None:
    """Validate ``fused_add_rms_norm``: as :func:`check_rms_norm`, plus ``residual`` with
    x's shape, dtype and device."""
    op = "fused_add_rms_norm"
    _check_norm(op, provider, x, weight, eps)
    residual = check_tensor(op, provider, "residual", residual)
    if residual.dim() != x.dim():
        raise input_error(op, provider, "residual", f"x's shape {list(x.shape)}",
                          _shape(residual))
    for a, b in zip(residual.shape, x.shape, strict=True):
        require(a == b, op, provider, "residual", lambda: f"x's shape {list(x.shape)}",
                lambda: _shape(residual))
    if residual.dtype != x.dtype:
        raise input_error(op, provider, "residual", f"x's dtype {x.dtype}", residual.dtype)
    check_devices(op, provider, {"x": x, "residual": residual, "weight": weight})


# --------------------------------------------------------------------------------- rotary
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
                       _shape(t))


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
                lambda: _shape(t))
    if per_head:
        require(t.shape[-1] == head_size, op, provider, name,
                lambda: _rotary_layouts(pshape, head_size), lambda: _shape(t))
    else:
        require(t.shape[-1] % head_size == 0, op, provider, name,
                lambda: f"{_rotary_layouts(pshape, head_size)}; the last dimension a "
                f"multiple of head_size={head_size}", lambda: _shape(t))


def check_rotary_embedding(positions: Tensor, query: Tensor, key: Tensor,
                           cos_sin_cache: Tensor, head_size: int, is_neox: bool = True, *,
                           provider: str = "native", read_data: bool = True) -> None:
    """Validate ``rotary_embedding``; reads ``positions`` (range) when ``read_data``.

    Layouts (#19): ``positions`` has any shape ``P`` (at least 1-d; its elements are the
    tokens); ``query`` and ``key`` are ``[*P, heads*head_size]`` (flattened heads) or
    ``[*P, heads, head_size]`` (per-head), told apart by their rank.
    """
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
                          "least one dimension ([T] or [batch, seq])", _shape(positions))
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
            lambda: _shape(cos_sin_cache))
    check_devices(op, provider, {"positions": positions, "query": query, "key": key,
                                 "cos_sin_cache": cos_sin_cache})
    if read_data and positions.numel() > 0 and has_data(positions):
        lo_t, hi_t = torch.aminmax(positions)
        lo, hi = int(lo_t), int(hi_t)
        max_pos = cos_sin_cache.shape[0]
        if lo < 0 or hi >= max_pos:
            raise input_error(op, provider, "positions",
                              f"values in [0, {max_pos}) (cos_sin_cache rows)",
                              f"values in [{lo}, {hi}]")


# ---------------------------------------------------------------------------------- cache
_CACHE_LAYOUT: Final = "[num_blocks, block_size, Hkv, D]"


def _no_overlap(op: str, provider: str, name: str, t: Tensor) -> None:
    # a written tensor must not alias itself (an expanded, stride-0 view): the writes would
    # race and their result would depend on the order. Symbolic layouts are checked when the
    # compiled graph runs the op on real tensors.
    if not is_concrete(*t.shape, *t.stride()):
        return
    if torch._debug_has_internal_overlap(t) == 1:
        raise input_error(op, provider, name, "a tensor whose elements do not overlap "
                          "(no stride-0 dimension of size > 1)",
                          f"strides {list(t.stride())} for {_shape(t)}")


def _check_cache_pair(op: str, provider: str, key_cache: Tensor,
                      value_cache: Tensor) -> tuple[int, int, int, int]:
    """Shapes, dtypes and device of the paged caches; returns ``(num_blocks, block_size,
    Hkv, D)`` (symbolic under ``torch.compile``, never ``int()``-ed).

    Any strides are accepted (#19): NHD or permuted HND buffers, K and V as two views of one
    allocation (``kv[:, 0]``, ``kv[:, 1]``), block-sliced views.
    """
    key_cache = check_tensor(op, provider, "key_cache", key_cache)
    value_cache = check_tensor(op, provider, "value_cache", value_cache)
    check_rank(op, provider, "key_cache", key_cache, 4, _CACHE_LAYOUT)
    check_floating(op, provider, "key_cache", key_cache)
    check_rank(op, provider, "value_cache", value_cache, 4, _CACHE_LAYOUT)
    for a, b in zip(value_cache.shape, key_cache.shape, strict=True):
        require(a == b, op, provider, "value_cache",
                lambda: f"key_cache's shape {list(key_cache.shape)}", lambda: _shape(value_cache))
    if value_cache.dtype != key_cache.dtype:
        raise input_error(op, provider, "value_cache", f"key_cache's dtype {key_cache.dtype}",
                          value_cache.dtype)
    check_same_device(op, provider, key_cache, value_cache=value_cache)
    nb, bs, hkv, d = key_cache.shape
    require(bs > 0, op, provider, "key_cache", f"{_CACHE_LAYOUT} with a positive block_size "
            "in dim 1", lambda: _shape(key_cache))
    require(hkv > 0, op, provider, "key_cache", f"{_CACHE_LAYOUT} with a positive Hkv in "
            "dim 2", lambda: _shape(key_cache))
    require(d > 0, op, provider, "key_cache", f"{_CACHE_LAYOUT} with a positive D in dim 3",
            lambda: _shape(key_cache))
    return nb, bs, hkv, d


def check_reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                            slot_mapping: Tensor, *, provider: str = "native",
                            read_data: bool = True) -> None:
    """Validate ``reshape_and_cache``; reads ``slot_mapping`` (range) when ``read_data``.

    The caches may be any strided, non-overlapping view of ``[num_blocks, block_size, Hkv,
    D]`` with a positive block size, Hkv and D; ``key``/``value`` and ``slot_mapping`` any
    view of their shapes.
    """
    op = "reshape_and_cache"
    nb, bs, hkv, d = _check_cache_pair(op, provider, key_cache, value_cache)
    _no_overlap(op, provider, "key_cache", key_cache)
    _no_overlap(op, provider, "value_cache", value_cache)
    key = check_tensor(op, provider, "key", key)
    value = check_tensor(op, provider, "value", value)
    slot_mapping = check_tensor(op, provider, "slot_mapping", slot_mapping)
    check_rank(op, provider, "key", key, 3, "[T, Hkv, D]")
    require(key.shape[1] == hkv, op, provider, "key",
            lambda: f"[T, {hkv}, {d}] (the cache's Hkv and D)", lambda: _shape(key))
    require(key.shape[2] == d, op, provider, "key",
            lambda: f"[T, {hkv}, {d}] (the cache's Hkv and D)", lambda: _shape(key))
    check_rank(op, provider, "value", value, 3, "[T, Hkv, D] (key's shape)")
    for a, b in zip(value.shape, key.shape, strict=True):
        require(a == b, op, provider, "value", lambda: f"key's shape {list(key.shape)}",
                lambda: _shape(value))
    for name, t in (("key", key), ("value", value)):
        if t.dtype != key_cache.dtype:
            raise input_error(op, provider, name, f"the cache's dtype {key_cache.dtype}",
                              t.dtype)
    check_dtype(op, provider, "slot_mapping", slot_mapping, (torch.int64,))
    check_rank(op, provider, "slot_mapping", slot_mapping, 1, "[T] (one slot per token)")
    require(slot_mapping.shape[0] == key.shape[0], op, provider, "slot_mapping",
            lambda: f"shape [{key.shape[0]}] (one slot per token)", lambda: _shape(slot_mapping))
    check_same_device(op, provider, key_cache, key=key, value=value, slot_mapping=slot_mapping)
    if read_data and slot_mapping.numel() > 0 and has_data(slot_mapping):
        _check_slots(op, provider, slot_mapping, nb * bs)


_FEW_SLOTS: Final = 256
"""Up to this many tokens the slot values are checked in Python (a few microseconds for a
decode batch, against tens for the tensor ops)."""


def _check_slots(op: str, provider: str, slot_mapping: Tensor, num_slots: int) -> None:
    if slot_mapping.numel() <= _FEW_SLOTS:
        values = slot_mapping.tolist()
        lo, hi = min(values), max(values)
        used = [v for v in values if v >= 0]
        repeated = len(used) - len(set(used))
    else:
        # no boolean-mask indexing: it costs milliseconds at a few thousand tokens here
        lo, hi = (int(v) for v in torch.aminmax(slot_mapping))
        ordered = torch.sort(slot_mapping.reshape(-1)).values
        repeated = int(((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).sum())
    if lo < -1 or hi >= num_slots:
        raise input_error(op, provider, "slot_mapping",
                          f"-1 (skip) or slots in [0, {num_slots}) (num_blocks*block_size)",
                          f"values in [{lo}, {hi}]")
    if repeated:
        # two tokens writing one slot would leave a provider-dependent winner
        raise input_error(op, provider, "slot_mapping", "distinct slots (each slot written "
                          "at most once per call; -1 may repeat)",
                          f"{repeated} repeated slot(s)")


def check_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor,
                          block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                          scale: float, sliding_window: int | None = None,
                          soft_cap: float | None = None, *, provider: str = "native",
                          read_data: bool = True) -> None:
    """Validate ``paged_attention``; reads the index tensors when ``read_data``.

    Static checks: the caches as in :func:`check_reshape_and_cache` (any strides, overlap
    allowed since they are only read); ``query [T, H, D]`` in the caches' dtype with
    ``H % Hkv == 0``; int32/int64 index tensors of matching lengths; ``scale`` a real
    number; ``sliding_window`` None or a positive int; ``soft_cap`` None or a positive float
    (0 and negative values are errors, never "none": one meaning everywhere).

    Value checks: ``query_start_loc`` starts at 0, never decreases and ends at most at T;
    ``0 <= kv_len <= max_blocks*block_size``; ``q_len <= kv_len``; every block a sequence
    reads lies in ``[0, num_blocks)``.
    """
    op = "paged_attention"
    query = check_tensor(op, provider, "query", query)
    nb, bs, hkv, d = _check_cache_pair(op, provider, key_cache, value_cache)
    check_rank(op, provider, "query", query, 3, "[T, H, D]")
    if query.dtype != key_cache.dtype:
        raise input_error(op, provider, "query", f"the cache's dtype {key_cache.dtype}",
                          query.dtype)
    # sizes stay symbolic under torch.compile: int() would specialise them (#11 item 6)
    num_tokens, heads, head_size = query.shape
    require(head_size == d, op, provider, "query",
            lambda: f"head size {d} (the cache's D) in dim 2", lambda: _shape(query))
    require(heads % hkv == 0, op, provider, "query",
            lambda: f"a head count divisible by the cache's Hkv={hkv}", lambda: f"H={heads}")
    block_tables = check_tensor(op, provider, "block_tables", block_tables)
    seq_lens = check_tensor(op, provider, "seq_lens", seq_lens)
    query_start_loc = check_tensor(op, provider, "query_start_loc", query_start_loc)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        check_dtype(op, provider, name, t, INDEX_DTYPES)
    check_rank(op, provider, "block_tables", block_tables, 2, "[S, max_blocks]")
    num_seqs, max_blocks = block_tables.shape
    check_rank(op, provider, "seq_lens", seq_lens, 1, "[S] (block_tables' S)")
    require(seq_lens.shape[0] == num_seqs, op, provider, "seq_lens",
            lambda: f"shape [{num_seqs}] (block_tables' S)", lambda: _shape(seq_lens))
    check_rank(op, provider, "query_start_loc", query_start_loc, 1, "[S + 1]")
    require(query_start_loc.shape[0] == num_seqs + 1, op, provider, "query_start_loc",
            lambda: f"shape [{num_seqs + 1}] (S + 1)", lambda: _shape(query_start_loc))
    check_real(op, provider, "scale", scale)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window,
                                                              (int, torch.SymInt)):
            raise input_error(op, provider, "sliding_window", "None or a positive int",
                              _type_name(sliding_window))
        require(sliding_window > 0, op, provider, "sliding_window", "None or a positive int",
                sliding_window)
    if soft_cap is not None:
        check_real(op, provider, "soft_cap", soft_cap)
        require(soft_cap > 0, op, provider, "soft_cap", "None or a positive float", soft_cap)
    # the cache (the engine's persistent state) sets the device the others must match
    check_same_device(op, provider, key_cache, query=query, block_tables=block_tables,
                      seq_lens=seq_lens, query_start_loc=query_start_loc)
    if not (read_data and has_data(block_tables, seq_lens, query_start_loc)):
        return
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if qsl[0] != 0 or any(b < a for a, b in itertools.pairwise(qsl)) or qsl[-1] > num_tokens:
        raise input_error(op, provider, "query_start_loc",
                          f"non-decreasing offsets from 0 to at most T={num_tokens}", qsl)
    for i, kv_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        if kv_len < 0 or kv_len > max_blocks * bs:
            raise input_error(op, provider, "seq_lens", f"values in [0, {max_blocks * bs}] "
                              f"(max_blocks*block_size) for sequence {i}", kv_len)
        if q_len > 0 and kv_len < q_len:
            raise input_error(op, provider, "seq_lens", f"kv_len >= q_len={q_len} (the "
                              f"queries are the last tokens of the sequence) for sequence {i}",
                              kv_len)
    needed = [(n + bs - 1) // bs for n in lens]
    if num_seqs and max(needed) > 0:
        cols = torch.arange(max_blocks, device=block_tables.device)
        used = cols.unsqueeze(0) < torch.tensor(needed, device=block_tables.device).unsqueeze(1)
        # unused columns read as block 0 (valid), so they never hide a bad id in use
        ids = torch.where(used, block_tables, 0)
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= nb:
            raise input_error(op, provider, "block_tables",
                              f"block ids in [0, {nb}) (num_blocks) for the blocks in use",
                              f"ids in [{lo}, {hi}]")


def check_advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int,
                                 input_tokens: Tensor, sampled_token_ids: Tensor,
                                 input_positions: Tensor, seq_lens: Tensor,
                                 slot_mapping: Tensor, block_tables: Tensor, *,
                                 provider: str = "native", read_data: bool = True) -> None:
    """Validate ``advance_step_flashattn``; reads ``seq_lens``/``block_tables`` when asked.

    The four state tensors are ``[num_seqs]`` vectors, any non-overlapping view (they are
    written in place; #11 asks every op to take strided views, so the contiguity rule of
    earlier versions is gone: providers whose kernels need contiguous state decline);
    ``sampled_token_ids`` is ``[num_queries]`` or ``[rows >= num_queries, 1]`` and
    ``block_tables`` ``[num_seqs, max_blocks]``, both any view. Value checks: each next
    position fits the block table and its block id is not negative.
    """
    op = "advance_step_flashattn"
    check_int(op, provider, "num_seqs", num_seqs, minimum=0)
    check_int(op, provider, "num_queries", num_queries, minimum=0)
    require(num_queries <= num_seqs, op, provider, "num_queries",
            lambda: f"an int in [0, num_seqs={num_seqs}]", num_queries)
    check_int(op, provider, "block_size", block_size, minimum=1)
    vectors = (("input_tokens", input_tokens, torch.int64),
               ("input_positions", input_positions, torch.int64),
               ("seq_lens", seq_lens, torch.int32),
               ("slot_mapping", slot_mapping, torch.int64))
    for name, t, dtype in vectors:
        t = check_tensor(op, provider, name, t)
        check_dtype(op, provider, name, t, (dtype,))
        check_rank(op, provider, name, t, 1, "[num_seqs]")
        require(t.shape[0] == num_seqs, op, provider, name,
                lambda: f"shape [{num_seqs}] (num_seqs)", lambda t=t: _shape(t))
        _no_overlap(op, provider, name, t)
    sampled = check_tensor(op, provider, "sampled_token_ids", sampled_token_ids)
    check_dtype(op, provider, "sampled_token_ids", sampled, (torch.int64,))
    if sampled.dim() == 1:
        require(sampled.shape[0] == num_queries, op, provider, "sampled_token_ids",
                lambda: f"shape [{num_queries}, 1] or [{num_queries}] (num_queries)",
                lambda: _shape(sampled))
    elif sampled.dim() == 2:
        require(sampled.shape[0] >= num_queries, op, provider, "sampled_token_ids",
                lambda: f"shape [{num_queries}, 1] (num_queries; extra rows are ignored)",
                lambda: _shape(sampled))
        require(sampled.shape[1] == 1, op, provider, "sampled_token_ids",
                lambda: f"shape [{num_queries}, 1] (num_queries)", lambda: _shape(sampled))
    else:
        raise input_error(op, provider, "sampled_token_ids",
                          f"shape [{num_queries}, 1] (num_queries)", _shape(sampled))
    block_tables = check_tensor(op, provider, "block_tables", block_tables)
    check_dtype(op, provider, "block_tables", block_tables, (torch.int32,))
    check_rank(op, provider, "block_tables", block_tables, 2, "[num_seqs, max_blocks]")
    require(block_tables.shape[0] == num_seqs, op, provider, "block_tables",
            lambda: f"shape [{num_seqs}, max_blocks] (num_seqs rows)",
            lambda: _shape(block_tables))
    check_same_device(op, provider, input_tokens, sampled_token_ids=sampled,
                      input_positions=input_positions, seq_lens=seq_lens,
                      slot_mapping=slot_mapping, block_tables=block_tables)
    if not (read_data and is_concrete(num_queries) and num_queries > 0
            and has_data(seq_lens, block_tables)):
        return
    lens = seq_lens[:num_queries]
    lo, hi = (int(v) for v in torch.aminmax(lens))
    capacity = int(block_tables.shape[1]) * block_size
    if lo < 0 or hi >= capacity:
        raise input_error(op, provider, "seq_lens", f"values in [0, {capacity}) (the next "
                          f"position must fit max_blocks*block_size) for the first "
                          f"{num_queries} sequences", f"values in [{lo}, {hi}]")
    blocks = block_tables[:num_queries].gather(1, (lens.long() // block_size).unsqueeze(1))
    if int(blocks.min()) < 0:
        raise input_error(op, provider, "block_tables", "non-negative block ids at the next "
                          "position of each sequence", blocks.flatten().tolist())
