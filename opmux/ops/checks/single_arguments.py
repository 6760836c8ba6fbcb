"""The checks of one argument every op family shares.

Each takes the op, the provider and the argument's name first, and raises the one error
(:func:`~opmux.ops.checks.input_errors.input_error`). :func:`check_int_range` is the one
integer-range check of the project: it takes the error class and the message's subject, so
layers and the engine use it with their own errors too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import torch
from torch import Tensor

from opmux.core.errors import OpInputError, OpmuxError
from opmux.ops.checks.input_errors import input_error, shape_text, value_text
from opmux.ops.checks.symbolic import require

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
    "check_int_range",
    "check_rank",
    "check_real",
    "check_same_device",
    "check_tensor",
]

FLOAT_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""Floating dtypes the native references accept."""

INDEX_DTYPES: Final = (torch.int32, torch.int64)
"""Dtypes accepted for block tables, sequence lengths and query offsets."""


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


def _int_range_text(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an int in [{low}, {high}]"
    if low is not None:
        return "a positive int" if low == 1 else f"an int >= {low}"
    return "an int" if high is None else f"an int <= {high}"


def check_int_range(value: Any, subject: str, *, low: int | None = None,
                    high: int | None = None, error: type[OpmuxError] = OpInputError,
                    **details: Any) -> Any:
    """``value`` when it is an int (not a bool; ``SymInt`` accepted) in ``[low, high]``.

    The message is ``"<subject> expected <range>, got <value>"`` (``"Engine: block_size
    expected an int in [1, 65536], got 0"``). A symbolic bound check becomes a deferred
    runtime assert (``torch._check``), never a guard.

    :param subject: who and what, the message's start (``"RMSNorm: hidden_size"``).
    :param error: the error class raised; ``details`` go to its constructor (the op
        checks' ``op``, ``provider`` and ``argument``).
    :raises error: ``value`` is not an int or out of range.
    """
    expected = _int_range_text(low, high)
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise error(f"{subject} expected {expected}, got {value_text(value)}", **details)
    for ok in (low is None or value >= low, high is None or value <= high):
        if isinstance(ok, torch.SymBool):
            torch._check(ok, lambda: f"{subject} expected {expected}, got {value}")
        elif not ok:
            raise error(f"{subject} expected {expected}, got {value}", **details)
    return value


def check_int(op: str, provider: str, name: str, value: object, *,
              minimum: int | None = None) -> None:
    """``value`` must be an int (not a bool; ``SymInt`` accepted) and ``>= minimum``."""
    qualname = op if "::" in op else f"opmux::{op}"
    check_int_range(value, f"{qualname} (provider {provider!r}): argument {name!r}",
                    low=minimum, op=qualname, provider=provider, argument=name)


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
