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

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
from torch import Tensor

from opmux.core.errors import OpInputError
from opmux.ops._check_memo import StaticMemo

__all__ = [
    "checked_fake",
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check_advance_step_flashattn",
    "checked_advance_step",
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

# layouts that passed the static checks of the ops engines call every step
_SILU_AND_MUL: Final = StaticMemo()
_RMS_NORM: Final = StaticMemo()
_FUSED_ADD_RMS_NORM: Final = StaticMemo()
_ROTARY_EMBEDDING: Final = StaticMemo()

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


def checked_fake(check: Callable[..., None], like: str, position: int
                 ) -> Callable[..., Tensor]:
    """A fake (meta) implementation for an op whose output is a fresh contiguous tensor
    shaped like its argument ``like`` (at ``position``): it runs ``check`` on the op's
    arguments without reading index values, then returns that empty tensor."""

    def fake(*args: Any, **kwargs: Any) -> Tensor:
        check(*args, **kwargs, read_data=False)
        ref = args[position] if position < len(args) else kwargs[like]
        return torch.empty_like(ref, memory_format=torch.contiguous_format)

    return fake


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
    layout = _SILU_AND_MUL.seen(provider, (x,))
    if layout is not True:
        _check_gated("silu_and_mul", provider, x)
        _SILU_AND_MUL.add(layout)


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
    layout = _RMS_NORM.seen(provider, (x, weight, eps))
    if layout is not True:
        _check_norm("rms_norm", provider, x, weight, eps)
        check_devices("rms_norm", provider, {"x": x, "weight": weight})
        _RMS_NORM.add(layout)


def check_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                             *, provider: str = "native", read_data: bool = True) -> None:
    """Validate ``fused_add_rms_norm``: as :func:`check_rms_norm`, plus ``residual`` with
    x's shape, dtype and device."""
    layout = _FUSED_ADD_RMS_NORM.seen(provider, (x, residual, weight, eps))
    if layout is not True:
        _static_fused_add_rms_norm(x, residual, weight, eps, provider)
        _FUSED_ADD_RMS_NORM.add(layout)


def _static_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                               provider: str) -> None:
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
    layout = _ROTARY_EMBEDDING.seen(provider, (positions, query, key, cos_sin_cache,
                                                head_size, is_neox))
    if layout is not True:
        _static_rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox,
                                 provider)
        _ROTARY_EMBEDDING.add(layout)
    if read_data and positions.numel() > 0 and has_data(positions):
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


# the cache and attention checks live in their own module (size budget); re-exported here
from opmux.ops._cache_checks import (  # noqa: E402
    check_advance_step_flashattn,
    check_paged_attention,
    check_reshape_and_cache,
    checked_advance_step,
)
