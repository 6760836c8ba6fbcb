"""Default provider order of the CUDA plugin, per op (platforms ``cuda`` and ``rocm``).

Every op puts ``triton`` before ``native``. ``cuda_c`` goes first only for the two
launch-bound decode bookkeeping ops, ``advance_step_flashattn`` and ``reshape_and_cache``:
each moves a few KiB per decode step, so its cost is the launch itself, and a launch through
a ``TORCH_LIBRARY`` op is a C++ dispatcher call while a Triton launch goes through Triton's
Python launcher (argument specialisation, cache lookup), which takes longer on the host. For
the bandwidth-bound ops (``rms_norm``, ``silu_and_mul``) the Triton kernels are the default:
they are autotuned per shape, keep short rows in registers, and the simple one-block-per-row
C++ kernels have no such tuning, so ``cuda_c`` follows ``triton`` there. Where ``cuda_c`` is
not built (CPU torch, no nvcc, ROCm), it is dropped from the list when the priority is set, so
the same table serves every machine.

These orders follow from the structure of the kernels above, not from GPU timings;
``benchmarks/gpu_kernels.py`` prints the numbers to revisit them, and ``OPMUX_PRIORITY``
overrides them per deployment.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_PRIORITY", "PLATFORMS", "default_priority"]

PLATFORMS: Final = ("cuda", "rocm")
"""Platforms this plugin serves (ROCm torch uses the ``CUDA`` dispatch key too)."""

DEFAULT_PRIORITY: Final[dict[str, tuple[str, ...]]] = {
    "silu_and_mul": ("triton", "cuda_c", "native"),
    "gelu_and_mul": ("triton", "native"),
    "rms_norm": ("triton", "cuda_c", "native"),
    "fused_add_rms_norm": ("triton", "native"),
    "rotary_embedding": ("triton", "native"),
    "reshape_and_cache": ("cuda_c", "triton", "native"),
    "paged_attention": ("triton", "native"),
    "advance_step_flashattn": ("cuda_c", "triton", "native"),
    "apply_rotary_emb": ("triton", "native"),
    "dual_chunk_rotary_embedding": ("triton", "native"),
}
"""Op name -> provider order on the CUDA and ROCm platforms."""


def default_priority(op_name: str, platform_name: str) -> list[str] | None:
    """The order for ``op_name`` on ``platform_name``, or None when this plugin has no opinion.

    :param op_name: catalog op name.
    :param platform_name: the current platform's name.
    """
    if platform_name not in PLATFORMS:
        return None
    order = DEFAULT_PRIORITY.get(op_name)
    return list(order) if order is not None else None
