"""What the ``cpp`` provider's modules share: the kernel namespace, the dtypes the kernels
take, and the call that turns a kernel's refusal into the op's :class:`opmux.OpInputError`."""

from collections.abc import Callable
from typing import Any, Final

import torch
from torch import Tensor

from opmux.ops.checks import kernel_error

PROVIDER: Final = "cpp"
"""Provider name of the C++ CPU kernels."""

FLOATS: Final = (torch.float32, torch.bfloat16, torch.float16)
"""Floating dtypes every kernel takes."""

K = torch.ops.opmux_cpu
"""The kernels' torch namespace (``csrc/cpu/bindings.cpp``; each kernel file adds its ops)."""


def cpu_float(t: object) -> bool:
    """``t`` is a CPU tensor of a dtype in :data:`FLOATS`."""
    return isinstance(t, Tensor) and t.is_cpu and t.dtype in FLOATS


def call(op: str, kernel: Callable[..., Any], *args: Any) -> None:
    """Run ``kernel(*args)`` for catalog op ``op``; a ``ValueError`` (the kernel's own check)
    becomes the standard :class:`opmux.OpInputError` naming ``op`` and provider ``cpp``."""
    try:
        kernel(*args)
    except ValueError as exc:
        raise kernel_error(op, PROVIDER, exc) from None
