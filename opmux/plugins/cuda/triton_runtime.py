"""Triton availability and the small launch helpers the Triton kernel modules share.

Triton kernels run where Triton has an active GPU driver (CUDA or ROCm), or anywhere under
its interpreter (``TRITON_INTERPRET=1`` or ``triton.knobs.runtime.interpret``), which runs
kernels on CPU tensors with numpy. The interpreter is picked when ``@triton.jit`` runs, so
the kernel modules must be imported after it is switched on; nothing here imports them.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from opmux.core import config

__all__ = [
    "DTYPES",
    "PROVIDER",
    "cuda_capability",
    "interpreting",
    "next_pow2",
    "one_config_when_interpreting",
    "triton_status",
]

PROVIDER = "triton"
"""Provider name of every impl in the Triton kernel modules."""

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Floating dtypes the Triton kernels take."""


def interpreting() -> bool:
    """Whether Triton's interpreter is on (env var or knob); False when Triton is absent."""
    if config.triton_interpret():
        return True
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def cuda_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """Compute capability of the NVIDIA GPU that holds ``t``; ``None`` for any other device
    (CPU tensors under the interpreter, ROCm GPUs). For ``supports_args`` predicates of kernels
    that Triton lowers only on newer GPUs: a property of the argument, cached per device."""
    if t.device.type != "cuda" or torch.version.hip is not None:
        return None
    index = t.device.index
    return _capability(torch.cuda.current_device() if index is None else index)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def triton_status() -> tuple[bool, str]:
    """Whether Triton kernels can launch in this process, and why (not).

    :return: ``(supported, reason)``; the reason is human-readable either way.
    """
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'opmux[cuda]')"
    if interpreting():
        return True, "triton interpreter is on (TRITON_INTERPRET=1): kernels run on CPU tensors"
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return False, "torch is a CPU build (torch.version.cuda is None) and the interpreter is off"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False: no GPU driver is active"
    return True, f"GPU driver active ({torch.cuda.get_device_name(0)})"


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def one_config_when_interpreting(configs: Sequence[Any]) -> list[Any]:
    """Autotune config list: all of them on a GPU, only the first under the interpreter.

    Decided when a kernel module is imported (the same moment ``@triton.jit`` decides).
    """
    return list(configs[:1]) if interpreting() else list(configs)

