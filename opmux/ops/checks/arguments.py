"""The argument checks every op family shares, and the one error they raise.

Every ``check_<op>`` function of :mod:`opmux.ops.checks` takes the op's arguments (same
names and order), plus ``provider`` (named in the error) and ``read_data``. Static
properties (type, dtype, rank, sizes, contiguity, device) are always checked; value checks
(index ranges) run only when ``read_data`` is true *and* the tensors hold data: never on meta
or fake tensors, never while tracing. Providers on devices where reading values costs a sync
pass ``read_data=False``. The native reference and every provider of an op call the same
``check_<op>`` (with their own ``provider`` name), so a provider never accepts what native
rejects.

Every error is an :class:`opmux.OpInputError` built by :func:`input_error`, with ``.op``
(``"opmux::name"``), ``.provider`` and ``.argument`` set and one message format::

    opmux::rms_norm (provider 'cpp'): argument 'eps' expected a non-negative float, got -1.0

It is raised before the op writes anything.

The helpers here (``check_tensor``, ``check_floating``, ``check_int``, ...) check one
argument each. Size conditions go through :func:`require`, which turns a symbolic condition
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

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check_bool",
    "check_contiguous",
    "check_devices",
    "check_dtype",
    "check_float_tensor",
    "check_floating",
    "check_int",
    "check_rank",
    "check_real",
    "check_same_device",
    "check_tensor",
    "checked_fake",
    "has_data",
    "input_error",
    "is_concrete",
    "kernel_error",
    "require",
    "shape_text",
    "value_text",
]

FLOAT_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""Floating dtypes the native references accept."""

INDEX_DTYPES: Final = (torch.int32, torch.int64)
"""Dtypes accepted for block tables, sequence lengths and query offsets."""

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


def shape_text(t: Tensor) -> str:
    """``t``'s shape as an error message shows it: ``shape [2, 8]``."""
    return f"shape {list(t.shape)}"


def value_text(value: object) -> str:
    """A non-tensor argument as an error message shows it: its type, and its value when
    that is a number or a string (``int 3``, ``list``)."""
    return f"{type(value).__name__} {value!r}" if isinstance(value, (int, float, str)) \
        else type(value).__name__


def check_tensor(op: str, provider: str, name: str, t: object) -> Tensor:
    """``t`` must be a ``torch.Tensor``; returns it (typed)."""
    if not isinstance(t, Tensor):
        raise input_error(op, provider, name, "a torch.Tensor", value_text(t))
    return t


def check_floating(op: str, provider: str, name: str, t: Tensor) -> None:
    """``t`` must have one of :data:`FLOAT_DTYPES`."""
    if t.dtype not in FLOAT_DTYPES:
        raise input_error(op, provider, name,
                          "a floating tensor (float32/float16/bfloat16/float64)", t.dtype)


def check_float_tensor(op: str, provider: str, name: str, t: object) -> Tensor:
    """``t`` must be a ``torch.Tensor`` with one of :data:`FLOAT_DTYPES`; returns it (typed)."""
    t = check_tensor(op, provider, name, t)
    check_floating(op, provider, name, t)
    return t


def check_dtype(op: str, provider: str, name: str, t: Tensor,
                dtypes: Sequence[torch.dtype]) -> None:
    """``t.dtype`` must be one of ``dtypes``."""
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise input_error(op, provider, name, f"dtype {want}", t.dtype)


def check_rank(op: str, provider: str, name: str, t: Tensor, rank: int, layout: str) -> None:
    """``t`` must have ``rank`` dimensions (``layout`` names them, e.g. ``"[T, H, D]"``)."""
    if t.dim() != rank:
        raise input_error(op, provider, name, f"a {rank}-d tensor {layout}", shape_text(t))


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
    devices, so a meta tensor among CPU tensors is refused.
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
                          f"strides {list(t.stride())} for {shape_text(t)}")


def check_int(op: str, provider: str, name: str, value: object, *,
              minimum: int | None = None) -> None:
    """``value`` must be an int (not a bool; ``SymInt`` accepted) and ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise input_error(op, provider, name, "an int", value_text(value))
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
        raise input_error(op, provider, name, "a float", value_text(value))
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
        raise input_error(op, provider, name, "a bool", value_text(value))


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
